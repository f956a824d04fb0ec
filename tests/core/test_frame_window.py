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
from tome_core.match import best_destinations
from tome_core.partition import cell_table, frame_bands, split

from .test_match_memory import exact_tokens, reference

NUMPY = load_backend("numpy")


@st.composite
def videos(draw):
    """A grid of ``frames`` frames of ``frame_rows`` rows stacked, its cells and a window."""
    frames, frame_rows = draw(st.integers(2, 6), label="frames"), draw(st.integers(1, 7), label="frame_rows")
    w, sx, sy = draw(st.integers(1, 7), label="w"), draw(st.integers(1, 3), label="sx"), draw(st.integers(1, 3), label="sy")
    h = frames * frame_rows
    assume((h // sy) * (w // sx) > 0 and sx * sy > 1)
    return dict(h=h, w=w, sx=sx, sy=sy, frame_rows=frame_rows, frames=frames, window=draw(st.integers(0, 3), label="window"))


def tokens_of(case):
    """``(src, dst)`` token indices in :func:`split`'s order (first position of each cell the destination)."""
    src_dst = split(NUMPY, np.zeros(1), case["h"], case["w"], case["sx"], case["sy"], None)
    return np.asarray(src_dst[1]), np.asarray(src_dst[0])


def frames_of_cell_tokens(case, token):
    """The frames that the rows of ``token``'s cell span (a leftover token: its own row's frame)."""
    h, w, sx, sy, frame_rows = (case[k] for k in ("h", "w", "sx", "sy", "frame_rows"))
    row, col = token // w, token % w
    if row < h // sy * sy and col < w // sx * sx:
        first = row // sy * sy
        return set(range(first // frame_rows, (first + sy - 1) // frame_rows + 1))
    return {row // frame_rows}


@settings(max_examples=80, deadline=None)
@given(case=videos())
def test_each_source_meets_the_destinations_of_its_nearby_frames(case):
    """The runs cover every source once, in order; a source meets every destination whose cell lies within
    ``window`` frames of its own cell's, and none further than that cell's frames' run reaches (one frame more
    where cells straddle two frames; exactly the window where they never do)."""
    bands = frame_bands(case["h"], case["w"], case["sx"], case["sy"], case["frame_rows"], case["window"])
    src, dst = tokens_of(case)
    if case["window"] >= case["frames"] - 1:
        assert bands is None
        return
    assert bands is not None
    assert [b[0] for b in bands] == [0] + [b[1] for b in bands[:-1]] and bands[-1][1] == len(src)
    straddle = case["frame_rows"] % case["sy"] != 0
    dst_frames = [frames_of_cell_tokens(case, d) for d in dst]
    in_cells = set(np.asarray(cell_table(NUMPY, np.zeros(1), case["h"], case["w"], case["sx"], case["sy"])[0]).ravel())
    for first, end, low, high in bands:
        for s in src[first:end]:
            if s not in in_cells:  # leftover rows and columns: every destination
                assert (low, high) == (0, len(dst))
                continue
            own = frames_of_cell_tokens(case, s)
            for j, frames in enumerate(dst_frames):
                distance = min(abs(a - b) for a in frames for b in own)
                if distance <= case["window"]:
                    assert low <= j < high, (case, s, j)
                elif low <= j < high:
                    assert straddle and distance <= case["window"] + 1, (case, s, j)


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
    bands = frame_bands(case["h"], case["w"], case["sx"], case["sy"], case["frame_rows"], case["window"])
    assume(bands is not None)
    src, dst = tokens_of(case)
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
