"""An eager call that merges nothing costs the host little: an eager GPU UNet is bound by its Python, so the hooks
of a call the default runs unmerged (every level below the cost model's size) must add few Python calls to the
unpatched model's. Counted exactly with ``sys.setprofile`` (deterministic, unlike a timer on a shared machine);
oracle: the same call of the unpatched model. Also: a call that repeats the last one's sizes decides as it did,
and a call of another size decides afresh (the oracle: the keys each SDPA call sees, and the unpatched output)."""

from __future__ import annotations

import sys

import pytest
import torch

import tome_core.torch as tome
from tome_tools.diffusers_models import build_unet
from tome_tools.presets import UNETS

pytestmark = pytest.mark.cost_model

# SD 1.5's and SDXL's block structure (16 and 70 transformer blocks; ControlNets and video UNets hold the same kinds)
# at test width: the Python calls per model call depend on the modules, not their width.
NARROW = dict(cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
SHAPES = {
    "sd15": dict(UNETS["sd15"], block_out_channels=(32, 64, 64, 64), **NARROW),
    "sdxl": dict(
        UNETS["sdxl"], block_out_channels=(32, 64, 64), addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=8 * 6 + 32, **NARROW,
    ),
}


def _inputs(name, side):
    generator = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 4, side, side, generator=generator), torch.tensor(500), torch.randn(2, 7, 32, generator=generator))
    added = {"text_embeds": torch.randn(2, 32, generator=generator), "time_ids": torch.randn(2, 6, generator=generator)}
    return args, ({"added_cond_kwargs": added} if name == "sdxl" else {})


def _python_calls(unet, args, kwargs) -> int:
    """Python and builtin function calls made by one call of ``unet``, after two calls that settle it."""
    calls = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1

    with torch.no_grad():
        unet(*args, **kwargs)
        unet(*args, **kwargs)
        sys.setprofile(profile)
        try:
            unet(*args, **kwargs)
        finally:
            sys.setprofile(None)
    return calls[0]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_an_eager_call_that_merges_nothing_adds_few_python_calls(name):
    torch.manual_seed(0)
    unet = build_unet("tiny", **SHAPES[name]).eval()
    args, kwargs = _inputs(name, 16)  # 256 tokens at the finest level: below every bound of tome_core.models.cost
    unpatched = _python_calls(unet, args, kwargs)
    tome.patch(unet)
    try:
        patched = _python_calls(unet, args, kwargs)
        summary = tome.patched_models(unet)[0].state.summary()
    finally:
        tome.remove(unet)
    assert "blocks unmerged" in summary and "->" not in summary
    # Before the hooks' host time was cut: +10% on both (16 hooked blocks of SD 1.5 deciding from their sizes at
    # every call, 70 of SDXL); now only the finest level's blocks are hooked, and they repeat the last call's decision.
    assert patched - unpatched <= 0.03 * unpatched, (patched, unpatched, (patched - unpatched) / unpatched)


def _keys_seen(unet, side):
    seen = []

    def spy(*args, **kwargs):
        seen.append((args[0].shape[-2], args[1].shape[-2]))
        return sdpa(*args, **kwargs)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    generator = torch.Generator().manual_seed(side)
    sample = torch.randn(2, 4, side, side, generator=generator)
    context = torch.randn(2, 7, 32, generator=generator)
    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            out = unet(sample, torch.tensor(500), context).sample
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    return out, sorted({keys for queries, keys in seen if queries == keys})


def test_a_call_of_another_size_decides_afresh():
    unet = build_unet("tiny").eval()
    unpatched = {side: _keys_seen(unet, side) for side in (8, 16)}
    tome.patch(unet, min_tokens=200)  # the finest level merges from 200 tokens: 256 (side 16) merges, 64 (side 8) not
    try:
        state = tome.patched_models(unet)[0].state
        for side in (8, 8, 16, 16, 8, 16):
            out, keys = _keys_seen(unet, side)
            if side == 8:
                assert "blocks unmerged: 64 tokens, fewer than min_tokens=200" in state.summary()
                assert torch.equal(out, unpatched[8][0]) and keys == unpatched[8][1]
            else:
                assert "256 -> 64 keys/values" in state.summary()
                assert 256 in unpatched[16][1] and 256 not in keys and not torch.equal(out, unpatched[16][0])
    finally:
        tome.remove(unet)


@pytest.mark.parametrize("options, before", [(dict(ratio=0.5), 523), (dict(min_tokens=0), 305)], ids=["tome 0.5", "default"])
def test_a_merged_eager_block_costs_fewer_python_calls_than_before_the_tables(options, before):
    """A merged block's host time, as Python calls per merged block against the unpatched call (SD 1.5's layout,
    its finest level's 5 blocks merging at 4,096 tokens): ToMe for SD at 0.5 474, the default's cells 288, against
    523 and 305 before the partitions came from kept tables (``before``; docs/results/launches.md)."""
    torch.manual_seed(0)
    unet = build_unet("tiny", **SHAPES["sd15"]).eval()
    args, kwargs = _inputs("sd15", 64)
    unpatched = _python_calls(unet, args, kwargs)
    tome.patch(unet, **options)
    try:
        patched = _python_calls(unet, args, kwargs)
        summary = tome.patched_models(unet)[0].state.summary()
    finally:
        tome.remove(unet)
    assert "5 blocks, 4096 ->" in summary, summary
    assert (patched - unpatched) / 5 < before, (patched - unpatched) / 5
