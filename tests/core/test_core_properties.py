"""Property tests of the core on every requested backend, with numpy brute force as the oracle."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tome_core import bipartite_match, cell_match, load_backend, merge, unmerge
from tome_core.algorithm.match import sampled_cell_match
from tome_core.algorithm.partition import random_offsets, split
from tome_tools.oracle import FirstTokens, first_tokens_match

NUMPY = load_backend("numpy")


@st.composite
def cases(draw):
    sx, sy = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    h, w = draw(st.integers(1, 11)), draw(st.integers(1, 11))
    batch, channels = draw(st.integers(1, 3), label="batch"), draw(st.integers(1, 6), label="channels")
    num_dst = (h // sy) * (w // sx)
    merged = draw(st.integers(0, h * w - num_dst)) if num_dst else 0
    use_rand = draw(st.booleans())
    step = draw(st.integers(0, 1000))
    seed = draw(st.integers(0, 2**31))
    return dict(batch=batch, h=h, w=w, channels=channels, sx=sx, sy=sy, merged=merged, use_rand=use_rand, step=step, seed=seed)


def make(case, xp, data_seed):
    rng = np.random.default_rng(data_seed)
    n = case["h"] * case["w"]
    metric = rng.standard_normal((case["batch"], n, case["channels"])).astype(np.float32)
    x = rng.standard_normal((case["batch"], n, 5)).astype(np.float32)
    offsets = None
    if case["use_rand"] and (case["h"] // case["sy"]) * (case["w"] // case["sx"]):
        offsets = random_offsets(
            xp.ops, xp.asarray(metric), case["h"], case["w"], case["sx"], case["sy"], case["seed"], case["step"], 3
        )
    match = bipartite_match(
        xp.ops, xp.asarray(metric), case["h"], case["w"], case["sx"], case["sy"], case["merged"], offsets
    )
    return metric, x, offsets, match


@settings(max_examples=60, deadline=None)
@given(case=cases(), data_seed=st.integers(0, 2**32 - 1))
def test_match_properties_against_brute_force(xp, numpy_partition, case, data_seed):
    metric, x, offsets, match = make(case, xp, data_seed)
    n, r = case["h"] * case["w"], case["merged"]
    merged = xp.numpy(merge(xp.asarray(x), match))
    restored = xp.numpy(unmerge(merge(xp.asarray(x), match), match))
    assert merged.shape == (case["batch"], n - r, 5)
    assert restored.shape == x.shape
    if r == 0:
        np.testing.assert_array_equal(merged, x)
        np.testing.assert_array_equal(restored, x)
        return
    slot = xp.numpy(match.slot)
    sizes = xp.numpy(match.sizes)[..., 0]
    is_dst = numpy_partition(case, None if offsets is None else xp.numpy(offsets))
    # Brute force cosine similarity and choice.
    unit = metric / np.maximum(np.linalg.norm(metric, axis=-1, keepdims=True), 1e-30)
    for b in range(case["batch"]):
        src, dst = np.flatnonzero(~is_dst), np.flatnonzero(is_dst)
        scores = unit[b, src] @ unit[b, dst].T
        best = scores.max(axis=1)
        # Each destination keeps its own slot; a source shares a slot only with a destination.
        assert len(set(slot[b, dst])) == len(dst)
        shared = np.isin(slot[b, src], slot[b, dst])
        assert shared.sum() == r
        if r < len(src):
            assert best[shared].min() >= best[~shared].max() - 1e-5
        # A merged source goes to (one of) its most similar destinations.
        dst_of = {s: d for s, d in zip(slot[b, dst], dst)}
        for s in np.flatnonzero(shared):
            chosen = np.flatnonzero(dst == dst_of[slot[b, src[s]]])[0]
            assert scores[s, chosen] >= best[s] - 1e-5
        # Slots cover 0..N-r-1, sizes count them, and merging averages each slot's tokens.
        np.testing.assert_array_equal(np.bincount(slot[b], minlength=n - r), sizes[b])
        expected = np.zeros((n - r, 5))
        np.add.at(expected, slot[b], x[b])
        np.testing.assert_allclose(merged[b], expected / sizes[b][:, None], rtol=1e-5, atol=1e-5)
        # Unmerge gives every token its slot's value; unmerged tokens come back exactly.
        np.testing.assert_allclose(restored[b], merged[b][slot[b]], rtol=0, atol=0)
        alone = sizes[b][slot[b]] == 1
        np.testing.assert_allclose(restored[b][alone], x[b][alone], rtol=1e-6, atol=1e-6)
    # Merge preserves the size-weighted sum of the tokens.
    np.testing.assert_allclose((merged * sizes[..., None]).sum(1), x.sum(1), rtol=1e-4, atol=1e-4)


def near_ties(metric, case, offsets, gap=1e-5):
    """Whether two similarities that decide the match are within ``gap`` (each source's best and second-best
    destination, or two sources' best scores), so that backends' float rounding may choose differently."""
    dst, src = split(NUMPY, metric, case["h"], case["w"], case["sx"], case["sy"], offsets)
    unit = metric / np.maximum(np.linalg.norm(metric, axis=-1, keepdims=True), 1e-30)
    scores = np.sort(unit[:, src] @ unit[:, dst].transpose(0, 2, 1), axis=-1)
    best = scores[..., -1]
    close = scores.shape[-1] > 1 and bool((best - scores[..., -2] < gap).any())
    return close or bool((np.diff(np.sort(best, axis=-1), axis=-1) < gap).any())


@settings(max_examples=40, deadline=None)
@given(case=cases(), data_seed=st.integers(0, 2**32 - 1))
def test_backend_equals_numpy_reference(xp, case, data_seed):
    metric, x, offsets, match = make(case, xp, data_seed)
    class NumpyConverter:
        ops = NUMPY
        asarray = staticmethod(lambda a: a)
        numpy = staticmethod(np.asarray)
    _, _, ref_offsets, ref = make(case, NumpyConverter, data_seed)
    if offsets is not None:
        np.testing.assert_array_equal(xp.numpy(offsets), ref_offsets)
    assert match.merged == ref.merged
    if ref.merged and near_ties(metric, case, ref_offsets):
        return  # backends' float rounding may order near-tied similarities differently
    if ref.merged:
        np.testing.assert_array_equal(xp.numpy(match.slot), ref.slot)
    np.testing.assert_allclose(xp.numpy(merge(xp.asarray(x), match)), merge(x, ref), rtol=1e-5, atol=1e-6)
    y = np.random.default_rng(data_seed).standard_normal((case["batch"], match.kept, 3)).astype(np.float32)
    np.testing.assert_array_equal(xp.numpy(unmerge(xp.asarray(y), match)), unmerge(y, ref))


@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_partition_is_a_permutation_with_one_destination_per_cell(xp, numpy_partition, case):
    h, w, sx, sy = case["h"], case["w"], case["sx"], case["sy"]
    like = xp.asarray(np.zeros((1,), np.float32))
    offsets = None
    if case["use_rand"] and (h // sy) * (w // sx):
        offsets = random_offsets(xp.ops, like, h, w, sx, sy, case["seed"], case["step"], 0)
        assert xp.numpy(offsets).min() >= 0 and xp.numpy(offsets).max() < sx * sy
    dst, src = (xp.numpy(a) for a in split(xp.ops, like, h, w, sx, sy, offsets))
    np.testing.assert_array_equal(np.sort(np.concatenate([src, dst])), np.arange(h * w))
    np.testing.assert_array_equal(
        np.flatnonzero(numpy_partition(case, None if offsets is None else xp.numpy(offsets))), np.sort(dst)
    )


def test_random_offsets_are_spread_and_depend_on_every_key(xp):
    like = xp.asarray(np.zeros((1,), np.float32))
    draws = np.stack(
        [xp.numpy(random_offsets(xp.ops, like, 64, 64, 2, 2, 0, step, 0)).ravel() for step in range(50)]
    )
    counts = np.bincount(draws.ravel(), minlength=4) / draws.size
    assert np.all(np.abs(counts - 0.25) < 0.02), counts
    # Consecutive cells and consecutive steps do not repeat one another.
    assert np.mean(draws[:, 1:] == draws[:, :-1]) < 0.3
    assert np.mean(draws[1:] == draws[:-1]) < 0.3
    base = xp.numpy(random_offsets(xp.ops, like, 64, 64, 2, 2, 0, 7, 0))
    for changed in ((1, 7, 0), (0, 8, 0), (0, 7, 1)):
        other = xp.numpy(random_offsets(xp.ops, like, 64, 64, 2, 2, *changed))
        assert np.mean(other == base) < 0.4, changed


@pytest.mark.parametrize("step", [7, 0.375, "array"])
def test_random_offsets_of_several_streams_are_each_streams_own(xp, step):
    """Drawn for every block stream at once (one set of array operations per call), row i is stream i's own
    partition, for Python and on-device steps and seeds above the prime."""
    like = xp.asarray(np.zeros((1,), np.float32))
    step = xp.asarray(np.asarray(0.625, np.float32)) if step == "array" else step
    for seed in (0, 40_000):
        table = xp.numpy(random_offsets(xp.ops, like, 12, 10, 2, 3, seed, step, xp.ops.arange(5, like)))
        assert table.shape == (5, 4, 5)
        for stream in range(5):
            own = xp.numpy(random_offsets(xp.ops, like, 12, 10, 2, 3, seed, step, stream))
            np.testing.assert_array_equal(table[stream], own)
        assert len({row.tobytes() for row in table}) == 5  # the streams differ: the check can fail


def test_zero_vectors_match_without_nan(xp):
    metric = np.zeros((1, 16, 4), np.float32)
    match = bipartite_match(xp.ops, xp.asarray(metric), 4, 4, 2, 2, 8, None)
    out = xp.numpy(merge(xp.asarray(np.ones((1, 16, 2), np.float32)), match))
    assert np.all(np.isfinite(out)) and out.shape == (1, 8, 2)


def test_grid_must_hold_the_tokens(xp):
    with pytest.raises(ValueError, match="grid 3x3 has 9 tokens but the metric has 16"):
        bipartite_match(xp.ops, xp.asarray(np.zeros((1, 16, 4), np.float32)), 3, 3, 2, 2, 1, None)


@settings(max_examples=40, deadline=None)
@given(case=cases(), data_seed=st.integers(0, 2**32 - 1))
def test_shared_match_follows_the_batch_mean_similarity_and_slots_stand_at_their_destination(xp, numpy_partition, case, data_seed):
    """shared=True (rotary models): one match for every item, chosen by the mean over the batch of the
    per-item cosine similarities; each slot's representative is its destination (or the kept source)."""
    from tome_core.algorithm.match import bipartite_matches

    rng = np.random.default_rng(data_seed)
    n, r = case["h"] * case["w"], case["merged"]
    metric = rng.standard_normal((case["batch"], n, case["channels"])).astype(np.float32)
    (match,) = bipartite_matches(
        xp.ops, xp.asarray(metric), case["h"], case["w"], case["sx"], case["sy"], [r], None, 0, True
    )
    if r == 0:
        assert match.merged == 0
        return
    slot, reps = xp.numpy(match.slot), xp.numpy(match.representatives)
    for b in range(1, case["batch"]):
        np.testing.assert_array_equal(slot[b], slot[0])
        np.testing.assert_array_equal(reps[b], reps[0])
    is_dst = numpy_partition(case, None)
    src, dst = np.flatnonzero(~is_dst), np.flatnonzero(is_dst)
    unit = metric / np.maximum(np.linalg.norm(metric, axis=-1, keepdims=True), 1e-30)
    scores = np.mean([unit[b, src] @ unit[b, dst].T for b in range(case["batch"])], axis=0)
    best = scores.max(axis=1)
    merged_src = np.isin(slot[0, src], slot[0, dst])
    assert merged_src.sum() == r
    if r < len(src):
        assert best[merged_src].min() >= best[~merged_src].max() - 1e-5
    # Representatives: a slot stands at its destination; a kept source at itself.
    for k in range(n - r):
        members = np.flatnonzero(slot[0] == k)
        members_dst = members[is_dst[members]]
        assert reps[0, k] == (members_dst[0] if len(members_dst) else members[0])


@st.composite
def cell_cases(draw):
    sx, sy = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    h, w = draw(st.integers(1, 13)), draw(st.integers(1, 13))
    return dict(batch=draw(st.integers(1, 3)), h=h, w=w, sx=sx, sy=sy, channels=draw(st.integers(1, 5)))


@settings(max_examples=60, deadline=None)
@given(case=cell_cases(), data_seed=st.integers(0, 2**32 - 1))
def test_cell_match_pools_each_full_cell_and_keeps_leftovers(xp, case, data_seed):
    """Brute force: walk the cells; every token of a full cell gets the cell's mean, leftover tokens stay."""
    batch, h, w, sx, sy = (case[k] for k in ("batch", "h", "w", "sx", "sy"))
    x = np.random.default_rng(data_seed).standard_normal((batch, h * w, case["channels"])).astype(np.float32)
    match = cell_match(xp.ops, xp.asarray(x), batch, h, w, sx, sy)
    grid = x.reshape(batch, h, w, -1)
    expected = grid.copy()
    cells = []
    for i in range(h // sy):
        for j in range(w // sx):
            block = grid[:, i * sy : (i + 1) * sy, j * sx : (j + 1) * sx]
            expected[:, i * sy : (i + 1) * sy, j * sx : (j + 1) * sx] = block.mean(axis=(1, 2), keepdims=True)
            cells.append(block.mean(axis=(1, 2)))
    full = h // sy * sy, w // sx * sx
    leftover = [grid[:, r, c] for r in range(full[0]) for c in range(full[1], w)] + [
        grid[:, r, c] for r in range(full[0], h) for c in range(w)
    ]
    pooling = len(cells) > 0 and sx * sy > 1
    assert match.merged == (h * w - len(cells) - len(leftover) if pooling else 0)
    merged = xp.numpy(merge(xp.asarray(x), match))
    if pooling:  # slots: the cells in row-major order, then the leftover tokens in row-major order
        np.testing.assert_allclose(merged, np.stack(cells + leftover, axis=1), rtol=1e-5, atol=1e-6)
        sizes = xp.numpy(match.sizes)[..., 0]
        assert sizes.sum(axis=1).tolist() == [h * w] * batch
        assert (match.pool is not None) == (not leftover)
    np.testing.assert_allclose(
        xp.numpy(unmerge(merge(xp.asarray(x), match), match)), expected.reshape(batch, h * w, -1), rtol=1e-5, atol=1e-6
    )


@settings(max_examples=60, deadline=None)
@given(case=cell_cases(), data_seed=st.integers(0, 2**32 - 1), first=st.booleans())
def test_sampled_cell_match_takes_one_token_of_each_cell(xp, case, data_seed, first):
    """Brute force: each full cell becomes the token at its offset (the first without offsets), leftover tokens
    stay, unmerge gives the cell's tokens that token's value; and over the sx*sy offsets shared by every cell
    the picks average to the cell's mean (cell_match, the oracle of average pooling)."""
    batch, h, w, sx, sy = (case[k] for k in ("batch", "h", "w", "sx", "sy"))
    rng = np.random.default_rng(data_seed)
    x = rng.standard_normal((batch, h * w, case["channels"])).astype(np.float32)
    offsets = None if first else rng.integers(0, sx * sy, (h // sy, w // sx))
    picked = lambda offsets: sampled_cell_match(
        xp.ops, xp.asarray(x), batch, h, w, sx, sy, None if offsets is None else xp.asarray(offsets)
    )
    match = picked(offsets)
    pooled = cell_match(xp.ops, xp.asarray(x), batch, h, w, sx, sy)
    assert match.merged == pooled.merged
    if not pooled.merged:
        np.testing.assert_array_equal(xp.numpy(merge(xp.asarray(x), match)), x)
        return
    grid = x.reshape(batch, h, w, -1)
    expected, cells = grid.copy(), []
    for i in range(h // sy):
        for j in range(w // sx):
            o = 0 if offsets is None else int(offsets[i, j])
            token = grid[:, i * sy + o // sx, j * sx + o % sx]
            expected[:, i * sy : (i + 1) * sy, j * sx : (j + 1) * sx] = token[:, None, None]
            cells.append(token)
    full = h // sy * sy, w // sx * sx
    leftover = [grid[:, r, c] for r in range(full[0]) for c in range(full[1], w)] + [
        grid[:, r, c] for r in range(full[0], h) for c in range(w)
    ]
    merged = merge(xp.asarray(x), match)
    np.testing.assert_array_equal(xp.numpy(merged), np.stack(cells + leftover, axis=1))
    np.testing.assert_array_equal(xp.numpy(unmerge(merged, match)), expected.reshape(batch, h * w, -1))
    np.testing.assert_array_equal(xp.numpy(match.sizes), xp.numpy(pooled.sizes))
    every = [xp.numpy(merge(xp.asarray(x), picked(np.full((h // sy, w // sx), o)))) for o in range(sx * sy)]
    np.testing.assert_allclose(np.mean(every, axis=0), xp.numpy(merge(xp.asarray(x), pooled)), rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3), tokens=st.integers(1, 40), fraction=st.floats(0, 1), channels=st.integers(1, 4),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_first_tokens_match_keeps_the_first_tokens_and_repeats_them(xp, batch, tokens, fraction, channels, data_seed):
    """Brute force: merge is the first ``kept`` tokens of each item, unmerge gives token i slot i % kept's value,
    each slot stands at its own position for one token; keeping every token is the identity."""
    kept = max(1, round(tokens * fraction))
    x = np.random.default_rng(data_seed).standard_normal((batch, tokens, channels)).astype(np.float32)
    match = first_tokens_match(xp.ops, xp.asarray(x), batch, tokens, kept)
    assert (match.tokens, match.kept, match.merged) == (tokens, kept, tokens - kept)
    merged = merge(xp.asarray(x), match)
    np.testing.assert_array_equal(xp.numpy(merged), x[:, :kept])
    np.testing.assert_array_equal(xp.numpy(unmerge(merged, match)), x[:, [i % kept for i in range(tokens)]])
    if kept == tokens:
        assert match.rows is None
        return
    np.testing.assert_array_equal(xp.numpy(match.representatives), np.tile(np.arange(kept), (batch, 1)))
    np.testing.assert_array_equal(xp.numpy(match.sizes), np.ones((batch, kept, 1)))
    np.testing.assert_array_equal(xp.numpy(match.slot), np.tile(np.arange(tokens) % kept, (batch, 1)))


@pytest.mark.parametrize("kind", ["similarity", "pooled", "sampled"])
def test_trailing_feature_axes_merge_as_one_channel_axis(xp, kind):
    """An attention output ``[B, N, heads, d]`` (Lumina-Next's) merges and unmerges as its ``[B, N, heads * d]``
    view: the same numbers, its axes given back."""
    rng = np.random.default_rng(3)
    batch, h, w, heads, d = 2, 4, 6, 3, 2
    x = rng.standard_normal((batch, h * w, heads, d)).astype(np.float32)
    flat = xp.asarray(x.reshape(batch, h * w, heads * d))
    if kind == "similarity":
        match = bipartite_match(xp.ops, flat, h, w, 2, 2, 10, None)
    elif kind == "pooled":
        match = cell_match(xp.ops, flat, batch, h, w, 2, 2)
    else:
        match = sampled_cell_match(xp.ops, flat, batch, h, w, 2, 2, None)
    merged = xp.numpy(merge(xp.asarray(x), match))
    assert merged.shape == (batch, match.kept, heads, d)
    np.testing.assert_array_equal(merged.reshape(batch, match.kept, -1), xp.numpy(merge(flat, match)))
    restored = xp.numpy(unmerge(xp.asarray(merged), match))
    assert restored.shape == x.shape
    np.testing.assert_array_equal(restored.reshape(batch, h * w, -1), xp.numpy(unmerge(merge(flat, match), match)))


@pytest.mark.parametrize("base, whole, short", [(16, 60, 30), (256.0, 4096, 1024), (4, 3, 2), (16, 60, 60), (16, 60, 1)])
def test_same_logarithm_keeps_the_logarithm_of_the_whole_count(base, whole, short):
    """Lumina-Next scales its softmax by ``sqrt(log_b(queries))``: the base given with ``short`` merged queries
    gives the logarithm ``whole`` queries had (where any base can: two tokens or more)."""
    import math

    from tome_core.hooks.block_hooks import same_logarithm

    given = same_logarithm(base, whole, short)
    if short < 2:
        assert given == base
    else:
        assert math.log(short, given) == pytest.approx(math.log(whole, base), rel=1e-12)


@st.composite
def oracle_cases(draw):
    """A grid, a batch and options of ToMe's arrangements (similarity at any reachable ratio, cells pooled or
    sampled), with the sub-layers they merge."""
    h, w, sx, sy = draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    options = {"sx": sx, "sy": sy, "use_rand": draw(st.booleans()), "merge_mlp": draw(st.booleans())}
    if draw(st.booleans()):
        options.update(matching="cell", cell_pool=draw(st.sampled_from(["mean", "sample"])))
    else:
        options["ratio"] = draw(st.floats(0, 1 - 1 / (sx * sy), exclude_max=True)) if sx * sy > 1 else 0.0
    return h, w, draw(st.integers(1, 3)), options


@settings(max_examples=60, deadline=None)
@given(case=oracle_cases(), data_seed=st.integers(0, 2**32 - 1))
def test_the_oracle_state_keeps_the_first_tokens_as_many_as_tome_keeps(xp, case, data_seed):
    """A run state whose matcher is the oracle's (tome_tools.oracle.FirstTokens) gives each merged sub-layer the
    first-tokens match of the count ToMe's own match keeps there (the same state, same call, same options)."""
    from tome_core import ToMeConfig, ToMeState
    from tome_core.hooks.call import CallFacts
    from tome_core.hooks.matching import Matching
    from tome_core.algorithm.match import TOME

    h, w, batch, options = case
    metric = xp.asarray(np.random.default_rng(data_seed).standard_normal((batch, h * w, 4)).astype(np.float32))
    found = []
    for oracle in (False, True):
        state = ToMeState(config=ToMeConfig.from_options(options), matching=Matching(FirstTokens() if oracle else TOME))
        state.begin_call(CallFacts((h, w), 500))
        state.enter_grid((h, w))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a grid too small to merge says so
            found.append(state.block_matches(metric, 0))
    ours, oracle = found
    assert {k: m.merged for k, m in ours.items()} == {k: m.merged for k, m in oracle.items()}
    for match in oracle.values():
        np.testing.assert_array_equal(xp.numpy(merge(metric, match)), xp.numpy(metric)[:, : match.kept])


@settings(max_examples=40, deadline=None)
@given(
    case=cases(), data_seed=st.integers(0, 2**32 - 1), before=st.integers(0, 5), after=st.integers(0, 4),
    shared=st.booleans(),
)
def test_a_joined_match_equals_the_grids_match_with_the_tokens_around_kept_apart(
    xp, case, data_seed, before, after, shared
):
    """A match from the tables that carries ``(before, after)`` tokens around the grid's (Flux's text in its
    single-stream blocks) merges, unmerges, sizes and places ``[before; grid; after]`` exactly as the grid's own
    match does with the tokens around it concatenated back: the oracle is the concatenation it replaces."""
    from tome_core.algorithm.match import partition_bipartite
    from tome_core.algorithm.merge import size_bias
    from tome_core.algorithm.partition import Draw, partition_grid

    ops, n = xp.ops, case["h"] * case["w"]
    rng = np.random.default_rng(data_seed)
    metric = xp.asarray(rng.standard_normal((case["batch"], n, case["channels"])).astype(np.float32))
    whole = rng.standard_normal((case["batch"], before + n + after, 5)).astype(np.float32)
    grid = (case["h"], case["w"], case["sx"], case["sy"])

    def match(around):
        draw = Draw(case["seed"], case["step"], 1, 3, {}) if case["use_rand"] else None
        return partition_bipartite(ops, metric, partition_grid(ops, metric, *grid, draw, around=around), [case["merged"]], shared)[0]

    own, joined = match((0, 0)), match((before, after))
    if own.merged == 0:
        return
    assert joined.joined == (before, after) and joined.tokens == before + n + after
    front, back = whole[:, :before], whole[:, before + n :]
    merged = xp.numpy(merge(xp.asarray(whole), joined))
    expected = np.concatenate([front, xp.numpy(merge(xp.asarray(whole[:, before : before + n]), own)), back], axis=1)
    np.testing.assert_array_equal(merged, expected)
    kept = own.kept
    expected = np.concatenate(
        [merged[:, :before], xp.numpy(unmerge(xp.asarray(merged[:, before : before + kept]), own)), merged[:, before + kept :]], axis=1
    )
    np.testing.assert_array_equal(xp.numpy(unmerge(xp.asarray(merged), joined)), expected)
    zeros = lambda count: np.zeros((case["batch"], 1, count), np.float32)  # noqa: E731
    like = xp.asarray(merged)
    expected = np.concatenate([zeros(before), xp.numpy(size_bias(own, like)), zeros(after)], axis=2)
    np.testing.assert_array_equal(xp.numpy(size_bias(joined, like)), expected)
    if shared:
        ids = lambda start, count: np.broadcast_to(np.arange(start, start + count), (case["batch"], count))  # noqa: E731
        expected = np.concatenate([ids(0, before), xp.numpy(own.representatives) + before, ids(before + n, after)], axis=1)
        np.testing.assert_array_equal(xp.numpy(joined.representatives), expected)
