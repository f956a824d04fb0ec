"""Every option acts or is refused (issue 35), checked on the framework-free core: the options against a model's
block levels (:func:`tome_core.models.selection.check_model`), the seed's full range in the partition hash, and the
errors that name their argument. The same checks run through every framework's ``patch`` (tests/torch,
tests/paddle): here they are pinned against models described by their levels alone.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tome_core import ToMeConfig, load_backend
from tome_core.algorithm.partition import random_offsets
from tome_core.models.selection import ModelFacts, check_model

# An SD 1.x-shaped UNet as the driver describes it: blocks in module order (down 1, 2, 4; up 4, 2, 1; middle
# 8), each at its level; attention from the finest level on.
SD_LEVELS = [1, 1, 2, 2, 4, 4, 4, 4, 4, 2, 2, 2, 1, 1, 1, 8]
SD = ModelFacts("UNet", 1, SD_LEVELS, 1000.0)
FLUX = ModelFacts("Flux", 1, [1] * 4, 1.0)


def check(facts: ModelFacts, **options) -> list:
    """The warnings :func:`check_model` gives (it raises where it refuses)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_model(ToMeConfig(**options), facts)
    return [str(w.message) for w in caught]


REFUSED = [
    # blocks and per-block ratios at levels that never merge, named twice, or outside blocks
    (SD, dict(blocks=[2]), "blocks names block 2 of UNet, which runs at 1/2 scale and never merges: with "
     r"max_downsample=None the blocks of UNet merge at 1/1 scale \(blocks 0, 1, 12, 13, 14\)"),
    (SD, dict(blocks=[-1]), "blocks names block -1 of UNet, which runs at 1/8 scale"),
    (SD, dict(block_ratios={0: 0.3, -16: 0.6}), r"block_ratios names block 0 of UNet twice \(0 and -16"),
    (SD, dict(blocks=[0, -16]), r"blocks names block 0 of UNet twice"),
    (SD, dict(block_ratios={0: 0.7}, blocks=[1]), r"block_ratios gives block 0 of UNet a ratio, but blocks=\[1\]"),
    (SD, dict(block_ratios={4: 0.7}), "block_ratios names block 4 of UNet, which runs at 1/4 scale"),
    (SD, dict(blocks=[99]), "blocks: index 99 is out of range for UNet, which has 16 transformer blocks"),
    # levels where no block merges
    (SD, dict(level_ratios={2: 0.5}), r"level_ratios names level 2 \(1/2 scale\), where no block of UNet merges"),
    (SD, dict(mode="kv", matching="cell", level_cells={2: 4}), r"level_cells names level 2 \(1/2 scale\)"),
    (SD, dict(max_downsample=2, blocks=[0], level_ratios={2: 0.5}), r"level_ratios names level 2 .* \(among the blocks selected\)"),
    # a ratio that a merged level's own cell cannot reach
    (SD, dict(level_cells={1: 4}, ratio=0.9, max_downsample=2),
     r"ratio=0.9 cannot be reached at 1/2 scale of UNet, whose cells are 2x2 \(sx, sy or level_cells\[2\]\)"),
    # timesteps outside the model's units
    (SD, dict(ratio=0.5, timestep_range=(2000, 3000)), r"timestep_range=\(2000.0, 3000.0\) never merges on UNet, whose timesteps run from 0 to 1000"),
    (FLUX, dict(ratio=0.5, timestep_range=(400, 600)), "never merges on Flux, whose timesteps run from 0 to 1"),
]


@pytest.mark.parametrize("facts, options, message", REFUSED, ids=[repr(case[1]) for case in REFUSED])
def test_options_that_cannot_act_are_refused_naming_them(facts, options, message):
    with pytest.raises(ValueError, match=message):
        check(facts, **options)


NOTHING = [
    (dict(ratio=0.0), r"ratio=0.0 \(no merged block has a ratio above 0\)"),
    (dict(ratio=0.5, attn_ratio=0.0), r"attn_ratio=0.0 \(no merged block"),  # not "ratio=0.5"
    (dict(block_ratios={0: 0.0, 1: 0.0, 12: 0.0, 13: 0.0, 14: 0.0}), r"block_ratios\[0\]=0.0, block_ratios\[12\]=0.0"),
    (dict(blocks=[]), r"blocks=\[\] selects no block"),
    (dict(merge_attn=False), "merge_attn, merge_crossattn and merge_mlp are all False"),
    (dict(max_downsample=2, level_ratios={1: 0.0, 2: 0.0}), r"level_ratios\[1\]=0.0, level_ratios\[2\]=0.0"),
]


@pytest.mark.parametrize("options, reason", NOTHING, ids=[repr(case[0]) for case in NOTHING])
def test_valid_options_that_merge_nothing_warn_naming_what_zeroes_them(options, reason):
    (message,) = check(SD, **options)
    assert message.startswith("ToMe patch on UNet merges no tokens: ")
    assert pytest.importorskip("re").search(reason, message), message


ACCEPTED = [
    dict(), dict(ratio=0.5), dict(blocks=[0, -2]), dict(block_ratios={0: 0.7, -3: 0.2}),
    dict(max_downsample=2, level_ratios={2: 0.3}), dict(level_cells={1: 4}, ratio=0.9),
    dict(mode="kv", matching="cell", level_cells={1: 4}), dict(ratio=0.5, timestep_range=(500, 5000)),
    dict(ratio=0.0, max_downsample=2, level_ratios={2: 0.5}),
]


@pytest.mark.parametrize("options", ACCEPTED, ids=repr)
def test_options_that_act_pass_without_a_word(options):
    assert check(SD, **options) == []


def test_unknown_levels_judge_by_the_level_range():
    """A model whose blocks' levels are unknown (Flax: no module tree) is checked by its finest level."""
    unknown = ModelFacts("FlaxUNet", 1, [None])
    with pytest.raises(ValueError, match=r"level_ratios names level 2 \(1/2 scale\)"):
        check(unknown, level_ratios={2: 0.5})
    assert check(unknown, max_downsample=2, level_ratios={2: 0.5}) == []


@pytest.mark.parametrize("options, error, message", [
    (dict(ratio="0.75", matching="cell"), TypeError, r"ratio must be a float in \[0, 1 - 1/\(sx\*sy\)\], got '0.75' \(str\)"),
    (dict(level_cells={1: 4}, ratio=0.95), ValueError,
     r"ratio=0.95 cannot be reached with sx=4, sy=4 \(the largest cell of level_cells=\{1: \(4, 4\)\}\)"),
])
def test_config_errors_name_the_argument(options, error, message):
    with pytest.raises(error, match=message):
        ToMeConfig(**options)


def offsets(seed: int, step=500, stream=3) -> np.ndarray:
    ops = load_backend("numpy")
    return random_offsets(ops, np.zeros(1), 16, 16, 2, 2, seed, step, stream)


def test_seeds_below_the_prime_keep_their_partitions_and_higher_seeds_get_their_own():
    """The hash's prime used to fold seeds (0 and 32749 gave one partition); seeds below it are unchanged."""
    assert not np.array_equal(offsets(0), offsets(32749))
    assert not np.array_equal(offsets(5), offsets(5 + 32749 * 32749))
    assert not np.array_equal(offsets(2**31 - 1), offsets(2**31 - 1 - 32749))
    # a seed below the prime is hashed as before (pinned: cell values of seed 7 at step 500, stream 3)
    assert offsets(7).reshape(-1)[:8].tolist() == PINNED_SEED_7


PINNED_SEED_7 = [3, 0, 0, 1, 3, 3, 2, 3]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 2**31 - 1))
def test_distinct_seeds_give_distinct_partitions_up_to_2_31(seed, shift):
    other = (seed + shift) % 2**31
    if other != seed:
        assert not np.array_equal(offsets(seed), offsets(other))


def test_a_grid_smaller_than_one_cell_says_so_once_and_merges_nothing():
    """Wan's pipelines at 16x16 px give a latent one token wide: no full 2x2 cell, nothing can merge (issue 33:
    it did so without a word)."""
    from tome_core import ToMeState
    from tome_core.hooks.call import CallFacts
    from tome_core.hooks.ledger import Ledger

    state = ToMeState(config=ToMeConfig(ratio=0.5), ledger=Ledger(where="WanTransformer3DModel"))
    metric = np.random.default_rng(0).standard_normal((2, 8, 4)).astype(np.float32)
    with pytest.warns(UserWarning, match=r"WanTransformer3DModel: a 8x1 token grid is smaller than one 2x2 cell"):
        state.begin_call(CallFacts((8, 1), 500))
        state.enter_grid((8, 1))
        matches = state.block_matches(metric, 0)
    # summary() counts no block as merged there (attention sees all 8 tokens) and says why
    assert matches["attn"].merged == 0 and not state.ledger.stats
    assert "1/1 scale: no block merged: a 8x1 token grid is smaller than one 2x2 cell" in state.summary()
    assert state.decide(metric, 0, False, None, state.active, None)[1] is None  # not counted as a block that ran merged
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state.begin_call(CallFacts((8, 1), 400))
        state.enter_grid((8, 1))
        state.block_matches(metric, 1)  # said once per patch
