"""``mode="kv"`` on attentions that compute their keys themselves from every token: SD3's and Flux's joint
attention over text and image, Wan's rotary self-attention. Their keys and values merge inside the attention
kernel, after the processor's projections, norms and rotary positions (``KernelKeys``); the queries keep every
token. Oracles: the unpatched model with each SDPA call's image keys and values picked at the cells' first tokens
by index arithmetic (strided downsampling, ``use_rand=False``), and the key counts SDPA really receives."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import tome_core.torch as tome
from tome_tools.diffusers_models import build_transformer, build_video_transformer, transformer_inputs

STRIDED = dict(mode="kv", matching="cell", sx=2, sy=2, cell_pool="sample", use_rand=False)
TEXT = 7


class PickedKeys(TorchFunctionMode):
    """Runs every SDPA call over at least ``tokens`` keys on the keys and values at ``picks`` of the image's
    ``tokens`` rows (from ``start``), text rows kept; records each call's key count."""

    def __init__(self, tokens: int, picks: list, start: int):
        super().__init__()
        self.tokens, self.picks, self.start = tokens, picks, start
        self.keys = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        kwargs.update(zip(("query", "key", "value"), args))
        args = args[3:]
        count = kwargs["key"].shape[-2]
        if self.picks is not None and count >= self.tokens:
            rows = list(range(self.start)) + [self.start + p for p in self.picks]
            index = torch.tensor(rows + list(range(self.start + self.tokens, count)))
            kwargs["key"], kwargs["value"] = kwargs["key"][:, :, index], kwargs["value"][:, :, index]
        self.keys.append(kwargs["key"].shape[-2])
        return func(kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value"), *args, **kwargs)


def strided(rows: int, cols: int) -> list:
    """Each 2x2 cell's first token on a row-major ``rows x cols`` grid."""
    return [r * cols + c for r in range(0, rows, 2) for c in range(0, cols, 2)]


def run(model, inputs, mode=None):
    with torch.no_grad():
        if mode is None:
            return model(**inputs).sample
        with mode:
            return model(**inputs).sample


CASES = {
    # preset: (grid rows, cols, where the image keys start in each SDPA call)
    "tiny-sd3": (8, 6, 0),  # [image; text]
    "tiny-flux": (8, 6, TEXT),  # [text; image], double and single blocks
}


@pytest.mark.parametrize("preset", sorted(CASES))
def test_joint_attention_keys_merge_inside_the_kernel_as_strided_picks(preset):
    rows, cols, start = CASES[preset]
    model = build_transformer(preset)
    inputs = transformer_inputs(model, 16, 12, batch=2, text=TEXT)
    tokens = rows * cols
    oracle = PickedKeys(tokens, strided(rows, cols), start)
    expected = run(model, inputs, oracle)
    patched = tome.patch(copy.deepcopy(model), **STRIDED)
    seen = PickedKeys(tokens, None, start)
    got = run(patched, inputs, seen)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert seen.keys and set(seen.keys) == {tokens // 4 + TEXT}  # every attention: a quarter of the image keys
    summary = tome.patched_models(patched)[0].state.summary()
    assert f"{tokens} -> {tokens // 4} keys/values (75% merged; kv, 2x2 cells)" in summary, summary
    tome.remove(patched)
    torch.testing.assert_close(run(patched, inputs), run(model, inputs), rtol=0, atol=0)


def test_rotary_keys_merge_after_their_rotary_positions():
    model = build_video_transformer("tiny-wan")
    generator = torch.Generator().manual_seed(3)
    frames, height, width = 3, 8, 12  # 3 frames of 4x6 tokens, read as a 12x6 grid
    inputs = dict(
        hidden_states=torch.randn(2, 4, frames, height, width, generator=generator),
        timestep=torch.tensor([500, 500]),
        encoder_hidden_states=torch.randn(2, 5, 16, generator=generator),
    )
    tokens = frames * (height // 2) * (width // 2)
    expected = run(model, inputs, PickedKeys(tokens, strided(frames * height // 2, width // 2), 0))
    patched = tome.patch(copy.deepcopy(model), **STRIDED)
    seen = PickedKeys(tokens, None, 0)
    got = run(patched, inputs, seen)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert sorted(set(seen.keys)) == [5, tokens // 4]  # cross-attention keeps its 5 text keys
    # drawn picks: one token of each cell per call, a different model than the strided one
    drawn = tome.patch(copy.deepcopy(model), mode="kv", matching="cell", sx=2, sy=2, cell_pool="sample")
    assert torch.isfinite(run(drawn, inputs)).all() and not torch.allclose(run(drawn, inputs), expected)


def test_similarity_keys_inside_the_kernel_are_size_aware():
    """``mode="kv"`` with a similarity match on joint attention: half the image keys, each with its size's bias;
    without the bias it is a different model."""
    model = build_transformer("tiny-sd3")
    inputs = transformer_inputs(model, 16, 12, batch=2, text=TEXT)
    seen = PickedKeys(48, None, 0)
    aware = run(tome.patch(copy.deepcopy(model), mode="kv", ratio=0.5), inputs, seen)
    plain = run(tome.patch(copy.deepcopy(model), mode="kv", ratio=0.5, proportional_attn=False), inputs)
    assert set(seen.keys) == {24 + TEXT}
    assert torch.isfinite(aware).all() and not torch.allclose(aware, plain, atol=1e-5)
    reference = run(model, inputs)
    assert (aware - reference).norm() < (plain - reference).norm()


def test_what_the_kernel_cannot_reach_is_refused_at_patch():
    from diffusers.models.attention_processor import PAGJointAttnProcessor2_0

    model = build_transformer("tiny-sd3")
    model.transformer_blocks[0].attn.set_processor(PAGJointAttnProcessor2_0())
    with pytest.raises(ValueError, match=r"mode='kv' needs .*joint attention.*PAGJointAttnProcessor2_0 \(perturbed"):
        tome.patch(model, **STRIDED)


class _MatmulFluxProcessor:
    """Flux's attention written out with matmuls: its keys never pass an attention function ToMe wraps."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        def heads(x, norm):
            return norm(x.unflatten(-1, (attn.heads, -1)))

        q, k, v = heads(attn.to_q(hidden_states), attn.norm_q), heads(attn.to_k(hidden_states), attn.norm_k), attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        if encoder_hidden_states is not None:
            eq = heads(attn.add_q_proj(encoder_hidden_states), attn.norm_added_q)
            ek = heads(attn.add_k_proj(encoder_hidden_states), attn.norm_added_k)
            ev = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (attn.heads, -1))
            q, k, v = torch.cat([eq, q], 1), torch.cat([ek, k], 1), torch.cat([ev, v], 1)
        if image_rotary_emb is not None:
            q, k = (apply_rotary_emb(x, image_rotary_emb, sequence_dim=1) for x in (q, k))
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        out = (weights @ v).transpose(1, 2).flatten(2)
        if encoder_hidden_states is None:
            return out
        text = encoder_hidden_states.shape[1]
        return attn.to_out[1](attn.to_out[0](out[:, text:])), attn.to_add_out(out[:, :text])


def test_a_processor_whose_attention_the_function_mode_cannot_see_is_refused_at_patch():
    model = build_transformer("tiny-flux")
    inputs = transformer_inputs(model, 16, 12, batch=2, text=TEXT)
    for module in model.modules():
        if type(module).__name__ == "FluxAttention":
            module.set_processor(_MatmulFluxProcessor())
    reference = run(model, inputs)
    with pytest.raises(ValueError, match=r"mode='kv' needs .*joint attention.*_MatmulFluxProcessor computes attention without"):
        tome.patch(model, **STRIDED)
    assert not tome.patched_models(model)
    torch.testing.assert_close(run(model, inputs), reference, rtol=0, atol=0)


def test_attention_item_by_item_merges_each_items_keys():
    """Mochi's processor attends one batch item at a time, over its own valid text: each call's keys are that
    item's, merged as the item's own; the same model as the picks by index."""
    from tome_tools.diffusers_models import video_transformer_inputs

    model = build_video_transformer("tiny-mochi")
    inputs = video_transformer_inputs(model, 3, 16, 16, batch=2)
    tokens = 3 * 8 * 8  # 3 frames of 8x8 tokens, read as a 24x8 grid; [image; valid text] keys per item
    oracle = PickedKeys(tokens, strided(24, 8), 0)
    with pytest.warns(UserWarning, match="autocast"):
        expected = run(model, inputs, oracle)
    patched = tome.patch(copy.deepcopy(model), **STRIDED)
    seen = PickedKeys(tokens, None, 0)
    with pytest.warns(UserWarning, match="autocast"):
        got = run(patched, inputs, seen)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # per block, one call per item: a quarter of its image keys and its own valid text (the items' differ)
    per_item = [count for count in seen.keys if count > tokens // 4]
    assert seen.keys == oracle.keys and len(set(per_item)) == 2 and len(per_item) == 2 * len(patched.transformer_blocks)
