"""Parity with the reference package tomesd 0.1.3 (use_rand=False: the same fixed partition)."""

from __future__ import annotations

import copy

import pytest
import torch
import tomesd
from tomesd.merge import bipartite_soft_matching_random2d

import tome_core.torch as tome
from tome_core import bipartite_match, get_ops, merge, unmerge
from tome_tools.diffusers_models import build_unet


def by_first_channel(x: torch.Tensor) -> torch.Tensor:
    """Tokens sorted by their first channel: compares merged sequences up to token order."""
    return torch.stack([row[row[:, 0].argsort()] for row in x])


@pytest.mark.parametrize("batch, h, w, sx, sy, ratio", [(2, 16, 16, 2, 2, 0.5), (1, 9, 7, 2, 2, 0.3), (3, 8, 12, 3, 2, 0.6)])
def test_merge_and_unmerge_equal_tomesd(batch, h, w, sx, sy, ratio):
    generator = torch.Generator().manual_seed(h * w)
    metric = torch.randn(batch, h * w, 16, generator=generator)
    x = torch.randn(batch, h * w, 8, generator=generator)
    r = int(h * w * ratio)
    ref_merge, ref_unmerge = bipartite_soft_matching_random2d(metric, w, h, sx, sy, r, no_rand=True)
    match = bipartite_match(get_ops(metric), metric, h, w, sx, sy, r, None)
    ours, theirs = merge(x, match), ref_merge(x)
    assert ours.shape == theirs.shape == (batch, h * w - r, 8)
    torch.testing.assert_close(by_first_channel(ours), by_first_channel(theirs))
    # Unmerged sources come first in both, in the same (score) order.
    kept_src = h * w - r - (h // sy) * (w // sx)
    torch.testing.assert_close(ours[:, :kept_src], theirs[:, :kept_src], rtol=0, atol=0)
    torch.testing.assert_close(unmerge(ours, match), ref_unmerge(theirs))


UNET_CASES = [
    dict(merge_attn=True, merge_crossattn=False, merge_mlp=False, max_downsample=1),
    dict(merge_attn=True, merge_crossattn=True, merge_mlp=True, max_downsample=1),
    dict(merge_attn=False, merge_crossattn=True, merge_mlp=False, max_downsample=2),
    dict(merge_attn=True, merge_crossattn=False, merge_mlp=True, max_downsample=2),
]


@pytest.fixture(scope="module")
def unet():
    return build_unet("tiny", seed=0)


@pytest.mark.parametrize("options", UNET_CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_patched_unet_equals_tomesd(unet, options):
    generator = torch.Generator().manual_seed(1)
    sample = torch.randn(2, 4, 16, 16, generator=generator)
    text = torch.randn(2, 7, 32, generator=generator)
    reference_model, our_model = copy.deepcopy(unet), copy.deepcopy(unet)
    tomesd.apply_patch(reference_model, ratio=0.5, use_rand=False, **options)
    tome.patch(our_model, ratio=0.5, use_rand=False, proportional_attn=False, **options)
    with torch.no_grad():
        plain = unet(sample, 10, text).sample
        reference = reference_model(sample, 10, text).sample
        ours = our_model(sample, 10, text).sample
    assert (reference - plain).abs().max() > 1e-4  # tomesd really merged something here
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)
