"""The default runs a level unmerged where merging would not pay (tome_core.cost), says so in summary(), and
merges there with ``min_tokens=0`` or an arrangement chosen by hand. Oracle: the unpatched model, and the keys
each SDPA call really sees."""

from __future__ import annotations

import pytest
import torch

import tome_core.torch as tome
from tome_tools.diffusers_models import build_unet
from tome_tools.diffusers_bench import SdpaCalls

pytestmark = pytest.mark.cost_model


@pytest.fixture(scope="module")
def unet():
    return build_unet("tiny")


def _run(unet, side):
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 4, side, side, generator=generator)
    context = torch.randn(2, 7, 32, generator=generator)
    with torch.no_grad(), SdpaCalls() as counts:
        out = unet(sample, torch.tensor([500, 500]), context).sample
    return out, sorted({keys for queries, keys in counts.lengths if queries == keys or queries == side * side})


def _patched_run(unet, side, **options):
    """``(output, keys seen, summary)`` of one call of ``unet`` patched with ``options``, which is then removed."""
    tome.patch(unet, **options)
    try:
        out, seen = _run(unet, side)
        return out, seen, tome.patched_models(unet)[0].state.summary()
    finally:
        tome.remove(unet)


def test_default_leaves_a_small_level_unmerged_and_says_why(unet):
    unpatched, keys = _run(unet, 16)
    out, seen, summary = _patched_run(unet, 16)
    assert torch.equal(out, unpatched)
    assert seen == keys
    assert "blocks unmerged: 256 tokens, fewer than the 4096 from which merging pays on a cpu (eager, cells" in summary
    assert "min_tokens=0 merges anyway" in summary


@pytest.mark.parametrize("options", [dict(min_tokens=0), dict(ratio=0.5), dict(prefer="speed", min_tokens=200)])
def test_min_tokens_or_a_chosen_arrangement_merges_anyway(unet, options):
    unpatched, keys = _run(unet, 16)
    out, seen, summary = _patched_run(unet, 16, **options)
    assert not torch.equal(out, unpatched)
    assert min(seen) < 256 and 256 not in seen, seen
    assert "unmerged" not in summary


def test_default_merges_from_the_measured_size(unet):
    """At 64x64 latents the finest level has 4,096 tokens: the CPU bound, so the default merges there."""
    unpatched, keys = _run(unet, 64)
    out, seen, summary = _patched_run(unet, 64)
    assert 4096 in keys and 4096 not in seen
    assert "4096 -> 1024 keys/values" in summary, summary
