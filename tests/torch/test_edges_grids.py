"""Edges round three: grids that change within a generation. A match kept for the next calls (``reuse_steps``) is
reused only on the grid it was made for. Oracle: a freshly patched model's call, which draws its own partition."""

from __future__ import annotations

import copy

import torch

import tome_core.torch as tome
from tome_tools.diffusers_models import build_unet


def test_reuse_steps_does_not_reuse_a_match_on_another_grid_of_as_many_tokens():
    """Edges round three, 9: a UNet patched alone with ``reuse_steps=2`` called on a 16x12 latent, then, in the same
    generation (a lower timestep), on a 12x16 one: every level holds as many tokens as before, but the second call
    matches on its own grid, as a fresh patch does (it reused the 16x12 partition before, half of its destinations
    off the 12x16 grid's cells)."""
    unet = build_unet("tiny", seed=0)
    generator = torch.Generator().manual_seed(3)
    tall, wide = torch.randn(2, 4, 16, 12, generator=generator), torch.randn(2, 4, 12, 16, generator=generator)
    text = torch.randn(2, 7, 32, generator=generator)
    reusing = tome.patch(copy.deepcopy(unet), ratio=0.5, reuse_steps=2)
    fresh = tome.patch(copy.deepcopy(unet), ratio=0.5)
    with torch.no_grad():
        reusing(tall, torch.tensor(900), text)
        second = reusing(wide, torch.tensor(500), text).sample
        expected = fresh(wide, torch.tensor(500), text).sample
        unpatched = tome.remove(fresh)(wide, torch.tensor(500), text).sample
    [(_, state)] = tome.patched_models(reusing)
    assert state.matching.calls == 2  # one generation: the second call may reuse what fits it
    assert not torch.equal(second, unpatched)  # it merged
    torch.testing.assert_close(second, expected, rtol=0, atol=0)
