"""Cross-frame matching (``chunk_matches``, VidToMe's arrangement) on every requested backend, against a numpy
brute force that builds the merged groups token by token, and against single-frame matching on chunks of
identical frames."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tome_core import bipartite_match, load_backend, merge, unmerge
from tome_core.algorithm.match import chunk_matches
from tome_core.algorithm.partition import random_offsets

NUMPY = load_backend("numpy")


@st.composite
def chunk_cases(draw):
    frames = draw(st.integers(2, 4), label="frames")
    sx, sy = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    h, w = draw(st.integers(2, 6)), draw(st.integers(2, 6))
    n = h * w
    num_dst = (h // sy) * (w // sx)
    return dict(
        frames=frames, chunks=draw(st.integers(1, 2), label="chunks"), h=h, w=w, sx=sx, sy=sy,
        reference=draw(st.integers(0, frames - 1)), within=draw(st.integers(0, n - num_dst)),
        across=draw(st.integers(0, (frames - 1) * n)), use_rand=draw(st.booleans()),
        window=draw(st.sampled_from([0, 0, 1])), channels=draw(st.integers(2, 5)),
    )


def unit(metric):
    return metric / np.maximum(np.linalg.norm(metric, axis=-1, keepdims=True), 1e-30)


def brute_force_groups(metric, case, offsets, numpy_partition):
    """``[chunks][K * N]`` group label of every token of each chunk, built one token at a time, and whether a
    near tie (within 1e-5) decides the result (backends' rounding may then choose differently)."""
    k, n, h, w = case["frames"], case["h"] * case["w"], case["h"], case["w"]
    chunks = metric.reshape(case["chunks"], k, n, -1)
    is_dst = numpy_partition(case, offsets)
    src, dst = np.flatnonzero(~is_dst), np.flatnonzero(is_dst)
    labels, tie = [], False
    for chunk in unit(chunks):
        ref = chunk[case["reference"]]
        label = np.full(k * n, -1)
        base = case["reference"] * n
        label[base:base + n] = base + np.arange(n)  # every reference token starts its own group
        if case["within"] and len(dst):
            scores = ref[src] @ ref[dst].T
            if case["window"]:  # a source sees the destinations of the cells within window cells of its own
                cell = lambda t, axis, size, count: np.minimum((t // w if axis == 0 else t % w) // size, count - 1)
                rows = [cell(t, 0, case["sy"], h // case["sy"]) for t in (src, dst)]
                cols = [cell(t, 1, case["sx"], w // case["sx"]) for t in (src, dst)]
                far = (np.abs(rows[0][:, None] - rows[1][None]) > case["window"]) | (np.abs(cols[0][:, None] - cols[1][None]) > case["window"])
                scores = np.where(far, -np.inf, scores)
            best = scores.max(1)
            order = np.argsort(-best, kind="stable")
            tie |= _close(best) or _second_close(scores)
            for s in order[: case["within"]]:
                label[base + src[s]] = base + dst[scores[s].argmax()]
        others = [f for f in range(k) if f != case["reference"]]
        tokens = np.array([f * n + p for f in others for p in range(n)])
        if case["across"]:
            scores = np.stack([chunk[t // n, t % n] @ ref.T for t in tokens])
            pos = tokens % n
            if case["window"]:
                rows, cols = np.arange(n) // w, np.arange(n) % w
                far = (np.abs(rows[pos][:, None] - rows[None]) > case["window"]) | (np.abs(cols[pos][:, None] - cols[None]) > case["window"])
                scores = np.where(far, -np.inf, scores)
            best = scores.max(1)
            order = np.argsort(-best, kind="stable")
            tie |= _close(best) or _second_close(scores)
            for s in order[: case["across"]]:
                label[tokens[s]] = label[base + scores[s].argmax()]
        label[label < 0] = np.flatnonzero(label < 0)  # other-frame tokens left alone
        labels.append(label)
    return labels, tie


def _close(values, gap=1e-5):
    ordered = np.sort(values[np.isfinite(values)])
    return bool((np.diff(ordered) < gap).any())


def _second_close(scores, gap=1e-5):
    if scores.shape[1] < 2:
        return False
    top = np.sort(np.where(np.isfinite(scores), scores, -1e9), axis=1)[:, -2:]
    return bool((top[:, 1] - top[:, 0] < gap).any())


def compute(xp, case, metric):
    offsets = None
    if case["use_rand"] and (case["h"] // case["sy"]) * (case["w"] // case["sx"]):
        offsets = random_offsets(xp.ops, xp.asarray(metric), case["h"], case["w"], case["sx"], case["sy"], 5, 321, 2)
    match = chunk_matches(
        xp.ops, xp.asarray(metric), case["frames"], case["reference"], case["h"], case["w"], case["sx"], case["sy"],
        [case["within"]], case["across"], offsets, case["window"],
    )[0]
    return match, None if offsets is None else xp.numpy(offsets)


@settings(max_examples=30, deadline=None)  # jax compiles every new shape: keep the count small
@given(case=chunk_cases(), data_seed=st.integers(0, 2**32 - 1))
def test_chunk_match_equals_brute_force_groups(xp, numpy_partition, case, data_seed):
    rng = np.random.default_rng(data_seed)
    k, n = case["frames"], case["h"] * case["w"]
    metric = rng.standard_normal((case["chunks"] * k, n, case["channels"])).astype(np.float32)
    x = rng.standard_normal((case["chunks"] * k, n, 3)).astype(np.float32)
    match, offsets = compute(xp, case, metric)
    if case["within"] == case["across"] == 0:
        assert (match.merged, match.batch, match.tokens) == (0, case["chunks"] * k, n)
        np.testing.assert_array_equal(xp.numpy(merge(xp.asarray(x), match)), x)
        return
    assert (match.batch, match.tokens, match.frames) == (case["chunks"], k * n, k)
    assert match.kept == k * n - case["within"] - case["across"]
    merged = merge(xp.asarray(x), match)
    assert tuple(xp.ops.shape(merged)) == (case["chunks"], match.kept, 3)
    restored = xp.numpy(unmerge(merged, match))
    assert restored.shape == x.shape
    labels, tie = brute_force_groups(metric, case, offsets, numpy_partition)
    if tie:
        return
    chunks = x.reshape(case["chunks"], k * n, 3)
    for label, tokens, got in zip(labels, chunks, restored.reshape(case["chunks"], k * n, 3)):
        assert len(set(label)) == match.kept
        means = {g: tokens[label == g].mean(0) for g in set(label)}
        np.testing.assert_allclose(got, np.stack([means[g] for g in label]), rtol=1e-5, atol=1e-5)
    sizes, slot = xp.numpy(match.sizes)[..., 0], xp.numpy(match.slot)
    for b, label in enumerate(labels):  # sizes count each group
        np.testing.assert_array_equal(sizes[b][slot[b]], np.bincount(label)[label])


@settings(max_examples=20, deadline=None)
@given(case=chunk_cases(), data_seed=st.integers(0, 2**32 - 1))
def test_identical_frames_merge_as_one_frame(xp, case, data_seed):
    """Every other-frame token merged: a chunk of identical frames gives one frame's merge, each slot K times
    as large (so size-aware attention over it equals attention over that frame's merge)."""
    rng = np.random.default_rng(data_seed)
    k, n = case["frames"], case["h"] * case["w"]
    one = rng.standard_normal((case["chunks"], 1, n, case["channels"])).astype(np.float32)
    metric = np.repeat(one, k, axis=1).reshape(case["chunks"] * k, n, -1)
    values = np.repeat(rng.standard_normal((case["chunks"], 1, n, 3)).astype(np.float32), k, axis=1).reshape(case["chunks"] * k, n, 3)
    case = dict(case, across=(k - 1) * n, window=0)
    directions = unit(one)
    cosines = directions @ directions.transpose(0, 1, 3, 2)
    if (cosines - 2 * np.eye(n) > 1 - 1e-4).any():
        return  # two tokens of nearly one direction: a copy may join either (float rounding decides)
    match, offsets = compute(xp, case, metric)
    single = bipartite_match(
        NUMPY, one[:, 0], case["h"], case["w"], case["sx"], case["sy"], case["within"], offsets
    )
    assert match.kept == single.kept
    np.testing.assert_allclose(xp.numpy(merge(xp.asarray(values), match)), merge(values.reshape(case["chunks"], k, n, 3)[:, 0], single), rtol=1e-5, atol=1e-5)
    if single.merged:
        np.testing.assert_allclose(xp.numpy(match.sizes), k * single.sizes)
    else:
        np.testing.assert_allclose(xp.numpy(match.sizes), np.full((case["chunks"], n, 1), k))


def test_reference_frame_as_an_index_array(xp):
    """A traced reference frame (an index array, as the random draw gives) matches as the same Python int."""
    rng = np.random.default_rng(0)
    metric = rng.standard_normal((6, 16, 4)).astype(np.float32)
    plain = chunk_matches(xp.ops, xp.asarray(metric), 3, 2, 4, 4, 2, 2, [6], 20, None)[0]
    traced = chunk_matches(xp.ops, xp.asarray(metric), 3, xp.asarray(np.array([2])), 4, 4, 2, 2, [6], 20, None)[0]
    assert plain.kept == traced.kept
    np.testing.assert_array_equal(xp.numpy(plain.rows), xp.numpy(traced.rows))
