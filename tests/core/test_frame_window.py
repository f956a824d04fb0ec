"""A video transformer's similarity search within nearby frames (``frame_window``): the runs of sources and the
destinations each meets (``partition.frame_bands``), and the search over them (``best_destinations``' ``bands``) on
every requested backend.

Oracles: the grid itself (which frame each token's row lies in) for what a source must and may meet, and the numpy
brute force of ``test_match_memory`` (the full similarity product), each source's maximum taken over the
destinations its run meets, bit for bit on tokens whose similarities are exact in float32.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tome_core import load_backend
from tome_core.algorithm.match import best_destinations, match_block
from tome_core.algorithm.partition import Draw, cell_table, frame_bands, frame_search, partition_grid, split

from .test_match_memory import exact_tokens, reference

NUMPY = load_backend("numpy")


@st.composite
def videos(draw, thin=True):
    """A grid of ``frames`` frames of ``frame_rows`` rows stacked, its first row being row ``offset`` of its frame and
    its last frame possibly cut short (a process's piece under context parallelism), its cells and a window.
    ``thin=False``: every frame's piece holds at least one cell's rows (``sy``)."""
    sx, sy = draw(st.integers(1, 3), label="sx"), draw(st.integers(1, 3), label="sy")
    frame_rows = draw(st.integers(1 if thin else sy, 7), label="frame_rows")
    frames = draw(st.integers(2, 6), label="frames")
    offset = draw(st.integers(0, frame_rows - (1 if thin else sy)), label="offset")
    cut = draw(st.integers(0, frame_rows - (1 if thin else sy)), label="cut")  # rows of the last frame left out
    h = frames * frame_rows - offset - cut
    w = draw(st.integers(1, 7), label="w")
    assume(h >= sy and w >= sx and sx * sy > 1)
    return dict(h=h, w=w, sx=sx, sy=sy, frame_rows=frame_rows, offset=offset, window=draw(st.integers(0, 3), label="window"))


def search_of(case):
    return frame_search(case["h"], case["w"], case["sx"], case["sy"], case["frame_rows"], case["window"], case["offset"])


def tokens_of(case, tiling=None):
    """``(src, dst)`` token indices in :func:`split`'s order (first position of each cell the destination)."""
    src_dst = split(NUMPY, np.zeros(1), case["h"], case["w"], case["sx"], case["sy"], None, tiling)
    return np.asarray(src_dst[1]), np.asarray(src_dst[0])


def frame_of(case, token):
    """The frame of ``token``'s row, counted from the grid's first row's."""
    return (np.asarray(token) // case["w"] + case["offset"]) // case["frame_rows"]


def group_of(tiling, case, token):
    """Which band of rows of ``tiling`` holds ``token``."""
    return np.searchsorted(np.cumsum(tiling), np.asarray(token) // case["w"], side="right")


def met(bands, source):
    """``(low, high)``: the destinations the band holding source position ``source`` meets."""
    return next((low, high) for first, end, low, high in bands if first <= source < end)


@settings(max_examples=150, deadline=None)
@given(case=videos(thin=False))
def test_a_source_meets_exactly_the_destinations_within_the_window(case):
    """Edges round three, 11: where every frame's piece holds a cell's rows, a source (in a cell or left over:
    an odd width, or rows of a frame no cell covers) meets every destination within ``window`` frames of its own
    and no other, a piece that starts mid-frame counted from its frame; no cell spans two frames."""
    search = search_of(case)
    frames = -(-(case["h"] + case["offset"]) // case["frame_rows"])
    if case["window"] >= frames - 1:
        assert search is None
        return
    assert search is not None and sum(search.tiling) == case["h"]
    assert [b[0] for b in search.bands] == [0] + [b[1] for b in search.bands[:-1]]
    src, dst = tokens_of(case, search.tiling)
    assert search.bands[-1][1] == len(src)
    cells = np.asarray(cell_table(NUMPY, np.zeros(1), case["h"], case["w"], case["sx"], case["sy"], search.tiling)[0])
    assert all(len(set(frame_of(case, cell))) == 1 for cell in cells)
    dst_frames = frame_of(case, dst)
    for i, s in enumerate(src):
        low, high = met(search.bands, i)
        near = np.flatnonzero(np.abs(dst_frames - frame_of(case, s)) <= case["window"])
        np.testing.assert_array_equal(np.arange(low, high), near, err_msg=str((case, s)))


@settings(max_examples=150, deadline=None)
@given(case=videos())
def test_frames_thinner_than_a_cell_are_tiled_with_the_next(case):
    """A frame's piece with fewer rows than a cell is tiled together with the next frames until the group holds
    ``sy`` rows (a short last group joins the one before), and a group's tokens meet exactly the destinations of the
    groups whose frames all lie within the window of one of its frames: what docs/video.md says of them."""
    search = search_of(case)
    if search is None:
        return
    tiling, spans = search.tiling, search.frames
    rows = np.cumsum((0,) + tiling)
    pieces = np.bincount((np.arange(case["h"]) + case["offset"]) // case["frame_rows"])
    for g, (first, last) in enumerate(spans):
        assert (first, last) == tuple(frame_of(case, np.array([rows[g], rows[g + 1] - 1]) * case["w"]))
        assert tiling[g] >= case["sy"]
        if last > first:  # joined: a thin piece inside, or a short last group
            assert min(pieces[first:last + 1]) < case["sy"] or g == len(spans) - 1
    src, dst = tokens_of(case, tiling)
    dst_group = group_of(tiling, case, dst)
    for i, s in enumerate(src):
        low, high = met(search.bands, i)
        first, last = spans[group_of(tiling, case, s)]
        allowed = [j for j, d in enumerate(dst_group) if spans[d][0] >= first - case["window"] and spans[d][1] <= last + case["window"]]
        assert list(range(low, high)) == allowed, (case, s)


@settings(max_examples=40, deadline=None)
@given(case=videos(thin=False), seed=st.integers(0, 2**20), step=st.integers(0, 999))
def test_every_merged_source_merges_within_the_window(xp, case, seed, step):
    """The whole match, on every backend: a drawn partition of a video grid, matched at the largest ratio its cells
    allow; every source merged lies within ``window`` frames of the destination it joins."""
    h, w, sx, sy = case["h"], case["w"], case["sx"], case["sy"]
    metric = xp.asarray(np.random.default_rng(seed).standard_normal((2, h * w, 4)).astype(np.float32))
    draw = Draw(seed, step, 0, 1, {})
    part = partition_grid(
        xp.ops, metric, h, w, sx, sy, draw, frame_rows=case["frame_rows"], frame_window=case["window"],
        frame_offset=case["offset"],
    )
    merged = h * w - part.full_cells
    match = match_block(xp.ops, metric, part, {"attn": merged}, shared=True)["attn"]
    slot = xp.numpy(match.slot)[0]
    joined = xp.numpy(match.representatives)[0][slot]  # the token each token's slot stands at
    tokens = np.arange(h * w)
    assert (joined != tokens).sum() == merged
    assert (np.abs(frame_of(case, tokens) - frame_of(case, joined)) <= case["window"]).all(), case


@pytest.mark.parametrize("frame_rows, window", [(0, 1), (12, 1), (3, None), (3, 3)])
def test_no_bands_where_every_source_meets_every_destination(frame_rows, window):
    """One frame (no frames, or the whole grid), no window, or a window spanning the 4 frames of 12 rows."""
    assert frame_bands(12, 8, 2, 2, frame_rows, window) is None


@settings(max_examples=60, deadline=None)
@given(case=videos(), batch=st.integers(1, 3), channels=st.integers(1, 6), block=st.integers(1, 200),
       seed=st.integers(0, 2**32 - 1))
def test_the_search_in_bands_is_the_brute_force_over_each_band(xp, case, batch, channels, block, seed):
    """Exact similarities: each source's maximum and first maximal destination over the destinations its run
    meets, bit for bit (chunked within a run too: ``block``)."""
    search = search_of(case)
    assume(search is not None)
    bands = search.bands
    src, dst = tokens_of(case, search.tiling)
    metric = exact_tokens(np.random.default_rng(seed), batch, case["h"] * case["w"], channels)
    scores, _, _ = reference(metric, src, dst)
    best, which = np.empty(scores.shape[:2], np.float32), np.empty(scores.shape[:2], np.int64)
    for first, end, low, high in bands:
        best[:, first:end] = scores[:, first:end, low:high].max(-1)
        which[:, first:end] = scores[:, first:end, low:high].argmax(-1) + low
    got = best_destinations(xp.ops, xp.asarray(metric), xp.asarray(src), xp.asarray(dst), block=block, bands=bands)
    np.testing.assert_array_equal(xp.numpy(got[0]), best)
    np.testing.assert_array_equal(xp.numpy(got[1]), which)


@pytest.mark.parametrize("options, error, words", [
    (dict(frame_window=-1), ValueError, "frame_window"),
    (dict(frame_window=1.5), TypeError, "frame_window"),
    (dict(matching="cell", frame_window=2), ValueError, "frame_window=2 sets how far a similarity search reaches"),
])
def test_a_bad_window_is_refused_naming_it(options, error, words):
    from tome_core import ToMeConfig

    with pytest.raises(error, match=words):
        ToMeConfig(**options)


def test_the_window_is_one_frame_by_default_and_none_searches_the_clip():
    from tome_core import ToMeConfig

    assert ToMeConfig().frame_window == 1 and ToMeConfig(frame_window=None).frame_window is None
    assert ToMeConfig(matching="cell").frame_window == 1  # the default, which cells never read


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_process_piece_that_starts_mid_frame_counts_its_frames_from_the_whole_grid(xp, rank):
    """Edges round three, 11: under context parallelism each of 3 processes merges 6 rows of a 18-row grid of 4-row
    frames, so the pieces start at rows 0, 6 and 12 (mid-frame for the second); with ``frame_window=0`` every merged
    source joins a destination of its own frame of the whole video (counted before as if each piece started one)."""
    from tome_core import ToMeConfig
    from tome_core.shards import Shards
    from tome_core.hooks.call import CallFacts
    from tome_core.hooks.matching import Matching
    from tome_core.hooks.state import ToMeState

    rows, cols, frame_rows = 6, 4, 4
    state = ToMeState(config=ToMeConfig(ratio=0.75, frame_window=0), matching=Matching(streams=1))
    state.begin_call(CallFacts((rows, cols), 0, shards=Shards(count=3, rank=rank), execution=("cpu", "eager"), frame_rows=frame_rows))
    metric = xp.asarray(np.random.default_rng(rank).standard_normal((1, rows * cols, 4)).astype(np.float32))
    match = state.block_matches(metric, 0, shared=True)["attn"]
    joined = xp.numpy(match.representatives)[0][xp.numpy(match.slot)[0]]
    frame = lambda token: (rank * rows + np.asarray(token) // cols) // frame_rows  # noqa: E731
    tokens = np.arange(rows * cols)
    assert (joined != tokens).sum() == match.merged == 18
    assert (frame(tokens) == frame(joined)).all()
