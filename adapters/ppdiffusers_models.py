"""Build ppdiffusers (paddle) models and pipelines from :mod:`tome_core.presets` with seeded random weights.

The paddle twin of :mod:`tome_core.adapters.diffusers_models`, used by the examples, the benchmark and the
tests; nothing is downloaded. Weights come from paddle's global generator seeded with ``seed`` (building a
model is the one place that draws from it).
"""

from __future__ import annotations

import tempfile
from typing import Any, Dict, Tuple

import numpy as np
import paddle
import ppdiffusers
from ppdiffusers import (
    AutoencoderKL,
    ControlNetModel,
    DDIMScheduler,
    DiTPipeline,
    FlowMatchEulerDiscreteScheduler,
    StableDiffusion3Pipeline,
    StableDiffusionControlNetPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from ppdiffusers.transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from tome_core.presets import (
    SMALL_VAE,
    TINY_CONTROLNET_CONDITIONING,
    TINY_TEXT_ENCODER,
    TINY_VAE,
    TRANSFORMERS,
    unet_config,
    write_clip_tokenizer_files,
)

PIPELINES = ("sd", "img2img", "inpaint", "sdxl", "controlnet")
TRANSFORMER_PIPELINES = ("sd3", "dit")
# Transformer architectures ppdiffusers 0.29 has: the SD3 presets of tome_core.presets (same argument names;
# ppdiffusers has no Flux and its PixArt does not build on paddle 3.3.1), and a test-sized DiT (the patchified
# Transformer2DModel with class labels and learned sigma).
PADDLE_TRANSFORMERS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    **{name: entry for name, entry in TRANSFORMERS.items() if entry[0] == "SD3Transformer2DModel"},
    "tiny-dit": (
        "Transformer2DModel",
        dict(
            sample_size=16, patch_size=2, in_channels=4, out_channels=8, num_layers=2, attention_head_dim=8,
            num_attention_heads=4, norm_type="ada_norm_zero", num_embeds_ada_norm=1000,
            activation_fn="gelu-approximate", attention_bias=True, norm_elementwise_affine=False,
        ),
    ),
}


def build_unet(preset: str = "tiny", seed: int = 0, **overrides: Any) -> UNet2DConditionModel:
    """A UNet2DConditionModel of a preset architecture with weights drawn from ``seed``."""
    paddle.seed(seed)
    unet = UNet2DConditionModel(**unet_config(preset, **overrides))
    unet.eval()
    return unet


def transformer_config(preset: str, **overrides: Any) -> Tuple[str, Dict[str, Any]]:
    """``(ppdiffusers class name, config)`` of a transformer preset (:data:`PADDLE_TRANSFORMERS`)."""
    if preset not in PADDLE_TRANSFORMERS:
        raise ValueError(f"preset must be one of {', '.join(PADDLE_TRANSFORMERS)} on ppdiffusers, got {preset!r}")
    name, config = PADDLE_TRANSFORMERS[preset]
    return name, {**config, **overrides}


def build_transformer(preset: str = "tiny-sd3", seed: int = 0, **overrides: Any) -> paddle.nn.Layer:
    """A diffusion transformer (SD3, DiT) of a preset architecture with weights drawn from ``seed``.

    Zero-initialised weights (adaLN-zero modulations, final projections, paddle's Linear biases) get small
    random values, as trained weights have, so every block shows in the output."""
    name, config = transformer_config(preset, **overrides)
    paddle.seed(seed)
    model = getattr(ppdiffusers, name)(**config)
    model.eval()
    rng = np.random.default_rng(seed + 1)
    with paddle.no_grad():
        for parameter in model.parameters():
            if not parameter.numpy().any():
                parameter.set_value((rng.standard_normal(parameter.shape) * 0.02).astype(np.float32))
    return model


def transformer_inputs(
    model: paddle.nn.Layer, height: int, width: int, batch: int = 1, text: int = 7, seed: int = 0
) -> Dict[str, Any]:
    """Keyword inputs of one call of a transformer from :func:`build_transformer` on a ``height x width``
    latent at timestep 500, seeded (numpy, so the same arrays can feed a torch model)."""
    rng = np.random.default_rng(seed)
    config = model.config
    randn = lambda *shape: paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))
    sample = randn(batch, config.in_channels, height, width)
    if type(model).__name__.startswith("SD3"):
        return dict(
            hidden_states=sample,
            encoder_hidden_states=randn(batch, text, config.joint_attention_dim),
            pooled_projections=randn(batch, config.pooled_projection_dim),
            timestep=paddle.full([batch], 500.0),
        )
    return dict(
        hidden_states=sample,
        timestep=paddle.full([batch], 500, dtype="int64"),
        class_labels=paddle.to_tensor(rng.integers(0, config.num_embeds_ada_norm, batch)),
    )


def build_transformer_pipeline(kind: str = "sd3", seed: int = 0) -> Any:
    """A tiny transformer pipeline of ``kind`` (one of :data:`TRANSFORMER_PIPELINES`) with random weights.

    "sd3": a StableDiffusion3Pipeline with two tiny CLIP text encoders and no T5 (ppdiffusers then feeds zeros
    in its place); "dit": a DiTPipeline (class labels). Both use the 2x tiny VAE."""
    if kind not in TRANSFORMER_PIPELINES:
        raise ValueError(f"kind must be one of {', '.join(TRANSFORMER_PIPELINES)}, got {kind!r}")
    paddle.seed(seed)
    vae = AutoencoderKL(**TINY_VAE, shift_factor=0.0)
    vae.eval()
    if kind == "dit":
        transformer = build_transformer("tiny-dit", seed)
        scheduler = DDIMScheduler(clip_sample=False)
        return DiTPipeline(transformer=transformer, vae=vae, scheduler=scheduler)
    first, second = (_text_parts(seed + i, with_projection=True, width=16) for i in (1, 2))
    return StableDiffusion3Pipeline(
        transformer=build_transformer("tiny-sd3", seed),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=first["text_encoder"],
        tokenizer=first["tokenizer"],
        text_encoder_2=second["text_encoder"],
        tokenizer_2=second["tokenizer"],
        text_encoder_3=None,
        tokenizer_3=None,
    )


def randomize_zero_outputs(controlnet: ControlNetModel, seed: int = 0) -> ControlNetModel:
    """Give a ControlNet's zero-initialised output convolutions random values, so its blocks show in its output."""
    paddle.seed(seed)
    zero_convs = list(controlnet.controlnet_down_blocks) + [
        controlnet.controlnet_mid_block,
        controlnet.controlnet_cond_embedding.conv_out,
    ]
    with paddle.no_grad():
        for conv in zero_convs:
            conv.weight.set_value(paddle.randn(conv.weight.shape) * 0.05)
            conv.bias.set_value(paddle.randn(conv.bias.shape) * 0.05)
    return controlnet


def build_controlnet(unet: UNet2DConditionModel, seed: int = 0, tiny: bool = True) -> ControlNetModel:
    """A ControlNet shaped like ``unet``; ``tiny`` matches the 2x tiny VAE, else the real 8x conditioning."""
    paddle.seed(seed)
    controlnet = ControlNetModel.from_unet(unet, **(TINY_CONTROLNET_CONDITIONING if tiny else {}))
    controlnet.eval()
    return randomize_zero_outputs(controlnet, seed)


def build_tokenizer() -> CLIPTokenizer:
    """A byte-level CLIP tokenizer from vocabulary files written on the spot (no download)."""
    files = write_clip_tokenizer_files(tempfile.mkdtemp(prefix="tome-tokenizer-"))
    return CLIPTokenizer(files["vocab_file"], files["merges_file"], model_max_length=77)


def _text_parts(seed: int, with_projection: bool = False, width: int = 32) -> Dict[str, Any]:
    paddle.seed(seed)
    config = CLIPTextConfig(**{**TINY_TEXT_ENCODER, "hidden_size": width})
    encoder = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)
    encoder.eval()
    return {"text_encoder": encoder, "tokenizer": build_tokenizer()}


def build_pipeline(kind: str = "sd", seed: int = 0, preset: str = "tiny") -> Any:
    """A pipeline of ``kind`` (one of :data:`PIPELINES`) with random weights.

    ``preset`` names the UNet architecture (:data:`tome_core.presets.UNETS`; SDXL always uses "tiny-xl").
    The "tiny" preset gets a VAE that downsamples 2x; every other preset a narrow VAE with the real 8x.
    """
    if kind not in PIPELINES:
        raise ValueError(f"kind must be one of {', '.join(PIPELINES)}, got {kind!r}")
    paddle.seed(seed)
    vae = AutoencoderKL(**(TINY_VAE if preset == "tiny" else SMALL_VAE))
    vae.eval()
    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False, steps_offset=1
    )
    common = dict(vae=vae, scheduler=scheduler)
    if kind == "sdxl":
        first, second = _text_parts(seed + 1), _text_parts(seed + 2, with_projection=True)
        return StableDiffusionXLPipeline(
            unet=build_unet("tiny-xl", seed),
            text_encoder=first["text_encoder"],
            tokenizer=first["tokenizer"],
            text_encoder_2=second["text_encoder"],
            tokenizer_2=second["tokenizer"],
            **common,
        )
    text = _text_parts(seed + 1, width=unet_config(preset)["cross_attention_dim"])
    common.update(text, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    if kind == "inpaint":
        return StableDiffusionInpaintPipeline(unet=build_unet(preset, seed, in_channels=9), **common)
    unet = build_unet(preset, seed)
    if kind == "controlnet":
        controlnet = build_controlnet(unet, seed + 3, tiny=preset == "tiny")
        return StableDiffusionControlNetPipeline(unet=unet, controlnet=controlnet, **common)
    cls = StableDiffusionImg2ImgPipeline if kind == "img2img" else StableDiffusionPipeline
    return cls(unet=unet, **common)
