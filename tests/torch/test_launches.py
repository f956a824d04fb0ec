"""A merged block launches few kernels: an eager GPU call at 512-1024 px is bound by launches, so every aten operation
that is not a view is counted in a warm call (the third: the first two fill the shape-only tables), patched against
unpatched, per merged block (the summary's count). Launches are the same on a GPU as on this CPU, so the count is
exact here, unlike a timer on a shared machine. Oracles: the unpatched model's count, and tomesd's on the same UNet.
Budgets: issue "Faster where most people run" (docs/results/launches.md has the figures)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import tome_core.torch as tome
from tome_tools.diffusers_bench import patched_launches, warm_launches
from tome_tools.diffusers_models import build_transformer, build_unet, transformer_inputs
from tome_tools.presets import UNETS

pytestmark = pytest.mark.cost_model

# SD 1.5's block structure at test width (the count does not depend on width)
SD15 = dict(UNETS["sd15"], block_out_channels=(32, 64, 64, 64), cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
launches = warm_launches


def extra_per_block(model, unpatched: Counter, *args, **options) -> float:
    """Launches a patch with ``options`` adds per merged block of a call with ``args``."""
    call = options.pop("call", {})
    patched, blocks, _ = patched_launches(model, options, *args, **call)
    assert blocks, "nothing merged"
    return (sum(patched.values()) - sum(unpatched.values())) / blocks


@pytest.fixture(scope="module")
def sd15():
    torch.manual_seed(0)
    unet = build_unet("tiny", **SD15).eval()
    generator = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 4, 64, 64, generator=generator), torch.tensor(500), torch.randn(2, 7, 32, generator=generator))
    return unet, args, launches(unet, *args)


def test_tome_for_sd_launches_fewer_kernels_than_tomesd(sd15):
    import tomesd

    unet, args, unpatched = sd15
    ours = extra_per_block(unet, unpatched, *args, ratio=0.5)
    tomesd.apply_patch(unet, ratio=0.5)
    try:
        theirs = (sum(launches(unet, *args).values()) - sum(unpatched.values())) / 5  # SD 1.5's finest level: 5 blocks
    finally:
        tomesd.remove_patch(unet)
    assert ours <= 20 and ours < theirs, (ours, theirs)  # 59 before the tables; tomesd 28


def test_the_default_keys_and_values_in_cells_launch_at_most_six_kernels(sd15):
    unet, args, unpatched = sd15
    # min_tokens=0: merge on the CPU at this size, as the default does where the cost model says it pays
    assert extra_per_block(unet, unpatched, *args, min_tokens=0) <= 6  # 22 before


def test_the_default_on_flux_launches_few_kernels():
    torch.manual_seed(0)
    # FLUX.1's 19 double- and 38 single-stream blocks, test width: a call's own launches (its draw) spread over them
    model = build_transformer("tiny-flux", num_layers=19, num_single_layers=38).eval()
    inputs = transformer_inputs(model, 128, 128)  # 4,096 image tokens
    unpatched = launches(model, **inputs)
    extra = extra_per_block(model, unpatched, min_tokens=0, call=inputs)
    assert extra <= 20, extra  # 80 before, 23.5 before the single-stream blocks' matches carried their text


def test_a_call_that_merges_nothing_launches_at_most_two_more_kernels(sd15):
    unet, _, _ = sd15
    generator = torch.Generator().manual_seed(1)
    small = (torch.randn(2, 4, 16, 16, generator=generator), torch.tensor(500), torch.randn(2, 7, 32, generator=generator))
    unpatched = launches(unet, *small)
    tome.patch(unet)  # 256 tokens at the finest level: below every bound of the cost model, so nothing merges
    try:
        patched = launches(unet, *small)
        assert "->" not in tome.patched_models(unet)[0].state.summary()
    finally:
        tome.remove(unet)
    assert sum(patched.values()) - sum(unpatched.values()) <= 2, patched - unpatched
