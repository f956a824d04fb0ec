"""Build diffusers' Flax models and pipelines from :mod:`tome_tools.presets` with seeded random weights.

Used by the examples, the benchmark and the tests; nothing is downloaded. ``init_weights`` of even a tiny
Flax UNet takes 30-50 s, so parameters come from ``jax.eval_shape`` of ``init`` (shapes only, well under a
second) filled with seeded numpy values: kernels ~ N(0, 1/fan_in), biases and embeddings small, norm
scales near 1. Every weight is random, including the ControlNet's zero-initialised output convolutions, so
its transformer blocks show in its output.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from diffusers import (
    FlaxAutoencoderKL,
    FlaxControlNetModel,
    FlaxDDIMScheduler,
    FlaxStableDiffusionControlNetPipeline,
    FlaxStableDiffusionPipeline,
    FlaxUNet2DConditionModel,
)
from flax.core.frozen_dict import unfreeze
from transformers import CLIPTextConfig, CLIPTokenizer, FlaxCLIPTextModel

from tome_tools.presets import SD_SCHEDULER, TINY_CONTROLNET_CONDITIONING, TINY_TEXT_ENCODER, TINY_VAE, unet_config, write_clip_tokenizer_files

PIPELINES = ("sd", "controlnet")
# Overrides making the "tiny" preset a 2-level UNet (attention at 1/1 and in the middle): half the XLA
# compilation time, for tests that compile many variants.
TWO_LEVELS: Dict[str, Any] = dict(
    block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
)
# The same for "tiny-xl": attention (two layers per transformer) only at 1/2, the finest level with attention.
TWO_LEVELS_XL: Dict[str, Any] = dict(
    block_out_channels=(32, 64),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2),
)
# UNet config keys diffusers' Flax UNet does not have (it always uses 32 norm groups).
_TORCH_ONLY_KEYS = ("norm_num_groups",)


def random_params(shapes: Any, seed: int = 0) -> Dict[str, Any]:
    """Parameters for a tree of shapes (as ``jax.eval_shape`` returns), drawn from ``seed`` in path order."""
    rng = np.random.default_rng(seed)
    flat = jax.tree_util.tree_flatten_with_path(unfreeze(shapes))[0]
    leaves = []
    for path, leaf in flat:
        name = str(getattr(path[-1], "key", path[-1]))
        shape = tuple(leaf.shape)
        if name == "scale":
            value = 1 + 0.1 * rng.standard_normal(shape)
        elif name == "kernel":
            fan_in = math.prod(shape[:-1]) or 1
            value = rng.standard_normal(shape) / math.sqrt(fan_in)
        else:  # biases, embeddings
            value = 0.05 * rng.standard_normal(shape)
        leaves.append(jnp.asarray(value, dtype=leaf.dtype))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(unfreeze(shapes)), leaves)


def _unet_inputs(config: Dict[str, Any], batch: int = 1, size: Optional[int] = None) -> Tuple[Any, ...]:
    size = size or config.get("sample_size", 16)
    sample = jnp.zeros((batch, config.get("in_channels", 4), size, size), jnp.float32)
    timesteps = jnp.ones((batch,), jnp.int32)
    context = jnp.zeros((batch, 1, config["cross_attention_dim"]), jnp.float32)
    added = None
    if config.get("addition_embed_type") == "text_time":
        time_ids = 6
        text_dim = config["projection_class_embeddings_input_dim"] - time_ids * config["addition_time_embed_dim"]
        added = {"text_embeds": jnp.zeros((batch, text_dim)), "time_ids": jnp.zeros((batch, time_ids))}
    return sample, timesteps, context, added


def build_unet(preset: str = "tiny", seed: int = 0, **overrides: Any) -> Tuple[FlaxUNet2DConditionModel, Dict]:
    """A FlaxUNet2DConditionModel of a preset architecture and its random parameters."""
    config = {k: v for k, v in unet_config(preset, **overrides).items() if k not in _TORCH_ONLY_KEYS}
    unet = FlaxUNet2DConditionModel(**config)
    return unet, random_params(param_shapes(unet), seed)


class _ShapesOnly:
    """Stands in for a Flax model in diffusers' converter, which only reads ``init_weights`` for key shapes."""

    def __init__(self, shapes: Any):
        self.shapes = unfreeze(shapes)

    def init_weights(self, rng: Any) -> Any:
        return self.shapes


def params_from_torch(torch_model: Any, flax_model: Any, shapes: Optional[Any] = None) -> Dict[str, Any]:
    """A torch diffusers model's weights as ``flax_model``'s parameters, by diffusers' own converter.

    ``shapes`` (the Flax parameter shapes) defaults to ``jax.eval_shape`` of ``init``; the converter would
    otherwise run ``init_weights`` (slow) just to read them.
    """
    from diffusers.models.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax

    if shapes is None:
        shapes = param_shapes(flax_model)
    state_dict = {k: v.detach().cpu() for k, v in torch_model.state_dict().items()}
    return convert_pytorch_state_dict_to_flax(state_dict, _ShapesOnly(shapes))


def param_shapes(model: Any) -> Any:
    """``jax.eval_shape`` of a UNet's or ControlNet's ``init``: the parameter tree as shapes."""
    config = dict(model.config)
    if isinstance(model, FlaxControlNetModel):
        factor = 2 ** (len(model.conditioning_embedding_out_channels) - 1)
        sample, timesteps, context, _ = _unet_inputs(config, size=8)
        cond = jnp.zeros((1, 3, 8 * factor, 8 * factor))
        return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), sample, timesteps, context, cond))["params"]
    sample, timesteps, context, added = _unet_inputs(config, size=8)
    return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), sample, timesteps, context, added))["params"]


def build_controlnet(unet: FlaxUNet2DConditionModel, seed: int = 0) -> Tuple[FlaxControlNetModel, Dict]:
    """A FlaxControlNetModel with ``unet``'s architecture (down path and middle) and random parameters."""
    fields = (
        "in_channels",
        "down_block_types",
        "only_cross_attention",
        "block_out_channels",
        "layers_per_block",
        "attention_head_dim",
        "cross_attention_dim",
        "use_linear_projection",
        "flip_sin_to_cos",
        "freq_shift",
        "sample_size",
    )
    config = {name: unet.config[name] for name in fields if name in unet.config}
    controlnet = FlaxControlNetModel(**config, **TINY_CONTROLNET_CONDITIONING)
    return controlnet, random_params(param_shapes(controlnet), seed)


def build_text_parts(seed: int = 0) -> Tuple[FlaxCLIPTextModel, CLIPTokenizer, Dict]:
    """A tiny FlaxCLIPTextModel (random parameters) and an offline CLIPTokenizer."""
    model = FlaxCLIPTextModel(CLIPTextConfig(**TINY_TEXT_ENCODER), _do_init=False)
    shapes = jax.eval_shape(lambda: model.init_weights(jax.random.PRNGKey(0), (1, 77)))
    files = write_clip_tokenizer_files()
    tokenizer = CLIPTokenizer(files["vocab_file"], files["merges_file"], model_max_length=77)
    return model, tokenizer, random_params(shapes, seed)


def build_vae(seed: int = 0) -> Tuple[FlaxAutoencoderKL, Dict]:
    vae = FlaxAutoencoderKL(**TINY_VAE)
    shapes = jax.eval_shape(lambda: vae.init_weights(jax.random.PRNGKey(0)))
    return vae, random_params(shapes, seed)


def build_pipeline(kind: str = "sd", seed: int = 0, preset: str = "tiny", **unet_overrides: Any) -> Tuple[Any, Dict[str, Any]]:
    """A tiny Flax pipeline of ``kind`` (one of :data:`PIPELINES`) and its parameters (unreplicated).

    The UNet is ``preset`` with ``unet_overrides``; the VAE (2x downsampling) and text encoder are tiny.
    """
    if kind not in PIPELINES:
        raise ValueError(f"kind must be one of {', '.join(PIPELINES)}, got {kind!r}")
    unet, unet_params = build_unet(preset, seed, **unet_overrides)
    vae, vae_params = build_vae(seed + 1)
    text_encoder, tokenizer, text_params = build_text_parts(seed + 2)
    scheduler = FlaxDDIMScheduler(**SD_SCHEDULER)
    parts = dict(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
    )
    params = {
        "unet": unet_params,
        "vae": vae_params,
        "text_encoder": text_params,
        "scheduler": scheduler.create_state(),
    }
    if kind == "controlnet":
        controlnet, params["controlnet"] = build_controlnet(unet, seed + 3)
        return FlaxStableDiffusionControlNetPipeline(controlnet=controlnet, **parts), params
    return FlaxStableDiffusionPipeline(**parts), params
