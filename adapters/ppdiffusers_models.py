"""Build ppdiffusers (paddle) models and pipelines from :mod:`tome_core.presets` with seeded random weights.

The paddle twin of :mod:`tome_core.adapters.diffusers_models`, used by the examples, the benchmark and the
tests; nothing is downloaded. Weights come from paddle's global generator seeded with ``seed`` (building a
model is the one place that draws from it).
"""

from __future__ import annotations

import tempfile
from typing import Any, Dict

import paddle
from ppdiffusers import (
    AutoencoderKL,
    ControlNetModel,
    DDIMScheduler,
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
    unet_config,
    write_clip_tokenizer_files,
)

PIPELINES = ("sd", "img2img", "inpaint", "sdxl", "controlnet")


def build_unet(preset: str = "tiny", seed: int = 0, **overrides: Any) -> UNet2DConditionModel:
    """A UNet2DConditionModel of a preset architecture with weights drawn from ``seed``."""
    paddle.seed(seed)
    unet = UNet2DConditionModel(**unet_config(preset, **overrides))
    unet.eval()
    return unet


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
