"""ToMe beside what ppdiffusers users stack on a pipeline (issue 18), on tiny SD, SDXL and ControlNet pipelines
with random weights: every feature ppdiffusers 0.29 has, in both orders of set-up (feature then ``patch``,
``patch`` then feature).

Each case asserts that the pipeline runs, its output is finite and differs from the feature alone, both orders
give the same output, the self-attention of the finest level saw half its tokens (counted inside the attn1
layers, and in the run state), and ``remove`` gives exactly the feature-alone output. Then size-aware attention
through each attention processor ppdiffusers has against attention over the tokens repeated by size, SAG's clear
error where its stored map would be merged, and what ppdiffusers 0.29 lacks or breaks by itself (no ToMe
involved): PEFT's ``add_adapter``, FreeU on paddle 3.3.1, CPU offload, ``fuse_qkv_projections``.

ppdiffusers binds ``paddle.nn.functional.scaled_dot_product_attention_`` (what ``AttnProcessor2_5``, the
default processor with ppxformers on a GPU, calls) only with ppxformers or on NPU: the ``sdpa_shim`` fixture
(conftest.py) binds it to plain math here, so that processor runs on CPU.
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import paddle
import pytest
from ppdiffusers import (
    StableDiffusionAdapterPipeline,
    StableDiffusionControlNetPipeline,
    StableDiffusionPipeline,
    StableDiffusionSAGPipeline,
    StableDiffusionXLPipeline,
    T2IAdapter,
    UNet2DConditionModel,
)
from ppdiffusers.models.attention_processor import (
    Attention,
    AttnProcessor,
    AttnProcessor2_5,
    SlicedAttnProcessor,
    XFormersAttnProcessor,
)
from ppdiffusers.models.lora import LoRALinearLayer
from ppdiffusers.transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
from ppdiffusers.utils import USE_PEFT_BACKEND

import tome_core.paddle as tome
from tome_core import bipartite_match, get_ops, merge, unmerge
from tome_core.adapters.ppdiffusers import FRAMEWORK, MASK_PROCESSORS
from tome_tools.ppdiffusers_models import build_pipeline
from tome_core.hooks.attention_bias import SizeBias
from tome_core.models.families import TEXT_NONE

pytestmark = pytest.mark.usefixtures("sdpa_shim")

SIZE = 32  # image pixels: the tiny VAE downsamples 2x, so 16x16 latents
# Tokens of the finest level with attention at that size and its factor: SD's (and its ControlNet's) is the
# latent grid, tiny SDXL's is 2x down.
FINEST = {"sd": (16 * 16, 1), "sdxl": (8 * 8, 2), "controlnet": (16 * 16, 1)}

Run = Callable[[], np.ndarray]


def condition_image(seed: int) -> paddle.Tensor:
    paddle.seed(seed)
    return paddle.rand([1, 3, SIZE, SIZE])


def runner(pipe: Any, **extra: Any) -> Run:
    """``run()``: one seeded call of ``pipe`` with ``extra`` arguments (a ControlNet pipeline gets its image)."""
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt="a photo of a cat", num_inference_steps=3, guidance_scale=5.0, output_type="np", height=SIZE, width=SIZE)
    if isinstance(pipe, StableDiffusionControlNetPipeline):
        kwargs["image"] = condition_image(7)
    kwargs.update(extra)
    # ppdiffusers' paddle.Generator().manual_seed re-seeds the global generator it draws from: same noise every run.
    return lambda: pipe(**kwargs, generator=paddle.Generator().manual_seed(0)).images


# ------------------------------------------------------------------------------------------------- features
# Each feature sets itself up on a pipeline and returns (the pipeline the user then holds, its seeded call).


def lora_state_dict(unet: UNet2DConditionModel, prefix: str = "unet.") -> Dict[str, paddle.Tensor]:
    """A rank-4 LoRA of every attention projection in ppdiffusers' (non-PEFT) layout, random and non-zero."""
    rng = np.random.default_rng(5)
    randn = lambda *shape: paddle.to_tensor((rng.standard_normal(shape) * 0.1).astype(np.float32))
    state = {}
    for name, layer in unet.named_sublayers():
        if name.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v") or name.endswith("to_out.0"):
            features_in, features_out = layer.weight.shape  # paddle's Linear weight is [in, out]
            state[f"{prefix}{name}.lora.down.weight"] = randn(features_in, 4)
            state[f"{prefix}{name}.lora.up.weight"] = randn(4, features_out)
    return state


def lora(pipe):
    """``pipe.load_lora_weights`` from a state dict, applied at half scale."""
    pipe.load_lora_weights(lora_state_dict(pipe.unet))
    return pipe, runner(pipe, cross_attention_kwargs={"scale": 0.5})


def lora_from_file(pipe):
    """A LoRA saved with ``save_lora_weights`` to a folder, loaded with ``unet.load_attn_procs`` from there."""
    with tempfile.TemporaryDirectory(prefix="tome-lora-") as folder:
        type(pipe).save_lora_weights(folder, unet_lora_layers=lora_state_dict(pipe.unet, prefix=""))
        pipe.unet.load_attn_procs(folder)
    return pipe, runner(pipe)


def ip_adapter(pipe):
    """An IP-Adapter from a state dict of random weights (the layout ``load_ip_adapter`` reads) and a tiny CLIP
    image encoder, no download; the pipeline encodes the image prompt itself."""
    paddle.seed(9)
    encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                         image_size=SIZE, patch_size=8, projection_dim=16)
    )  # fmt: skip
    encoder.eval()
    pipe = type(pipe)(**{**pipe.components, "image_encoder": encoder})
    unet = pipe.unet
    dim = unet.config.cross_attention_dim
    rng = np.random.default_rng(7)
    randn = lambda *shape: paddle.to_tensor((rng.standard_normal(shape) * 0.1).astype(np.float32))
    layers = dict(unet.named_sublayers())
    ip_layers, key = {}, 1  # ppdiffusers numbers the cross-attentions 1, 3, 5, ...
    for name in unet.attn_processors:
        if name.endswith("attn2.processor"):
            hidden = layers[name[: -len(".processor")]].to_k.weight.shape[1]
            ip_layers.update({f"{key}.to_k_ip.weight": randn(dim, hidden), f"{key}.to_v_ip.weight": randn(dim, hidden)})
            key += 2
    image_proj = {"proj.weight": randn(16, 4 * dim), "proj.bias": randn(4 * dim), "norm.weight": paddle.ones([dim]), "norm.bias": paddle.zeros([dim])}
    unet._load_ip_adapter_weights({"image_proj": image_proj, "ip_adapter": ip_layers})
    return pipe, runner(pipe, ip_adapter_image=condition_image(11))


def attention_slicing(pipe):
    pipe.enable_attention_slicing("max")
    return pipe, runner(pipe)


def classic_processor(pipe):
    pipe.unet.set_attn_processor(AttnProcessor())
    return pipe, runner(pipe)


def sdpa_processor(pipe):
    """``AttnProcessor2_5`` (ppdiffusers' default with ppxformers), through the CPU shim of its attention."""
    pipe.unet.set_attn_processor(AttnProcessor2_5())
    return pipe, runner(pipe)


def sag(pipe):
    components = {name: value for name, value in pipe.components.items() if name != "image_encoder"}
    sag_pipe = StableDiffusionSAGPipeline(**components)
    return sag_pipe, runner(sag_pipe, sag_scale=0.75)


def t2i_adapter(pipe):
    """A T2I-Adapter (random weights) feeding residuals into the UNet's down blocks."""
    paddle.seed(12)
    adapter = T2IAdapter(in_channels=3, channels=[32, 64, 64], num_res_blocks=1, downscale_factor=2)
    adapter.eval()
    components = {name: value for name, value in pipe.components.items() if name != "image_encoder"}
    adapter_pipe = StableDiffusionAdapterPipeline(adapter=adapter, **components)
    return adapter_pipe, runner(adapter_pipe, image=condition_image(13))


FEATURES: Dict[str, Callable[[Any], Tuple[Any, Run]]] = {
    f.__name__: f
    for f in (lora, lora_from_file, ip_adapter, attention_slicing, classic_processor, sdpa_processor, sag, t2i_adapter)
}
SD_ONLY = {"sag", "t2i_adapter"}  # ppdiffusers has no SDXL SAG pipeline; the SDXL adapter pipeline is not tested
CONTROLNET = ("lora", "ip_adapter", "attention_slicing", "sdpa_processor")  # ControlNet beside them
CASES = (
    [("sd", name) for name in FEATURES]
    + [("sdxl", name) for name in FEATURES if name not in SD_ONLY]
    + [("controlnet", name) for name in CONTROLNET]
)


@pytest.fixture(scope="module")
def matrix(compose_matrix):
    return compose_matrix(build_pipeline, tome.patch, FEATURES)


def attn1_token_counts(models: List[paddle.nn.Layer]) -> Tuple[Dict[str, List[Tuple[str, int]]], List[Any]]:
    """(processor class, token count) of every attn1 call per model class, from pre-hooks registered now (after
    ToMe's: they see merged inputs)."""
    seen: Dict[str, List[Tuple[str, int]]] = {}

    def counter(model_name):
        def count(layer, args, kwargs):
            hidden_states = args[0] if args else kwargs["hidden_states"]
            seen.setdefault(model_name, []).append((type(layer.processor).__name__, int(hidden_states.shape[1])))

        return count

    handles = [
        layer.register_forward_pre_hook(counter(type(model).__name__), with_kwargs=True)
        for model in models
        for name, layer in model.named_sublayers()
        if name.endswith("attn1")
    ]
    return seen, handles


@pytest.mark.parametrize("order", ["feature_then_patch", "patch_then_feature"])
@pytest.mark.parametrize("kind, name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_feature_composes_with_tome_in_either_order(kind, name, order, matrix):
    target, run = matrix.set_up(kind, name, order)
    models = [target.unet] + ([target.controlnet] if kind == "controlnet" else [])
    seen, handles = attn1_token_counts(models)
    both = run()
    for handle in handles:
        handle.remove()

    expected = matrix.reference(kind, name)
    assert np.isfinite(both).all()
    assert np.abs(both - expected["alone"]).max() > 1e-4
    np.testing.assert_allclose(both, expected["with_tome"], rtol=0, atol=1e-6)  # the order of set-up does not matter
    full, factor = FINEST[kind]
    assert set(seen) == {type(m).__name__ for m in models}
    for model_name, calls in seen.items():  # every patched model: the finest level ran on half its tokens
        tokens = {count for _, count in calls}
        assert full // 2 in tokens and full not in tokens, (model_name, sorted(set(calls)))
    if name == "sdpa_processor":  # the processor the feature set ran on the merged tokens
        assert ("XFormersAttnProcessor", full // 2) in seen["UNet2DConditionModel"]
    states = {type(model).__name__: state for model, state in tome.patched_models(target)}
    assert set(states) == set(seen)
    for state in states.values():
        level = state.ledger.stats[factor]
        assert (level.tokens, level.kept) == (full, full // 2)

    tome.remove(target)
    assert not tome.patched_models(target)
    np.testing.assert_array_equal(run(), expected["alone"])


def test_lora_is_applied_at_the_scale_of_the_call_under_tome():
    """``cross_attention_kwargs={"scale": ...}`` still reaches the LoRA layers through ToMe's hooks: scale 0 under
    ToMe gives ToMe without the LoRA, exactly."""
    plain = build_pipeline("sd")
    tome.patch(plain, ratio=0.5)
    without_lora = runner(plain)()
    pipe, _ = lora(build_pipeline("sd"))
    tome.patch(pipe, ratio=0.5)
    np.testing.assert_array_equal(runner(pipe, cross_attention_kwargs={"scale": 0.0})(), without_lora)
    assert np.abs(runner(pipe, cross_attention_kwargs={"scale": 0.5})() - without_lora).max() > 1e-4


# ------------------------------------------------------------------------------- processors, one by one


def with_lora(attn: Attention) -> AttnProcessor:
    """ppdiffusers' (non-PEFT) LoRA: ``lora_layer``s on the projections, the classic processor."""
    paddle.seed(4)
    for linear in (attn.to_q, attn.to_k, attn.to_v, attn.to_out[0]):
        features_in, features_out = linear.weight.shape
        layer = LoRALinearLayer(features_in, features_out, rank=4)
        layer.up.weight.set_value(paddle.randn(layer.up.weight.shape) * 0.1)  # its up projection starts at zero
        linear.set_lora_layer(layer)
    return AttnProcessor()


class UserSDPAProcessor:
    """A user processor calling ``scaled_dot_product_attention_`` (``[B, L, H, D]``) without ``attention_mask``:
    size-aware attention reaches it through that function."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        batch, tokens = hidden_states.shape[:2]
        q, k, v = (f(hidden_states).reshape([batch, tokens, attn.heads, -1]) for f in (attn.to_q, attn.to_k, attn.to_v))
        out = paddle.nn.functional.scaled_dot_product_attention_(q, k, v)
        return attn.to_out[1](attn.to_out[0](out.reshape([batch, tokens, -1])))


# (processor factory, its route)
PROCESSORS = {
    "classic": (lambda attn: AttnProcessor(), "mask"),
    "sliced": (lambda attn: SlicedAttnProcessor(slice_size=1), "mask"),
    "xformers-2.5": (lambda attn: XFormersAttnProcessor(), "mask"),
    "lora": (with_lora, "mask"),
    "user-sdpa": (lambda attn: UserSDPAProcessor(), "sdpa"),
}


def merged_tokens(items: int, seed: int = 3):
    """``items`` random 8x8 token grids merged by half, each item by its own match; (merged, match, the merged
    tokens repeated by size: every original token holds its merged token)."""
    x = paddle.to_tensor(np.random.default_rng(seed).standard_normal((items, 64, 32)).astype(np.float32))
    match = bipartite_match(get_ops(x), x, 8, 8, 2, 2, 32, None)
    sizes = match.sizes.numpy().reshape(items, -1)
    assert len({tuple(s) for s in sizes}) == items  # no two items share their sizes
    merged = merge(x, match)
    return merged, match, unmerge(merged, match)


def attention_over(attn: Attention, queries: paddle.Tensor, keys: paddle.Tensor) -> np.ndarray:
    """The oracle: ppdiffusers' classic processor, no mask, queries attending over ``keys`` (LoRA layers on the
    projections apply as in the processor under test)."""
    processor = attn.processor
    attn.set_processor(AttnProcessor())
    try:
        with paddle.no_grad():
            return attn(queries, encoder_hidden_states=keys).numpy()
    finally:
        attn.set_processor(processor)


@pytest.mark.parametrize("processor", PROCESSORS)
def test_size_aware_attention_through_each_processor_equals_attention_over_repeated_tokens(processor, sdpa_shim):
    make, route = PROCESSORS[processor]
    paddle.seed(3)
    attn = Attention(query_dim=32, heads=2, dim_head=16)
    attn.eval()
    attn.set_processor(make(attn))
    assert (type(attn.processor).__name__ in MASK_PROCESSORS) == (route == "mask")
    merged, match, repeated = merged_tokens(2)
    with paddle.no_grad():
        args, kwargs = FRAMEWORK.size_aware(attn, (merged,), {}, SizeBias(match, TEXT_NONE, merged))
        try:
            out = attn(*args, **kwargs).numpy()
        finally:
            FRAMEWORK.size_aware_done(attn, computed=True)
    assert paddle.nn.functional.scaled_dot_product_attention_ is sdpa_shim  # the wrapper is gone after the call
    np.testing.assert_allclose(out, attention_over(attn, merged, repeated), rtol=1e-4, atol=1e-5)
    assert not np.allclose(out, attention_over(attn, merged, merged), atol=1e-4)  # the sizes made a difference


# ------------------------------------------------------------------------------------------ known limits


def test_sag_with_its_stored_attention_map_merged_is_refused_clearly():
    """SAG reads the attention map of the mid block's first self-attention through its own processor, which
    computes attention itself: keep that block unmerged (the default merges the finest level only). Merged
    (``max_downsample=4`` reaches the tiny UNet's mid block), size-aware attention cannot reach that processor
    and says so."""
    sag_pipe, run = sag(build_pipeline("sd"))
    tome.patch(sag_pipe, ratio=0.5, max_downsample=4)
    with pytest.raises(RuntimeError, match=r"proportional_attn=True: .*CrossAttnStoreProcessor.*proportional_attn=False"):
        run()
    tome.remove(sag_pipe)
    assert np.isfinite(run()).all()


# --------------------------------------------------- what ppdiffusers 0.29 lacks or breaks (without ToMe)


@pytest.mark.skipif(USE_PEFT_BACKEND, reason="this shows the default, USE_PEFT_BACKEND unset")
def test_peft_add_adapter_needs_ppdiffusers_peft_backend():
    """ppdiffusers' ``unet.add_adapter(LoraConfig)`` needs ``USE_PEFT_BACKEND=True`` set before ppdiffusers is
    imported (it then fails inside ppdiffusers' bundled PEFT on paddle 3.3.1: ``AttributeError: 'ParameterDict'
    object has no attribute 'items'``). Its LoRA loaders (``load_lora_weights``, ``load_attn_procs``) are tested
    above."""
    from ppdiffusers.peft import LoraConfig

    unet = build_pipeline("sd").unet
    with pytest.raises(ValueError, match="PP-PEFT is not installed"):
        unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))


def test_freeu_fails_in_ppdiffusers_itself_on_paddle_3_3():
    """FreeU's Fourier filter calls ``paddle.fft.fftshift(x, axes=(-2, -1))``, which fails on paddle 3.3.1 with
    negative axes (and then reads ``ifftn(...).real`` as an attribute, a method in paddle 3.3.1): FreeU does not
    run unpatched, so ToMe beside it cannot be tested. When this test fails, FreeU runs: add it to the matrix."""
    pipe = build_pipeline("sd")
    pipe.enable_freeu(s1=0.9, s2=0.2, b1=1.5, b2=1.6)
    with pytest.raises(ValueError, match=r"dims.size\(\) should be equal to shifts.size\(\)"):
        runner(pipe)()


@pytest.mark.parametrize(
    "owner, method",
    [
        (StableDiffusionPipeline, "enable_model_cpu_offload"),
        (StableDiffusionXLPipeline, "enable_model_cpu_offload"),
        (StableDiffusionPipeline, "enable_sequential_cpu_offload"),
        (StableDiffusionPipeline, "fuse_qkv_projections"),
        (UNet2DConditionModel, "fuse_qkv_projections"),
        (UNet2DConditionModel, "enable_layerwise_casting"),
    ],
)
def test_features_ppdiffusers_0_29_lacks(owner, method):
    """What diffusers users stack that ppdiffusers 0.29 does not have (when one appears, add it to the matrix)."""
    assert not hasattr(owner, method)
