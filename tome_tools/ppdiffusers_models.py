"""Build ppdiffusers (paddle) models and pipelines from :mod:`tome_tools.presets` with seeded random weights.

The paddle twin of :mod:`tome_tools.diffusers_models`, used by the examples, the benchmark and the
tests; nothing is downloaded. Weights come from paddle's global generator seeded with ``seed`` (building a
model is the one place that draws from it).
"""

from __future__ import annotations

from types import SimpleNamespace
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
    UNet2DConditionModel,
)
from ppdiffusers.transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from tome_tools.presets import (
    SD_PIPELINES,
    assemble_sd_pipeline,
    TINY_CONTROLNET_CONDITIONING,
    TINY_TEXT_ENCODER,
    TINY_VAE,
    TRANSFORMERS,
    unet_config,
    video_unet_config,
    write_clip_tokenizer_files,
)

PIPELINES = SD_PIPELINES
TRANSFORMER_PIPELINES = ("sd3", "dit")
# Transformer architectures ppdiffusers 0.29 has: the SD3 presets of tome_tools.presets (same argument names;
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
    files = write_clip_tokenizer_files()
    return CLIPTokenizer(files["vocab_file"], files["merges_file"], model_max_length=77)


def _text_parts(seed: int, with_projection: bool = False, width: int = 32) -> Dict[str, Any]:
    paddle.seed(seed)
    config = CLIPTextConfig(**{**TINY_TEXT_ENCODER, "hidden_size": width})
    encoder = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)
    encoder.eval()
    return {"text_encoder": encoder, "tokenizer": build_tokenizer()}


def build_pipeline(kind: str = "sd", seed: int = 0, preset: str = "tiny") -> Any:
    """A pipeline of ``kind`` (one of :data:`PIPELINES`) with random weights.

    ``preset`` names the UNet architecture (:data:`tome_tools.presets.UNETS`; SDXL always uses "tiny-xl").
    The "tiny" preset gets a VAE that downsamples 2x; every other preset a narrow VAE with the real 8x.
    """
    parts = SimpleNamespace(seed=paddle.seed, build_unet=build_unet, build_controlnet=build_controlnet, text_parts=_text_parts)
    return assemble_sd_pipeline(ppdiffusers, parts, kind, seed, preset)


VIDEO_UNETS = ("animatediff", "svd", "text-to-video")


def build_video_unet(kind: str = "animatediff", seed: int = 0) -> paddle.nn.Layer:
    """A tiny video UNet with weights drawn from ``seed``: ``animatediff`` (UNetMotionModel from a tiny
    UNet2DConditionModel and MotionAdapter), ``svd`` (UNetSpatioTemporalConditionModel) or ``text-to-video``
    (UNet3DConditionModel), from the same presets as the torch builder."""
    if kind not in VIDEO_UNETS:
        raise ValueError(f"kind must be one of {', '.join(VIDEO_UNETS)}, got {kind!r}")
    if kind == "animatediff":
        model = ppdiffusers.UNetMotionModel.from_unet2d(*_animatediff_parts(seed))
    else:
        name, config = video_unet_config("tiny-svd" if kind == "svd" else "tiny-text-to-video")
        paddle.seed(seed)
        model = getattr(ppdiffusers, name)(**config)
    model.eval()
    return model


def _animatediff_parts(seed: int) -> Tuple[UNet2DConditionModel, Any]:
    """The tiny UNet2DConditionModel and MotionAdapter an AnimateDiff UNet is made of, weights from ``seed``."""
    paddle.seed(seed)
    unet = UNet2DConditionModel(**video_unet_config("tiny-video-sd")[1])
    adapter = ppdiffusers.MotionAdapter(**video_unet_config("tiny-animatediff")[1])
    unet.eval()
    adapter.eval()
    return unet, adapter


def video_unet_inputs(
    model: paddle.nn.Layer, frames: int, height: int, width: int, batch: int = 1, seed: int = 0
) -> Dict[str, Any]:
    """Keyword inputs of one call of a UNet from :func:`build_video_unet`: ``frames`` frames of a ``height x
    width`` latent, timestep 500, seeded text (or image) embeddings (numpy draws, so the same arrays can feed a
    torch model). ppdiffusers' UNetMotionModel takes the text once per video (it repeats it per frame itself)."""
    rng = np.random.default_rng(seed)
    randn = lambda *shape: paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))
    config = model.config
    if type(model).__name__ == "UNetSpatioTemporalConditionModel":  # sample [B, F, C, H, W], one image embedding
        return dict(
            sample=randn(batch, frames, config.in_channels, height, width),
            timestep=paddle.to_tensor(500.0),
            encoder_hidden_states=randn(batch, 1, config.cross_attention_dim),
            added_time_ids=paddle.to_tensor([[6.0, 127.0, 0.02]] * batch),
        )
    sample = randn(batch, config.in_channels, frames, height, width)
    text = randn(batch, 7, config.cross_attention_dim)
    return dict(sample=sample, timestep=paddle.to_tensor(500), encoder_hidden_states=text)


VIDEO_PIPELINES = VIDEO_UNETS


def build_video_pipeline(kind: str = "animatediff", seed: int = 0) -> Tuple[Any, Dict[str, Any]]:
    """A tiny video pipeline (``AnimateDiffPipeline``, ``StableVideoDiffusionPipeline`` or
    ``TextToVideoSDPipeline``) on the UNets of :func:`build_video_unet` (same weights for the same ``seed``),
    with tiny random-weight VAEs and text or image encoders (a hand-written tokenizer; nothing is downloaded),
    and the keyword arguments of a call (16x16 pixels: an 8x8 latent; give ``num_frames``, steps and a
    generator). ppdiffusers' AnimateDiffPipeline builds its UNetMotionModel itself from a UNet2DConditionModel
    and the MotionAdapter."""
    if kind not in VIDEO_PIPELINES:
        raise ValueError(f"kind must be one of {', '.join(VIDEO_PIPELINES)}, got {kind!r}")
    if kind == "svd":
        from ppdiffusers.transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

        unet = build_video_unet(kind, seed)
        paddle.seed(seed + 1)
        vae = ppdiffusers.AutoencoderKLTemporalDecoder(
            block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2, latent_channels=4
        )
        vision = CLIPVisionConfig(
            hidden_size=32, projection_dim=unet.config.cross_attention_dim, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, image_size=224, patch_size=32,
        )
        encoder = CLIPVisionModelWithProjection(vision)
        for layer in (vae, encoder):
            layer.eval()
        pipe = ppdiffusers.StableVideoDiffusionPipeline(
            vae=vae,
            image_encoder=encoder,
            unet=unet,
            scheduler=ppdiffusers.EulerDiscreteScheduler(
                prediction_type="v_prediction", timestep_spacing="leading", use_karras_sigmas=True,
                sigma_min=0.002, sigma_max=700.0,
            ),
            feature_extractor=CLIPImageProcessor(crop_size=224, size={"shortest_edge": 224}),
        )
        import PIL.Image

        pixels = np.random.default_rng(seed + 2).integers(0, 256, (16, 16, 3), dtype=np.uint8)
        image = PIL.Image.fromarray(pixels)
        return pipe, dict(image=image, height=16, width=16, decode_chunk_size=4, max_guidance_scale=2.0)
    paddle.seed(seed + 1)
    vae = AutoencoderKL(**TINY_VAE)
    vae.eval()
    text = _text_parts(seed + 2, width=video_unet_config("tiny-video-sd")[1]["cross_attention_dim"])
    scheduler = DDIMScheduler(beta_schedule="linear", beta_start=0.00085, beta_end=0.012, clip_sample=False, steps_offset=1)
    call = dict(prompt="a cat walking", height=16, width=16, guidance_scale=5.0)
    if kind == "text-to-video":
        unet = build_video_unet(kind, seed)
        return ppdiffusers.TextToVideoSDPipeline(vae=vae, unet=unet, scheduler=scheduler, **text), call
    unet, adapter = _animatediff_parts(seed)
    pipe = ppdiffusers.AnimateDiffPipeline(vae=vae, unet=unet, motion_adapter=adapter, scheduler=scheduler, **text)
    return pipe, call
