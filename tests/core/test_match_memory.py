"""The similarity search in chunks of sources (``best_destinations``' ``block``, ``SIMILARITY_BLOCK``) on every
requested backend: the same choice as the full source-by-destination product, on inputs of many chunks.

Exactness: a BLAS rounds a row of a matrix product differently depending on how many rows it is given (numpy's
and torch's CPU products do, measured), so chunked and unchunked similarities of arbitrary floats may differ in
the last bit. The identity tests therefore use tokens whose cosine similarities are exact in float32 (entries
0 or +-2^e, 0, 1 or 4 of them non-zero, so every norm is a power of two): any summation order gives the same
bits, and exact ties are frequent, which checks that the first of equal destinations wins across chunks as in
one product. Arbitrary floats are checked to agree within rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tome_core import load_backend
from tome_core.algorithm import match as match_module
from tome_core.algorithm.match import best_destinations, bipartite_matches, chunk_matches

NUMPY = load_backend("numpy")


def exact_tokens(rng: np.random.Generator, batch: int, tokens: int, channels: int, zeros: bool = True) -> np.ndarray:
    """``[batch, tokens, channels]`` float32 tokens whose cosine similarities are exact in float32. Without
    ``zeros`` no token is zero, so a batch of 4 side by side (a shared match) has norm 2, exact too."""
    out = np.zeros((batch, tokens, channels), np.float32)
    for b in range(batch):
        for t in range(tokens):
            count = rng.choice([k for k in ((0, 1, 4) if zeros else (1, 4)) if k <= channels])
            where = rng.choice(channels, size=count, replace=False)
            out[b, t, where] = rng.choice([-1.0, 1.0], size=count) * 2.0 ** rng.integers(-3, 4)
    return out


def reference(metric: np.ndarray, src: np.ndarray, dst: np.ndarray):
    """numpy brute force: the full similarity product, its row maxima and their first indices."""
    norm = np.sqrt((metric * metric).sum(-1, keepdims=True))
    unit = metric / np.where(norm == 0, 1, norm)
    scores = unit[:, src] @ np.swapaxes(unit[:, dst], -1, -2)
    return scores, scores.max(-1), scores.argmax(-1)


@st.composite
def search_cases(draw):
    num_src, num_dst = draw(st.integers(1, 40), label="sources"), draw(st.integers(1, 12), label="destinations")
    return dict(
        batch=draw(st.integers(1, 3), label="batch"), channels=draw(st.integers(1, 6), label="channels"),
        num_src=num_src, num_dst=num_dst, block=draw(st.integers(1, num_src * num_dst + 5), label="block"),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def indices(case, xp):
    """Sources and destinations interleaved over the tokens (as a partition places them), numpy and ``xp``."""
    tokens = case["num_src"] + case["num_dst"]
    order = np.random.default_rng(case["seed"]).permutation(tokens)
    src, dst = np.sort(order[:case["num_src"]]), np.sort(order[case["num_src"]:])
    return src, dst, xp.asarray(src), xp.asarray(dst)


@settings(max_examples=40, deadline=None)
@given(case=search_cases())
def test_chunked_search_is_the_full_search(xp, case):
    """Exact similarities: every chunking gives the full product's maxima and first maximal indices, bit for
    bit, on every backend (the numpy brute force is the oracle; the backend's own unchunked run agrees too)."""
    rng = np.random.default_rng(case["seed"])
    metric = exact_tokens(rng, case["batch"], case["num_src"] + case["num_dst"], case["channels"])
    src, dst, xsrc, xdst = indices(case, xp)
    _, best, which = reference(metric, src, dst)
    chunked = best_destinations(xp.ops, xp.asarray(metric), xsrc, xdst, block=case["block"])
    whole = best_destinations(xp.ops, xp.asarray(metric), xsrc, xdst, block=case["num_src"] * case["num_dst"])
    for got in (chunked, whole):
        np.testing.assert_array_equal(xp.numpy(got[0]), best)
        np.testing.assert_array_equal(xp.numpy(got[1]), which)


@settings(max_examples=40, deadline=None)
@given(case=search_cases())
def test_chunked_search_agrees_within_rounding_on_any_floats(xp, case):
    """Arbitrary floats: the maxima agree within rounding, and each chosen destination is (within rounding) a
    most similar one."""
    rng = np.random.default_rng(case["seed"])
    metric = rng.standard_normal((case["batch"], case["num_src"] + case["num_dst"], case["channels"])).astype(np.float32)
    src, dst, xsrc, xdst = indices(case, xp)
    scores, best, _ = reference(metric, src, dst)
    got_best, got_which = best_destinations(xp.ops, xp.asarray(metric), xsrc, xdst, block=case["block"])
    np.testing.assert_allclose(xp.numpy(got_best), best, rtol=0, atol=1e-6)
    chosen = np.take_along_axis(scores, xp.numpy(got_which)[..., None].astype(np.int64), -1)[..., 0]
    assert (chosen >= best - 1e-6).all()


class Padding:
    """The backend ``ops`` whose ``aligned_columns`` pads with zero columns to a multiple of 8, as torch does on
    CUDA, so that the CPU tests exercise the columns the search must slice off."""

    def __init__(self, ops):
        self.ops = ops

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def aligned_columns(self, x):
        extra = -self.ops.shape(x)[-1] % 8
        if not extra:
            return x
        return self.ops.concat([x, self.ops.zeros((*self.ops.shape(x)[:-1], extra), x)], axis=-1)


@settings(max_examples=40, deadline=None)
@given(case=search_cases())
def test_columns_padded_for_the_product_never_match(xp, case):
    """With the destinations padded by zero columns (similarity 0), every chunking gives the unpadded search:
    bit for bit on exact similarities, and never a padded column where every real similarity is negative (each
    source non-negative, each destination negative in every channel), where a padded one would be the best."""
    rng = np.random.default_rng(case["seed"])
    metric = exact_tokens(rng, case["batch"], case["num_src"] + case["num_dst"], case["channels"], zeros=False)
    src, dst, xsrc, xdst = indices(case, xp)
    _, best, which = reference(metric, src, dst)
    got = best_destinations(Padding(xp.ops), xp.asarray(metric), xsrc, xdst, block=case["block"])
    np.testing.assert_array_equal(xp.numpy(got[0]), best)
    np.testing.assert_array_equal(xp.numpy(got[1]), which)

    metric[:, src] = np.abs(metric[:, src])
    metric[:, dst] = -(np.abs(metric[:, dst]) + rng.uniform(0.5, 1.0, metric[:, dst].shape).astype(np.float32))
    scores, best, _ = reference(metric, src, dst)
    assert (best < 0).all()
    got_best, got_which = best_destinations(Padding(xp.ops), xp.asarray(metric), xsrc, xdst, block=case["block"])
    got_which = xp.numpy(got_which).astype(np.int64)
    assert (got_which < case["num_dst"]).all()
    np.testing.assert_allclose(xp.numpy(got_best), best, rtol=0, atol=1e-6)
    assert (np.take_along_axis(scores, got_which[..., None], -1)[..., 0] >= best - 1e-6).all()


def test_a_block_is_the_limit_in_entries_per_batch_item(monkeypatch):
    """Sources go in equal chunks whose block stays within the limit; the module constant is the default."""
    seen = []
    real_matmul = NUMPY.matmul

    class Counting:
        def __getattr__(self, name):
            return getattr(NUMPY, name)

        def matmul(self, a, b):
            seen.append(a.shape[1] * b.shape[2])
            return real_matmul(a, b)

    metric = exact_tokens(np.random.default_rng(0), 2, 40, 4)
    src, dst = np.arange(30), np.arange(30, 40)
    best_destinations(Counting(), metric, src, dst, block=70)  # 7 rows fit: 5 chunks of 6
    assert seen == [60] * 5
    seen.clear()
    monkeypatch.setattr(match_module, "SIMILARITY_BLOCK", 100)  # 10 rows fit: 3 chunks of 10
    best_destinations(Counting(), metric, src, dst)
    assert seen == [100] * 3
    seen.clear()
    best_destinations(Counting(), metric, src, dst, block=300)  # one product, as before
    assert seen == [300]


@pytest.mark.parametrize("block", [0, -1, 2.5, "8", True])
def test_a_bad_block_is_refused(block):
    metric = np.ones((1, 4, 2), np.float32)
    with pytest.raises(ValueError, match=r"block must be an int >= 1 \(similarity entries per batch item\), got"):
        best_destinations(NUMPY, metric, np.arange(2), np.arange(2, 4), block=block)


@settings(max_examples=15, deadline=None)
@given(
    h=st.integers(2, 8), w=st.integers(2, 8), frames=st.integers(2, 3), reference_frame=st.integers(0, 2),
    shared=st.booleans(), block=st.integers(1, 40), seed=st.integers(0, 2**32 - 1),
)
def test_matches_in_chunks_are_the_matches_in_one_product(xp, h, w, frames, reference_frame, shared, block, seed):
    """Through both callers (a frame's bipartite match, shared over the batch or not, and the cross-frame match):
    a tiny ``SIMILARITY_BLOCK`` gives the same merge as one product, on exact similarities."""
    rng = np.random.default_rng(seed)
    n = h * w
    metric = xp.asarray(exact_tokens(rng, 2 * frames, n, 4))
    frame_metric = xp.asarray(exact_tokens(rng, 4, n, 4, zeros=not shared))
    reference_frame = min(reference_frame, frames - 1)
    merged = [n // 4, n // 2]

    def run():
        frame = bipartite_matches(xp.ops, frame_metric, h, w, 2, 2, merged, None, shared=shared)
        cross = chunk_matches(xp.ops, metric, frames, reference_frame, h, w, 2, 2, merged, (frames - 1) * n // 2, None)
        return [(xp.numpy(m.rows), xp.numpy(m.sizes)) for m in frame + cross]

    whole = run()
    default = match_module.SIMILARITY_BLOCK
    match_module.SIMILARITY_BLOCK = block
    try:
        chunked = run()
    finally:
        match_module.SIMILARITY_BLOCK = default
    for (rows, sizes), (rows_whole, sizes_whole) in zip(chunked, whole):
        np.testing.assert_array_equal(rows, rows_whole)
        np.testing.assert_array_equal(sizes, sizes_whole)


def test_chunks_trace_with_static_shapes(xp):
    """The chunk count comes from shapes alone: the search traces whole under torch.compile (fullgraph) and
    jax.jit and gives the eager result."""
    if xp.name not in ("torch", "jax"):
        pytest.skip(f"{xp.name} has no tracing compiler to check")
    metric = exact_tokens(np.random.default_rng(1), 2, 40, 4)
    src, dst = xp.asarray(np.arange(30)), xp.asarray(np.arange(30, 40))
    search = lambda m, s, d: best_destinations(xp.ops, m, s, d, block=70)  # noqa: E731
    if xp.name == "torch":
        import torch

        traced = torch.compile(search, fullgraph=True, backend="eager")
    else:
        import jax

        traced = jax.jit(search)
    eager = search(xp.asarray(metric), src, dst)
    got = traced(xp.asarray(metric), src, dst)
    for a, b in zip(got, eager):
        np.testing.assert_array_equal(xp.numpy(a), xp.numpy(b))
