"""Sizes at the edges (issue 43): batches of latents of different sizes, token grids too small to merge, and
position tables that broadcast. Each call either merges correctly or runs unmerged and says why once, and
``summary()`` tells what attention saw. Oracles: the unpatched model, and the same patched model given the
equivalent full table.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch

import tome_core.torch as tome
from tome_tools import diffusers_models as zoo


def _run(model: torch.nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
    tuples = {"return_dict": False} if "return_dict" in inspect.signature(model.forward).parameters else {}
    with torch.no_grad():
        output = model(**inputs, **tuples)
    output = output[0] if isinstance(output, (tuple, list)) else output
    # Z-Image returns one latent per item, each of its own size
    return torch.cat([item.flatten() for item in output]) if isinstance(output, (tuple, list)) else output


def _attention_tokens(model: torch.nn.Module, inputs: Dict[str, Any]) -> Tuple[List[int], torch.Tensor]:
    """The token count every attention module of ``model`` receives in one call, and the call's output."""
    seen: List[int] = []

    def record(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        seen.append(hidden.shape[1])

    handles = [
        module.register_forward_pre_hook(record, with_kwargs=True)
        for module in model.modules() if type(module).__name__.endswith("Attention")
    ]
    try:
        output = _run(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen, output


def _said(call, match: str) -> Tuple[Any, List[str]]:
    """``call()`` twice; the warnings matching ``match`` (so a reason said once per patch gives one)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = call()
        call()
    return first, [str(w.message) for w in caught if match in str(w.message)]


def _summary(model: torch.nn.Module) -> str:
    return "\n".join(patched.state.summary() for patched in tome.patched_models(model))


# ---------------------------------------------------------------------------------------------------------
# Z-Image: a list of latents, one per item, each padded to a multiple of 32 tokens; captions follow


def _z_image(sizes: List[Tuple[int, int]]) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    model = zoo.build_transformer("tiny-z-image")
    generator = torch.Generator().manual_seed(1)
    x = [torch.randn(16, 1, h, w, generator=generator) for h, w in sizes]
    captions = [torch.randn(16, 16, generator=generator), torch.randn(40, 16, generator=generator)][: len(sizes)]
    return model, dict(x=x, t=torch.full((len(sizes),), 0.3), cap_feats=captions)


def test_z_image_latents_of_different_sizes_run_unmerged_and_say_why_once():
    """Items of 6x10 and 4x4 tokens: no one grid places both (item 0's grid read the 4x4 item's padding and
    caption as image tokens, 117 -> 59 tokens, without a word). The call runs as the unpatched model, attention
    sees every token, the reason is said once and summary() gives it, as for Qwen-Image's shape lists."""
    model, inputs = _z_image([(12, 20), (8, 8)])
    plain_seen, plain = _attention_tokens(model, inputs)
    tome.patch(model, ratio=0.5)
    (seen, output), said = _said(lambda: _attention_tokens(model, inputs), "latents different sizes")
    assert len(said) == 1 and "run unmerged" in said[0]
    assert seen == plain_seen and torch.equal(output, plain)
    assert "no block merged: the items of its batch give their latents different sizes" in _summary(model)
    # latents of one size in the same batch still merge, on their grid
    _, same = _z_image([(12, 20), (12, 20)])
    merged_seen, merged = _attention_tokens(model, {**inputs, "x": same["x"]})
    assert "60 -> 30 tokens" in _summary(model) and min(merged_seen) < min(plain_seen)


# ---------------------------------------------------------------------------------------------------------
# HunyuanDiT at diffusers' own test sizes: its rotary table has one row, broadcast over every token

_HUNYUAN_DIT = dict(
    sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
    cross_attention_dim=8, cross_attention_dim_t5=8, pooled_projection_dim=4, hidden_size=16, text_len=4,
    text_len_t5=4, activation_fn="gelu-approximate",
)


def _hunyuan_dit(name: str, height: int, width: int) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """diffusers' HunyuanDiT model test: batch 2, a ``height x width`` latent, rotary tables of one row."""
    config = dict(_HUNYUAN_DIT, transformer_num_layers=4) if "ControlNet" in name else dict(_HUNYUAN_DIT)
    if "ControlNet" in name:
        del config["num_layers"]
    model = zoo.random_transformer(name, config, 0)
    generator = torch.Generator().manual_seed(1)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    inputs = dict(
        hidden_states=randn(2, 4, height, width), encoder_hidden_states=randn(2, 4, 8), text_embedding_mask=torch.ones(2, 4),
        encoder_hidden_states_t5=randn(2, 4, 8), text_embedding_mask_t5=torch.ones(2, 4), timestep=torch.tensor([500.0] * 2),
        image_meta_size=torch.tensor([[1024.0, 1024, 16, 16, 0, 0]] * 2), style=torch.zeros(2, dtype=torch.long),
        image_rotary_emb=[torch.ones(1, 8), torch.zeros(1, 8)],
    )
    if "ControlNet" in name:
        inputs["controlnet_cond"] = randn(2, 4, height, width)
    return model, inputs


@pytest.mark.parametrize("name", ["HunyuanDiT2DModel", "HunyuanDiT2DControlNetModel"])
def test_hunyuan_dit_with_a_one_row_rotary_table_merges_as_with_the_table_repeated_per_token(name):
    """A 4x4 token grid (8x8 latent) with rotary tables of one row (diffusers' model test; its pipeline tests pass
    one too, as their VAE does not downsample 8x): moving that table to the merged tokens crashed in arange. One row
    gives every token the same position, so the patched call must equal the patched call given that row repeated for
    each of the 16 tokens, and it merges."""
    model, inputs = _hunyuan_dit(name, 8, 8)
    cos, sin = inputs["image_rotary_emb"]
    repeated = {**inputs, "image_rotary_emb": [cos.expand(16, 8).clone(), sin.expand(16, 8).clone()]}
    plain = _run(model, inputs)
    assert torch.equal(_run(model, repeated), plain)
    tome.patch(model, ratio=0.5)
    seen, output = _attention_tokens(model, inputs)
    assert torch.equal(output, _run(model, repeated))
    assert 8 in seen and not torch.equal(output, plain)
    assert "16 -> 8 tokens" in _summary(model)


# ---------------------------------------------------------------------------------------------------------
# Grids too small to merge: every family runs unmerged there, says why once, and summary() says so


def _transformer(preset: str, height: int, width: int):
    model = zoo.build_transformer(preset)
    return model, zoo.transformer_inputs(model, height, width, batch=2)


def _joyimage_edit_plus():
    """diffusers' JoyImage-Edit-Plus model test: patches [1, 2, 16, 1, 2, 2], a 1x1 target and a 1x1 reference."""
    config = dict(
        patch_size=[1, 2, 2], in_channels=16, hidden_size=32, num_attention_heads=2, text_dim=16, num_layers=2,
        rope_dim_list=[4, 6, 6], theta=256,
    )
    model = zoo.random_transformer("JoyImageEditPlusTransformer3DModel", config, 0)
    generator = torch.Generator().manual_seed(1)
    return model, dict(
        hidden_states=torch.randn(1, 2, 16, 1, 2, 2, generator=generator),
        encoder_hidden_states=torch.randn(1, 12, 16, generator=generator), timestep=torch.tensor([1.0]),
        shape_list=[[(1, 1, 1), (1, 1, 1)]],
    )


TINY = {  # one token: a 1x1 grid
    "joyimage-edit-plus": _joyimage_edit_plus,
    "hunyuan-dit": lambda: _hunyuan_dit("HunyuanDiT2DModel", 2, 2),
    "sd3": lambda: _transformer("tiny-sd3", 2, 2),
    "flux": lambda: _transformer("tiny-flux", 2, 2),
    "pixart": lambda: _transformer("tiny-pixart", 2, 2),
}


@pytest.mark.parametrize("kind", sorted(TINY))
def test_a_one_token_grid_runs_unmerged_and_says_why_once(kind):
    """A 1x1 grid holds no 2x2 cell: it merged nothing without a word (JoyImage-Edit-Plus at diffusers' test
    shapes, and every family at one token), where a 1x2 grid said why. Under the default and under a ratio."""
    model, inputs = TINY[kind]()
    plain = _run(model, inputs)
    for options in (dict(), dict(ratio=0.5)):
        tome.patch(model, **options)
        output, said = _said(lambda: _run(model, inputs), "1x1 token grid is smaller than one")
        assert len(said) == 1 and torch.equal(output, plain), options
        assert "no block merged: a 1x1 token grid is smaller than one" in _summary(model), options
        tome.remove(model)


def test_a_grid_with_too_few_tokens_for_the_ratio_says_why_once():
    """A 2x2 grid at ratio 0.2 has a cell but int(4 * 0.2) == 0 tokens to merge: it says so, and summary() does."""
    model, inputs = _transformer("tiny-sd3", 4, 4)
    plain = _run(model, inputs)
    tome.patch(model, ratio=0.2)
    output, said = _said(lambda: _run(model, inputs), "2x2 token grid has too few tokens for ratio 0.2")
    assert len(said) == 1 and torch.equal(output, plain)
    assert "no block merged: a 2x2 token grid has too few tokens" in _summary(model)


def test_a_grid_smaller_than_a_cell_is_not_counted_as_merged_blocks():
    """A 1x4 grid (2x8 latent) merges nothing: summary() named its blocks as '4 -> 4 tokens (0% merged)' among the
    blocks that ran on fewer tokens; it now says why nothing merged, and attention saw every token."""
    model, inputs = _transformer("tiny-sd3", 2, 8)
    plain_seen, plain = _attention_tokens(model, inputs)
    tome.patch(model, ratio=0.5)
    (seen, output), said = _said(lambda: _attention_tokens(model, inputs), "1x4 token grid is smaller than one 2x2 cell")
    assert len(said) == 1 and seen == plain_seen and torch.equal(output, plain)
    assert _summary(model).strip().startswith("1/1 scale: no block merged: a 1x4 token grid")
