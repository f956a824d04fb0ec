"""tome_core.shards: the grid of one process's piece under context parallelism, against a brute-force split of
a raster grid's token indices, and the set-ups it refuses."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from tome_core.config import ToMeConfig
from tome_core.shards import Shards, check_shard_cells, check_shards, shard_grid


@given(rows=st.integers(1, 24), cols=st.integers(1, 24), count=st.integers(1, 6))
def test_a_piece_is_whole_rows_exactly_when_its_tokens_are(rows, cols, count):
    """diffusers gives process r the r-th of ``count`` equal runs of the raster sequence (when the tokens
    divide): a grid of rows/count whole rows exactly when every run starts and ends on a row's edge."""
    tokens = rows * cols
    if tokens % count:
        return
    runs = [range(r * tokens // count, (r + 1) * tokens // count) for r in range(count)]
    whole_rows = all(run.start % cols == 0 and len(run) % cols == 0 for run in runs)
    if whole_rows:
        assert shard_grid((rows, cols), Shards(count, 0), 0, None, "M") == (rows // count, cols)
    else:
        with pytest.raises(ValueError, match=f"{rows} rows do not divide by {count}"):
            shard_grid((rows, cols), Shards(count, 0), 0, None, "M")


def test_refusals_name_the_setup_and_what_to_do():
    with pytest.raises(ValueError, match="7 tokens of other images"):
        shard_grid((8, 8), Shards(2, 0), 7, None, "FluxTransformer2DModel")
    with pytest.raises(ValueError, match="items of the batch"):
        shard_grid((8, 8), Shards(2, 0), 0, 2, "LatteTransformer3DModel")
    with pytest.raises(ValueError, match="ulysses_anything or ring_anything"):
        check_shards(Shards(2, 0, even=False), False, "M")
    with pytest.raises(ValueError, match="proportional_attn=False"):
        check_shards(Shards(2, 0, ring=True), True, "M")
    check_shards(Shards(2, 0, ring=True), False, "M")  # ring without size-aware attention
    with pytest.raises(ValueError, match="1x16, smaller than one 2x2 cell"):
        check_shard_cells((1, 16), Shards(2, 0), ToMeConfig.from_options({"ratio": 0.5}), "M")
    check_shard_cells((2, 16), Shards(2, 0), ToMeConfig.from_options({"ratio": 0.5}), "M")
