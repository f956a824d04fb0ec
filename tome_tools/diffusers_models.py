"""Build diffusers models and pipelines from :mod:`tome_tools.presets` with seeded random weights.

Used by the examples, the benchmark and the tests; nothing is downloaded.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any, Dict, Tuple

import torch
from diffusers import (
    AutoencoderKL,
    ControlNetModel,
    DDIMScheduler,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

import diffusers

from tome_core.adapters.diffusers import FRAMEWORK
from tome_core.config import ToMeConfig
from tome_core.models.plan import plan_model
from tome_tools.presets import (
    SD_PIPELINES,
    assemble_sd_pipeline,
    TINY_CONTROLNET_CONDITIONING,
    TINY_TEXT_ENCODER,
    TINY_VAE,
    VIDEO_PRESETS,
    VIDEO_TRANSFORMERS,
    transformer_config,
    unet2d_config,
    unet_config,
    video_unet_config,
    write_clip_tokenizer_files,
)

PIPELINES = SD_PIPELINES


def build_unet(preset: str = "tiny", seed: int = 0, **overrides: Any) -> UNet2DConditionModel:
    """A UNet2DConditionModel of a preset architecture with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return UNet2DConditionModel(**unet_config(preset, **overrides)).eval()


def build_transformer(preset: str = "tiny-sd3", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A diffusion transformer (SD3, SD3.5, Flux, PixArt, DiT) of a preset architecture with weights drawn from ``seed``.

    Zero-initialised output layers (adaLN-zero modulations, final projections) get small random values, as
    trained weights have, so every block shows in the output."""
    return random_transformer(*transformer_config(preset, **overrides), seed)


def random_transformer(name: str, config: Dict[str, Any], seed: int) -> torch.nn.Module:
    """diffusers' class ``name`` built from ``config`` with weights drawn from ``seed``, zero-initialised output
    layers given small random values."""
    torch.manual_seed(seed)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # torch.empty then fills with NaN, which _randomize_zeros redraws
    try:
        model = getattr(diffusers, name)(**config).eval()
    finally:
        torch.use_deterministic_algorithms(was)
    _randomize_zeros(model, seed + 1)
    return model


def transformer_inputs(model: torch.nn.Module, height: int, width: int, batch: int = 1, text: int = 7, seed: int = 0) -> Dict[str, Any]:
    """Keyword inputs of one call of a transformer from :func:`build_transformer` on a ``height x width``
    latent (packed into tokens of 2x2 latent pixels for Flux, Flux.2, Qwen-Image and their kin), at the middle
    of its timesteps (500, or 0.5 where its pipelines pass sigmas), seeded."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    randn = lambda *shape: torch.randn(*shape, generator=generator)
    name = type(model).__name__
    if len(config.get("axes_dims_rope") or ()) or "img_shapes" in inspect.signature(model.forward).parameters:
        return _packed_inputs(model, height // 2, width // 2, batch, text, randn)
    sample = randn(batch, config.in_channels, height, width)
    if name.startswith("SD3"):
        return dict(
            hidden_states=sample,
            encoder_hidden_states=randn(batch, text, config.joint_attention_dim),
            pooled_projections=randn(batch, config.pooled_projection_dim),
            timestep=torch.full((batch,), 500.0),
        )
    if name.startswith("DiT"):
        return dict(hidden_states=sample, timestep=torch.full((batch,), 500), class_labels=torch.arange(batch) % 10)
    return dict(
        hidden_states=sample,
        encoder_hidden_states=randn(batch, text, config.get("caption_channels") or config.cross_attention_dim),
        timestep=torch.full((batch,), 500, dtype=torch.long),
        added_cond_kwargs={"resolution": None, "aspect_ratio": None},
    )


def add_flux_ip_adapter(model: torch.nn.Module, inputs: Dict[str, Any], scale: float, batch: int) -> None:
    """Give every attention of a tiny Flux diffusers' ``FluxIPAdapterAttnProcessor`` at ``scale`` (random
    image-prompt projections, 4 image-prompt tokens, seeded) and ``inputs`` (a call of ``batch`` items) its image
    prompt."""
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    width = model.config.num_attention_heads * model.config.attention_head_dim
    generator = torch.Generator().manual_seed(3)
    processors = {}
    for name in model.attn_processors:
        processor = processors[name] = FluxIPAdapterAttnProcessor(width, 16, num_tokens=(4,), scale=scale)
        for parameter in processor.parameters():
            parameter.data = torch.randn(parameter.shape, generator=generator) * 0.1
    model.set_attn_processor(processors)
    inputs["joint_attention_kwargs"] = {"ip_hidden_states": [torch.randn(batch, 4, 16, generator=generator)]}


def _packed_inputs(model: torch.nn.Module, h: int, w: int, batch: int, text: int, randn: Any) -> Dict[str, Any]:
    """A call of a packed-token transformer on an ``h x w`` token grid: every argument its ``forward`` takes of
    those its kin take (ids with one column per rotary axis, Qwen-Image's ``img_shapes``, Chroma's attention
    mask over ``[text; image]``, Bria-FIBO's text-encoder layers and key-padding mask); the second prompt is
    padded after 5 tokens where a mask is taken."""
    config = model.config
    takes = inspect.signature(model.forward).parameters
    tokens = h * w
    columns = len(config.get("axes_dims_rope") or (0, 0, 0))
    ids = torch.zeros(h, w, columns)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    prompt = torch.ones(batch, text, dtype=torch.bool)
    prompt[1:, 5:] = False
    image = torch.ones(batch, tokens, dtype=torch.bool)
    scale = plan_model(FRAMEWORK, model, ToMeConfig()).facts.timesteps or 1000.0
    inputs: Dict[str, Any] = dict(
        hidden_states=randn(batch, tokens, config.in_channels),
        encoder_hidden_states=randn(batch, text, config.joint_attention_dim),
        timestep=torch.full((batch,), 0.5 * scale),
        img_ids=ids.reshape(-1, columns),
        txt_ids=torch.zeros(text, columns),
        img_shapes=[[(1, h, w)]] * batch,
        encoder_hidden_states_mask=prompt.long(),
        attention_mask=torch.cat([prompt, image], 1),
    )
    if config.get("pooled_projection_dim"):
        inputs["pooled_projections"] = randn(batch, config.pooled_projection_dim)
    if config.get("guidance_embeds") or (config.get("guidance_embeds") is None and "guidance" in takes):
        inputs["guidance"] = torch.full((batch,), 3.5)
    if "text_encoder_layers" in takes:  # Bria-FIBO: one text-encoder layer per block, a key-padding mask
        layers = config.num_layers + config.num_single_layers
        inputs["text_encoder_layers"] = [inputs["encoder_hidden_states"][..., : config.text_encoder_dim]] * layers
        inputs["joint_attention_kwargs"] = {"attention_mask": inputs.pop("attention_mask")[:, None, None, :]}
    return {key: value for key, value in inputs.items() if key in takes}


TRANSFORMER_PIPELINES = ("sd3", "sd3-img2img", "sd3-controlnet", "flux", "flux-kontext", "flux-controlnet", "pixart-alpha", "pixart-sigma")


def build_transformer_pipeline(kind: str = "sd3", seed: int = 0, text: int = 7) -> Tuple[Any, Dict[str, Any]]:
    """A transformer pipeline of ``kind`` (:data:`TRANSFORMER_PIPELINES`) on the tiny presets, and the keyword
    arguments of a call: text embeddings of ``text`` tokens stand in for the text encoders (no tokenizer files
    can be had offline), so the pipeline holds none. Call it with ``height``/``width``, steps and a generator."""
    if kind not in TRANSFORMER_PIPELINES:
        raise ValueError(f"kind must be one of {', '.join(TRANSFORMER_PIPELINES)}, got {kind!r}")
    family = kind.split("-")[0]
    transformer = build_transformer(f"tiny-{family}", seed)
    torch.manual_seed(seed)
    vae = AutoencoderKL(**TINY_VAE, shift_factor=0.0).eval()  # SD3/Flux pipelines read a shift factor
    generator = torch.Generator().manual_seed(seed + 1)
    randn = lambda *shape: torch.randn(*shape, generator=generator)
    config = transformer.config
    no_text = {name: None for name in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")}
    parts: Dict[str, Any] = dict(transformer=transformer, vae=vae)
    if family == "pixart":
        cls = diffusers.PixArtAlphaPipeline if kind == "pixart-alpha" else diffusers.PixArtSigmaPipeline
        mask = torch.ones(1, text, dtype=torch.long)
        call = dict(
            prompt_embeds=randn(1, text, config.caption_channels), prompt_attention_mask=mask,
            negative_prompt=None, negative_prompt_embeds=randn(1, text, config.caption_channels),
            negative_prompt_attention_mask=mask, use_resolution_binning=False,
        )
        return cls(scheduler=diffusers.DPMSolverMultistepScheduler(), text_encoder=None, tokenizer=None, **parts), call
    parts.update(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), **no_text)
    if family == "flux":
        call = dict(prompt_embeds=randn(1, text, config.joint_attention_dim), pooled_prompt_embeds=randn(1, config.pooled_projection_dim))
        if kind == "flux":
            return diffusers.FluxPipeline(**parts), call
        if kind == "flux-kontext":  # the reference image's tokens follow the output's (their ids' index 1)
            call.update(image=randn(1, 3, 32, 32).clamp(-1, 1) * 0.5 + 0.5, _auto_resize=False, max_area=32 * 32)
            return diffusers.FluxKontextPipeline(**parts), call
        torch.manual_seed(seed + 2)
        controlnet = diffusers.FluxControlNetModel(
            **{k: config[k] for k in ("patch_size", "in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "axes_dims_rope")},
            num_layers=1, num_single_layers=1,
        ).eval()
        _randomize_zeros(controlnet, seed + 2)
        call.update(control_image=randn(1, 3, 32, 32), controlnet_conditioning_scale=1.0)
        return diffusers.FluxControlNetPipeline(controlnet=controlnet, **parts), call
    parts.update(text_encoder_3=None, tokenizer_3=None)
    call = dict(
        prompt_embeds=randn(1, text, config.joint_attention_dim), pooled_prompt_embeds=randn(1, config.pooled_projection_dim),
        negative_prompt_embeds=randn(1, text, config.joint_attention_dim),
        negative_pooled_prompt_embeds=randn(1, config.pooled_projection_dim),
    )
    if kind == "sd3":
        return diffusers.StableDiffusion3Pipeline(**parts), call
    if kind == "sd3-img2img":
        call.update(image=randn(1, 3, 32, 32).clamp(-1, 1) * 0.5 + 0.5, strength=0.75)
        return diffusers.StableDiffusion3Img2ImgPipeline(**parts), call
    torch.manual_seed(seed + 2)
    controlnet = diffusers.SD3ControlNetModel(
        **{k: config[k] for k in ("sample_size", "patch_size", "in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim", "out_channels")},
        num_layers=1,
    ).eval()
    _randomize_zeros(controlnet, seed + 2)
    call.update(control_image=randn(1, 3, 32, 32), controlnet_conditioning_scale=1.0)
    return diffusers.StableDiffusion3ControlNetPipeline(controlnet=controlnet, **parts), call


def _randomize_zeros(model: torch.nn.Module, seed: int) -> None:
    """Give zero-initialised parameters (adaLN-zero, ControlNet zero convolutions) small random values, and
    seeded ones to parameters that diffusers leaves uninitialised (``torch.empty``: NucleusMoE's experts),
    whose memory may hold anything, NaN included."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            unset = parameter.is_floating_point() and not (torch.isfinite(parameter).all() and parameter.abs().max() < 1e3)
            if parameter.ndim >= 1 and (unset or not parameter.any()):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)


def randomize_zero_outputs(controlnet: ControlNetModel, seed: int = 0) -> ControlNetModel:
    """Give a ControlNet's zero-initialised output convolutions random values, so its blocks show in its output."""
    generator = torch.Generator().manual_seed(seed)
    zero_convs = list(controlnet.controlnet_down_blocks) + [
        controlnet.controlnet_mid_block,
        controlnet.controlnet_cond_embedding.conv_out,
    ]
    with torch.no_grad():
        for conv in zero_convs:
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator) * 0.05)
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=generator) * 0.05)
    return controlnet


def build_controlnet(unet: UNet2DConditionModel, seed: int = 0, tiny: bool = True) -> ControlNetModel:
    """A ControlNet shaped like ``unet``; ``tiny`` matches the 2x tiny VAE, else the real 8x conditioning."""
    torch.manual_seed(seed)
    controlnet = ControlNetModel.from_unet(unet, **(TINY_CONTROLNET_CONDITIONING if tiny else {}))
    return randomize_zero_outputs(controlnet.eval(), seed)


def _text_parts(seed: int, with_projection: bool = False, width: int = 32) -> Dict[str, Any]:
    torch.manual_seed(seed)
    config = CLIPTextConfig(**{**TINY_TEXT_ENCODER, "hidden_size": width})
    encoder = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config).eval()
    files = write_clip_tokenizer_files()
    tokenizer = CLIPTokenizer(files["vocab_file"], files["merges_file"], model_max_length=77)
    return {"text_encoder": encoder, "tokenizer": tokenizer}


def build_pipeline(kind: str = "sd", seed: int = 0, preset: str = "tiny") -> Any:
    """A pipeline of ``kind`` (one of :data:`PIPELINES`) with random weights, on the CPU.

    ``preset`` names the UNet architecture (:data:`tome_tools.presets.UNETS`; SDXL always uses "tiny-xl").
    The "tiny" preset gets a VAE that downsamples 2x; every other preset a narrow VAE with the real 8x.
    """
    parts = SimpleNamespace(seed=torch.manual_seed, build_unet=build_unet, build_controlnet=build_controlnet, text_parts=_text_parts)
    return assemble_sd_pipeline(diffusers, parts, kind, seed, preset)


VIDEO_UNETS = ("animatediff", "svd", "text-to-video")


def build_video_unet(kind: str = "animatediff", seed: int = 0) -> torch.nn.Module:
    """A tiny video UNet with weights drawn from ``seed``: ``animatediff`` (UNetMotionModel from a tiny
    UNet2DConditionModel and MotionAdapter), ``svd`` (UNetSpatioTemporalConditionModel) or ``text-to-video``
    (UNet3DConditionModel)."""
    if kind not in VIDEO_UNETS:
        raise ValueError(f"kind must be one of {', '.join(VIDEO_UNETS)}, got {kind!r}")
    torch.manual_seed(seed)
    if kind == "animatediff":
        unet = UNet2DConditionModel(**video_unet_config("tiny-video-sd")[1])
        adapter = diffusers.MotionAdapter(**video_unet_config("tiny-animatediff")[1])
        return diffusers.UNetMotionModel.from_unet2d(unet, adapter).eval()
    name, config = video_unet_config("tiny-svd" if kind == "svd" else "tiny-text-to-video")
    return getattr(diffusers, name)(**config).eval()


def video_unet_inputs(model: torch.nn.Module, frames: int, height: int, width: int, batch: int = 1, seed: int = 0) -> Dict[str, Any]:
    """Keyword inputs of one call of a UNet from :func:`build_video_unet`: ``frames`` frames of a ``height x
    width`` latent, timestep 500, seeded text (or image) embeddings."""
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator)
    config = model.config
    if type(model).__name__ == "UNetSpatioTemporalConditionModel":  # sample [B, F, C, H, W], one image embedding
        return dict(
            sample=randn(batch, frames, config.in_channels, height, width),
            timestep=torch.tensor(500.0),
            encoder_hidden_states=randn(batch, 1, config.cross_attention_dim),
            added_time_ids=torch.tensor([[6.0, 127.0, 0.02]] * batch),
        )
    text = randn(batch, 7, config.cross_attention_dim)
    if type(model).__name__ == "UNetMotionModel":  # takes the text per frame, as AnimateDiffPipeline repeats it
        text = text.repeat_interleave(frames, dim=0)
    return dict(sample=randn(batch, config.in_channels, frames, height, width), timestep=torch.tensor(500), encoder_hidden_states=text)


VIDEO_PIPELINES = VIDEO_UNETS


def build_video_transformer(preset: str = "tiny-wan", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A video transformer of :data:`VIDEO_TRANSFORMERS` (``WanTransformer3DModel``) with weights from ``seed``;
    zero-initialised output layers get small random values, as trained weights have."""
    if preset not in VIDEO_TRANSFORMERS:
        raise ValueError(f"preset must be one of {', '.join(VIDEO_TRANSFORMERS)}, got {preset!r}")
    name, config = VIDEO_TRANSFORMERS[preset]
    return random_transformer(name, {**config, **overrides}, seed)


def video_transformer_inputs(
    model: torch.nn.Module, frames: int, height: int, width: int, batch: int = 1, text: int = 7, seed: int = 0,
) -> Dict[str, Any]:
    """Keyword inputs of one call of a video transformer of :data:`VIDEO_TRANSFORMERS` on ``frames`` latent
    frames of ``height x width``, at timestep 500, seeded: every argument its ``forward`` takes of those its kin
    take (a 5-D latent, frames first for CogVideoX; LTX's packed tokens with their sizes; a text mask with the
    second prompt padded after 5 tokens; Kandinsky's channels-last latent (5: with its rotary positions; 6: with
    its conditioning latent and mask, and 5 audio tokens), Wan VACE's control latent; no mask for Latte, which
    repeats the text per frame)."""
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator)
    config = model.config
    takes = inspect.signature(model.forward).parameters
    name = type(model).__name__
    channels = config.get("in_channels") or config.get("in_visual_dim")
    if config.get("visual_cond"):  # Kandinsky 6: [noisy latent; conditioning latent; conditioning mask]
        channels = 2 * channels + 1
    mask = torch.ones(batch, text)
    mask[1:, 5:] = 0
    text_width = (
        config.get("text_embed_dim") or config.get("caption_channels") or config.get("text_dim") or config.get("in_text_dim")
    )
    if name.startswith("CogVideoX"):
        latent = randn(batch, frames, channels, height, width)
    elif name.startswith("LTX"):
        latent = randn(batch, frames * height * width, channels)
    elif name.startswith("Kandinsky"):
        latent = randn(batch, frames, height, width, channels)
    else:
        latent = randn(batch, channels, frames, height, width)
    inputs: Dict[str, Any] = dict(
        hidden_states=latent,
        timestep=torch.full((batch,), 500.0),
        encoder_hidden_states=randn(batch, text, text_width),
        encoder_attention_mask=mask.bool() if name.startswith(("LTX", "Kandinsky")) else mask,
        num_frames=frames, height=height, width=width,
    )
    if name.startswith("Latte"):
        del inputs["encoder_attention_mask"]
    if name.startswith("Kandinsky"):
        _, rows, cols = config.patch_size
        inputs.update(
            pooled_projections=randn(batch, config.in_text_dim2), text_rope_pos=torch.arange(text),
            visual_rope_pos=[torch.arange(frames), torch.arange(height // rows), torch.arange(width // cols)],
        )
        if config.get("in_audio_dim"):
            inputs["audio_hidden_states"] = randn(batch, 5, config.in_audio_dim)
    if config.get("vace_in_channels"):
        inputs["control_hidden_states"] = randn(batch, config.vace_in_channels, frames, height, width)
    if config.get("pooled_projection_dim"):
        inputs["pooled_projections"] = randn(batch, config.pooled_projection_dim)
    if config.get("guidance_embeds"):
        inputs["guidance"] = torch.full((batch,), 6000.0)
    if config.get("text_embed_2_dim"):  # HunyuanVideo 1.5: a second text encoder and image embeddings
        inputs.update(
            encoder_hidden_states_2=randn(batch, 4, config.text_embed_2_dim), encoder_attention_mask_2=torch.ones(batch, 4),
            image_embeds=torch.zeros(batch, 3, config.image_embed_dim),
        )
    return {key: value for key, value in inputs.items() if key in takes}


def build_wan_pipeline(seed: int = 0) -> Tuple[Any, Dict[str, Any]]:
    """A ``WanPipeline`` on the tiny Wan transformer (``build_video_transformer("tiny-wan")``) with a tiny
    random-weight ``AutoencoderKLWan`` (2x spatial, no temporal compression) and text embeddings in place of the
    text encoder, and the keyword arguments of a call (give ``height``, ``width``, ``num_frames``, steps and a
    generator)."""
    transformer = build_video_transformer("tiny-wan", seed)
    torch.manual_seed(seed + 1)
    vae = diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=transformer.config.in_channels, dim_mult=[1, 1], num_res_blocks=1,
        temperal_downsample=[False], scale_factor_spatial=2, scale_factor_temporal=1,
    ).eval()
    pipe = diffusers.WanPipeline(
        tokenizer=None, text_encoder=None, transformer=transformer, vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
    )
    generator = torch.Generator().manual_seed(seed + 2)
    text = lambda: torch.randn(1, 5, transformer.config.text_dim, generator=generator)
    return pipe, dict(prompt_embeds=text(), negative_prompt_embeds=text())


def build_video_pipeline(kind: str = "animatediff", seed: int = 0) -> Tuple[Any, Dict[str, Any]]:
    """A tiny video pipeline (``AnimateDiffPipeline``, ``StableVideoDiffusionPipeline`` or
    ``TextToVideoSDPipeline``) on the UNets of :func:`build_video_unet`, with tiny random-weight VAEs and text
    or image encoders (a hand-written tokenizer; nothing is downloaded), and the keyword arguments of a call
    (16x16 pixels: an 8x8 latent; give ``num_frames``, steps and a generator)."""
    if kind not in VIDEO_PIPELINES:
        raise ValueError(f"kind must be one of {', '.join(VIDEO_PIPELINES)}, got {kind!r}")
    unet = build_video_unet(kind, seed)
    torch.manual_seed(seed + 1)
    if kind == "svd":
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

        vae = diffusers.AutoencoderKLTemporalDecoder(
            block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2, latent_channels=4
        ).eval()
        vision = CLIPVisionConfig(
            hidden_size=32, projection_dim=unet.config.cross_attention_dim, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, image_size=224, patch_size=32,
        )
        pipe = diffusers.StableVideoDiffusionPipeline(
            vae=vae,
            image_encoder=CLIPVisionModelWithProjection(vision).eval(),
            unet=unet,
            scheduler=diffusers.EulerDiscreteScheduler(
                prediction_type="v_prediction", timestep_spacing="leading", use_karras_sigmas=True,
                sigma_min=0.002, sigma_max=700.0,
            ),
            feature_extractor=CLIPImageProcessor(crop_size=224, size={"shortest_edge": 224}),
        )
        import PIL.Image  # a tensor image skips the pipeline's resizing to the image encoder's 224x224

        pixels = torch.randint(0, 256, (16, 16, 3), generator=torch.Generator().manual_seed(seed + 2), dtype=torch.uint8)
        image = PIL.Image.fromarray(pixels.numpy())
        return pipe, dict(image=image, height=16, width=16, decode_chunk_size=4, max_guidance_scale=2.0)
    vae = AutoencoderKL(**TINY_VAE).eval()
    text = _text_parts(seed + 2, width=unet.config.cross_attention_dim)
    scheduler = DDIMScheduler(
        beta_schedule="linear", beta_start=0.00085, beta_end=0.012, clip_sample=False, steps_offset=1
    )
    call = dict(prompt="a cat walking", height=16, width=16, guidance_scale=5.0)
    if kind == "text-to-video":
        return diffusers.TextToVideoSDPipeline(vae=vae, unet=unet, scheduler=scheduler, **text), call
    torch.manual_seed(seed + 3)
    adapter = diffusers.MotionAdapter(**video_unet_config("tiny-animatediff")[1]).eval()
    adapter.load_state_dict(_motion_modules(unet), strict=False)
    return diffusers.AnimateDiffPipeline(vae=vae, unet=unet, motion_adapter=adapter, scheduler=scheduler, **text), call


def build_video_preset(preset: str, seed: int = 0) -> torch.nn.Module:
    """The video UNet of a benchmark video preset (:data:`tome_tools.presets.VIDEO_PRESETS`) with weights drawn
    from ``seed``: a ``UNetMotionModel`` from its UNet2D and MotionAdapter configs (AnimateDiff), or the named
    video UNet (SVD's ``UNetSpatioTemporalConditionModel``)."""
    if preset not in VIDEO_PRESETS:
        raise ValueError(f"preset must be one of {', '.join(VIDEO_PRESETS)}, got {preset!r}")
    entry = VIDEO_PRESETS[preset]
    torch.manual_seed(seed)
    if "adapter" in entry:
        unet = UNet2DConditionModel(**unet2d_config(entry["unet"]))
        adapter = diffusers.MotionAdapter(**video_unet_config(entry["adapter"])[1])
        return diffusers.UNetMotionModel.from_unet2d(unet, adapter).eval()
    name, config = video_unet_config(entry["model"])
    return getattr(diffusers, name)(**config).eval()


def _motion_modules(unet: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The motion-module weights of a UNetMotionModel, keyed as a MotionAdapter holds them."""
    return {k: v for k, v in unet.state_dict().items() if "motion_modules" in k}


VIDEO_CONTROLNET_PIPELINES = ("animatediff-controlnet", "animatediff-sparsectrl")


def build_video_controlnet(kind: str = "animatediff-controlnet", seed: int = 0) -> torch.nn.Module:
    """The ControlNet of a video ControlNet pipeline (:data:`VIDEO_CONTROLNET_PIPELINES`), shaped like the tiny
    AnimateDiff UNet, with weights drawn from ``seed`` and its zero-initialised output convolutions given random
    values (so its blocks show in the video):

    - ``animatediff-controlnet``: an image ``ControlNetModel`` (``from_unet`` of the "tiny-video-sd" UNet2D and
      its weights); ``AnimateDiffControlNetPipeline`` feeds it the frames as a batch (4-D sample).
    - ``animatediff-sparsectrl``: a ``SparseControlNetModel`` (SparseCtrl: spatial blocks plus motion modules of
      the "tiny-animatediff" adapter's shape; the simplified condition embedding, on VAE latents), fed the 5-D
      video latent."""
    if kind not in VIDEO_CONTROLNET_PIPELINES:
        raise ValueError(f"kind must be one of {', '.join(VIDEO_CONTROLNET_PIPELINES)}, got {kind!r}")
    unet_config2d = video_unet_config("tiny-video-sd")[1]
    torch.manual_seed(seed)
    if kind == "animatediff-controlnet":
        controlnet = ControlNetModel.from_unet(UNet2DConditionModel(**unet_config2d), **TINY_CONTROLNET_CONDITIONING)
        return randomize_zero_outputs(controlnet.eval(), seed)
    adapter = video_unet_config("tiny-animatediff")[1]
    controlnet = diffusers.SparseControlNetModel(
        **{k: unet_config2d[k] for k in ("block_out_channels", "layers_per_block", "cross_attention_dim", "attention_head_dim")},
        down_block_types=tuple(t.replace("2D", "Motion") for t in unet_config2d["down_block_types"]),
        motion_num_attention_heads=adapter["motion_num_attention_heads"],
        motion_max_seq_length=adapter["motion_max_seq_length"],
        conditioning_channels=TINY_VAE["latent_channels"],
    ).eval()
    zero_convs = list(controlnet.controlnet_down_blocks) + [controlnet.controlnet_mid_block, controlnet.controlnet_cond_embedding]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for conv in zero_convs:
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator) * 0.05)
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=generator) * 0.05)
    return controlnet


def build_video_controlnet_pipeline(kind: str = "animatediff-controlnet", seed: int = 0, frames: int = 4) -> Tuple[Any, Dict[str, Any]]:
    """AnimateDiff with a ControlNet (:data:`VIDEO_CONTROLNET_PIPELINES`): ``AnimateDiffControlNetPipeline`` or
    ``AnimateDiffSparseControlNetPipeline`` on the parts of :func:`build_video_pipeline` ("animatediff") and the
    ControlNet of :func:`build_video_controlnet`, and the keyword arguments of a call of ``frames`` frames at
    16x16 pixels (an 8x8 latent; give steps and a generator). Conditioning frames: for the ControlNet a list of
    ``frames`` tensors ``[3, 16, 16]`` in [0, 1] (the pipeline wants a list, one image per frame); for SparseCtrl two PIL key frames, at the first and
    last frame. Nothing is downloaded.

    SparseCtrl's pipeline encodes its key frames with the VAE by sampling the latent distribution from torch's
    global generator (not the call's): seed it (``torch.manual_seed``) before each call to repeat a video."""
    base, call = build_video_pipeline("animatediff", seed)
    parts = {k: v for k, v in base.components.items() if k not in ("feature_extractor", "image_encoder")}
    controlnet = build_video_controlnet(kind, seed + 4)
    generator = torch.Generator().manual_seed(seed + 5)
    call = dict(call, num_frames=frames, controlnet_conditioning_scale=1.0)
    if kind == "animatediff-controlnet":
        call.update(conditioning_frames=list(torch.rand(frames, 3, 16, 16, generator=generator)))
        return diffusers.AnimateDiffControlNetPipeline(controlnet=controlnet, **parts), call
    import PIL.Image

    pixels = torch.randint(0, 256, (2, 16, 16, 3), generator=generator, dtype=torch.uint8).numpy()
    call.update(conditioning_frames=[PIL.Image.fromarray(key) for key in pixels], controlnet_frame_indices=[0, frames - 1])
    return diffusers.AnimateDiffSparseControlNetPipeline(controlnet=controlnet, **parts), call
