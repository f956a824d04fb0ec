"""Diffusion transformers on paddle: ppdiffusers' SD3 (MM-DiT joint attention) and patchified DiT
(``Transformer2DModel``, adaLN-zero, class labels), models and pipelines.

Oracles: the unpatched model (exact equality), attention over tokens repeated by their sizes, token counts and
inputs seen inside the attention layers, the attention masks that reach ``scaled_dot_product_attention_``.
SD3's joint attention calls ``paddle.nn.functional.scaled_dot_product_attention_``, which paddle has only with
ppxformers or on NPU: the ``sdpa_shim`` fixture (conftest.py) binds it to plain math here.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from ppdiffusers.models import attention_processor

import tome_core.paddle as tome
from tome_core.models.model_tree import blocks_of, is_transformer_model, is_unet_like
from tome_core.adapters.ppdiffusers import FRAMEWORK
from tome_tools.ppdiffusers_models import (
    TRANSFORMER_PIPELINES,
    build_transformer,
    build_transformer_pipeline,
    transformer_inputs,
)
from tome_core.algorithm.backend import get_ops
from tome_core.hooks.attention_bias import SizeBias
from tome_core.models.families import TEXT_AFTER, TEXT_NONE, block_family
from tome_core.algorithm.match import bipartite_matches
from tome_core.algorithm.merge import merge, unmerge

pytestmark = pytest.mark.usefixtures("sdpa_shim")

PRESETS = ["tiny-sd3", "tiny-dit"]
# SD3: latent 16x12, a non-square grid of 8x6 tokens after the 2x2 patches. ppdiffusers' DiT unpatchifies
# square grids only: 16x16, 8x8 tokens.
SIZES = {"tiny-sd3": (16, 12), "tiny-dit": (16, 16)}
HEIGHT, WIDTH = SIZES["tiny-sd3"]
TOKENS = 8 * 6
TEXT = 7


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def hook_count(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_post_hooks) for m in model.sublayers(include_self=True))


@pytest.fixture(scope="module", params=PRESETS)
def model_and_inputs(request):
    model = build_transformer(request.param)
    return model, transformer_inputs(model, *SIZES[request.param], batch=2, text=TEXT)


def tokens_of(inputs) -> int:
    height, width = inputs["hidden_states"].shape[-2:]
    return height // 2 * (width // 2)


def call(model, inputs) -> np.ndarray:
    with paddle.no_grad():
        return model(**inputs).sample.numpy()


def test_models_and_blocks_are_found_by_the_driver(model_and_inputs):
    model, _ = model_and_inputs
    assert is_transformer_model(model) and not is_unet_like(model)
    families = {block_family(type(block)).name for block, _ in blocks_of(FRAMEWORK, model)}
    assert families == ({"mmdit"} if type(model).__name__.startswith("SD3") else {"basic"})
    tome.patch(model, ratio=0.5)
    assert [type(m).__name__ for m, _ in tome.patched_models(model)] == [type(model).__name__]
    tome.remove(model)


def test_ratio_zero_remove_and_reproducibility(model_and_inputs, sdpa_shim):
    model, inputs = model_and_inputs
    reference, hooks = call(model, inputs), hook_count(model)
    with pytest.warns(UserWarning, match="merges no tokens: ratio=0.0"):
        tome.patch(model, ratio=0.0)
    np.testing.assert_array_equal(call(model, inputs), reference)
    tome.patch(model, ratio=0.5)
    first = call(model, inputs)
    assert np.isfinite(first).all() and rel(first, reference) > 1e-4
    np.testing.assert_array_equal(call(model, inputs), first)  # same inputs and seed: the same output
    tome.patch(model, ratio=0.5, seed=1)
    assert rel(call(model, inputs), first) > 1e-5  # another seed, another partition
    assert paddle.nn.functional.scaled_dot_product_attention_ is sdpa_shim  # size-aware left nothing behind
    tome.remove(model)
    np.testing.assert_array_equal(call(model, inputs), reference)
    assert not tome.patched_models(model) and hook_count(model) == hooks


def _record_attention(model, seen):
    """Pre-hooks recording the image and text inputs of every block's first attention layer."""
    handles = []
    for block, _ in blocks_of(FRAMEWORK, model):
        attention = block.attn if hasattr(block, "attn") else block.attn1

        def record(layer, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            seen.append((hidden.numpy(), kwargs.get("encoder_hidden_states")))

        handles.append(attention.register_forward_pre_hook(record, with_kwargs=True))
    return handles


def test_attention_sees_fewer_image_tokens_and_the_exact_text(model_and_inputs, monkeypatch, sdpa_shim):
    model, inputs = model_and_inputs
    plain = []
    handles = _record_attention(model, plain)
    call(model, inputs)
    for handle in handles:
        handle.remove()
    tome.patch(model, ratio=0.5)
    seen, masks = [], []

    def recording_sdpa(query, key, value, attn_mask=None, *args, **kwargs):
        masks.append((int(query.shape[1]), int(key.shape[1]), None if attn_mask is None else attn_mask.numpy()))
        return sdpa_shim(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(paddle.nn.functional, "scaled_dot_product_attention_", recording_sdpa)
    handles = _record_attention(model, seen)  # registered after the patch: they see what attention sees
    try:
        call(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
        tome.remove(model)
    assert len(seen) == len(plain) == 2
    tokens = tokens_of(inputs)
    kept = tokens - tokens // 2
    for (hidden, text), (hidden_plain, text_plain) in zip(seen, plain):
        assert hidden.shape[1] == kept and hidden_plain.shape[1] == tokens
        assert (text is None) == (text_plain is None)
        if text is not None:
            assert text.shape[1] == text_plain.shape[1] == TEXT
    if seen[0][1] is not None:  # the first block's text is exactly the unpatched text
        np.testing.assert_array_equal(seen[0][1].numpy(), plain[0][1].numpy())
    if type(model).__name__.startswith("SD3"):
        # Joint attention over [merged image; text]: the merged keys carry log(size), the text keys 0.
        assert len(masks) == 2
        for queries, keys, mask in masks:
            assert queries == keys == kept + TEXT and mask.shape == (2, 1, queries, keys)
            assert (mask[..., kept:] == 0).all()  # (assert_array_equal(a, 0) breaks once ppdiffusers is imported)
            np.testing.assert_allclose(np.exp(mask[..., :kept]).sum(-1), np.full((2, 1, queries), tokens), rtol=1e-5)
    else:
        assert masks == []  # DiT's attention on CPU takes the sizes as its attention_mask


def test_keyword_only_and_positional_calls_agree(model_and_inputs):
    model, inputs = model_and_inputs
    tome.patch(model, ratio=0.5)
    try:
        by_keyword = call(model, inputs)
        with paddle.no_grad():
            if "pooled_projections" in inputs:
                names = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")
                positional = model(*(inputs[n] for n in names)).sample.numpy()
            else:
                positional = model(inputs["hidden_states"], None, inputs["timestep"], None, inputs["class_labels"]).sample.numpy()
    finally:
        tome.remove(model)
    np.testing.assert_array_equal(by_keyword, positional)


def test_bad_options_raise_before_anything_is_patched(model_and_inputs, bad_option):
    model, _ = model_and_inputs
    options, error, message = bad_option
    hooks = hook_count(model)
    for entry in (lambda: tome.patch(model, **options), lambda: model.apply_tome(**options)):
        with pytest.raises(error, match=message):
            entry()
    assert not tome.patched_models(model) and hook_count(model) == hooks


@pytest.mark.parametrize("preset", PRESETS)
def test_models_built_with_inference_optimize_are_refused(preset):
    """ppdiffusers' INFERENCE_OPTIMIZE=True runs a fused layer instead of the blocks (DiT keeps its unused
    blocks: patching would silently merge nothing)."""
    model = build_transformer(preset)
    model.inference_optimize = True  # what building under INFERENCE_OPTIMIZE=True sets
    with pytest.raises(ValueError, match=f"cannot patch {type(model).__name__} built with INFERENCE_OPTIMIZE=True"):
        tome.patch(model, ratio=0.5)
    assert hook_count(model) == 0


def test_blocks_selects_which_blocks_merge(model_and_inputs):
    model, inputs = model_and_inputs
    name = type(model).__name__
    for blocks, merged in (([0], 1), ([-1], 1), (None, 2)):
        tome.patch(model, ratio=0.5, blocks=blocks)
        call(model, inputs)
        (state,) = [s for _, s in tome.patched_models(model)]
        assert state.ledger.stats[1].blocks == merged
    with pytest.raises(ValueError, match=f"blocks: index 2 is out of range for {name}, which has 2"):
        tome.patch(model, ratio=0.5, blocks=[2])
    assert tome.patched_models(model)[0][1].config.blocks is None  # the earlier patch stays
    tome.remove(model)


# ---------------------------------------------------------------------------------------------------------
# Size-aware attention against attention over tokens repeated by their sizes


@pytest.mark.parametrize("preset, text, processor", [
    ("tiny-sd3", TEXT_AFTER, None),  # joint attention: through scaled_dot_product_attention_
    ("tiny-dit", TEXT_NONE, None),  # AttnProcessor (CPU default): through attention_mask
    ("tiny-dit", TEXT_NONE, "XFormersAttnProcessor"),  # = AttnProcessor2_5 (ppxformers): attention_mask, then SDPA
])
def test_size_aware_attention_equals_attention_over_repeated_tokens(preset, text, processor):
    model = build_transformer(preset)
    block = model.transformer_blocks[0]
    attention = block.attn if text == TEXT_AFTER else block.attn1
    if processor is not None:
        attention.set_processor(getattr(attention_processor, processor)())
    rng = np.random.default_rng(1)
    randn = lambda *shape: paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))
    channels = model.inner_dim
    metric = randn(2, TOKENS, 16)
    match = bipartite_matches(get_ops(metric), metric, 8, 6, 2, 2, [int(TOKENS * 0.6)], None, 0, False)[0]
    image = merge(randn(2, TOKENS, channels), match)
    repeated = unmerge(image, match)  # every merged token repeated once per token it stands for
    extra = {"encoder_hidden_states": randn(2, TEXT, channels)} if text == TEXT_AFTER else {}
    with paddle.no_grad():
        args, kwargs = FRAMEWORK.size_aware(attention, (), {"hidden_states": image, **extra}, SizeBias(match, text, image))
        try:
            sized = attention(*args, **kwargs)
        finally:
            FRAMEWORK.size_aware_done(attention)
        plain = attention(hidden_states=repeated, **extra)
        unsized = attention(hidden_states=image, **extra)
    first = lambda out: out[0] if isinstance(out, tuple) else out
    np.testing.assert_allclose(unmerge(first(sized), match).numpy(), first(plain).numpy(), rtol=1e-4, atol=1e-5)
    if isinstance(sized, tuple):  # the text stream of joint attention
        np.testing.assert_allclose(sized[1].numpy(), plain[1].numpy(), rtol=1e-4, atol=1e-5)
    assert rel(unmerge(first(unsized), match).numpy(), first(plain).numpy()) > 1e-3  # the test can fail


class _MatmulJointProcessor:
    """A user processor computing joint attention by hand (no ``scaled_dot_product_attention_`` call)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        tokens = hidden_states.shape[1]
        x = paddle.concat([hidden_states, encoder_hidden_states], axis=1)
        q = paddle.concat([attn.to_q(hidden_states), attn.add_q_proj(encoder_hidden_states)], axis=1)
        k = paddle.concat([attn.to_k(hidden_states), attn.add_k_proj(encoder_hidden_states)], axis=1)
        v = paddle.concat([attn.to_v(hidden_states), attn.add_v_proj(encoder_hidden_states)], axis=1)
        weights = paddle.nn.functional.softmax(paddle.matmul(q, k, transpose_y=True) / q.shape[-1] ** 0.5, axis=-1)
        out = paddle.matmul(weights, v) + 0 * x.sum()
        context = out[:, tokens:]
        return attn.to_out[0](out[:, :tokens]), (context if attn.context_pre_only else attn.to_add_out(context))


def test_a_processor_the_sizes_cannot_reach_raises_and_proportional_attn_false_runs(sdpa_shim):
    model = build_transformer("tiny-sd3")
    inputs = transformer_inputs(model, HEIGHT, WIDTH, batch=2)
    for block in model.transformer_blocks:
        block.attn.set_processor(_MatmulJointProcessor())
    tome.patch(model, ratio=0.5)
    with pytest.raises(RuntimeError, match="_MatmulJointProcessor of a merged attention computes attention without"):
        call(model, inputs)
    assert paddle.nn.functional.scaled_dot_product_attention_ is sdpa_shim
    tome.patch(model, ratio=0.5, proportional_attn=False)
    assert np.isfinite(call(model, inputs)).all()


def test_without_the_attention_function_a_patched_sd3_fails_like_the_unpatched_one(monkeypatch):
    model = build_transformer("tiny-sd3")
    inputs = transformer_inputs(model, HEIGHT, WIDTH)
    monkeypatch.delattr(paddle.nn.functional, "scaled_dot_product_attention_")
    with pytest.raises(AttributeError, match="scaled_dot_product_attention_"):
        call(model, inputs)
    tome.patch(model, ratio=0.5)
    with pytest.raises(AttributeError, match="scaled_dot_product_attention_"):
        call(model, inputs)
    assert not hasattr(paddle.nn.functional, "scaled_dot_product_attention_")


def test_two_sd3_models_with_size_aware_joint_attention_run_from_two_threads(sdpa_shim, run_in_two_threads):
    """The attention function is wrapped while either model's merged attention runs; each thread's calls get
    their own model's sizes, and the function is restored when both are done."""
    models = [tome.patch(build_transformer("tiny-sd3"), ratio=0.5), tome.patch(build_transformer("tiny-sd3", seed=1), ratio=0.3)]
    inputs = transformer_inputs(models[0], HEIGHT, WIDTH, batch=2)
    expected = [call(m, inputs) for m in models]
    results = run_in_two_threads([lambda m=m: [call(m, inputs) for _ in range(3)] for m in models])
    for index in range(2):
        for out in results[index]:
            np.testing.assert_array_equal(out, expected[index])
    assert paddle.nn.functional.scaled_dot_product_attention_ is sdpa_shim


# ---------------------------------------------------------------------------------------------------------
# Pipelines


def _run(pipe, kind):
    common = dict(num_inference_steps=2, output_type="np", generator=paddle.Generator().manual_seed(0))
    if kind == "sd3":
        return pipe(prompt="a photo of a cat", height=32, width=32, **common).images
    return pipe(class_labels=[1], **common).images


@pytest.mark.parametrize("kind", TRANSFORMER_PIPELINES)
def test_pipelines_patch_their_transformer(kind):
    pipe = build_transformer_pipeline(kind)
    pipe.set_progress_bar_config(disable=True)
    reference = _run(pipe, kind)
    assert pipe.apply_tome(ratio=0.5) is pipe
    patched = _run(pipe, kind)
    [(model, state)] = tome.patched_models(pipe)
    assert model is pipe.transformer and state.ledger.stats[1].kept < state.ledger.stats[1].tokens
    assert np.isfinite(patched).all() and np.abs(patched - reference).max() > 1e-4
    np.testing.assert_array_equal(_run(pipe, kind), patched)
    assert pipe.remove_tome() is pipe and tome.patched_models(pipe) == []
    np.testing.assert_array_equal(_run(pipe, kind), reference)
