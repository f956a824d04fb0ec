"""Tiny pipelines of the diffusers families whose transformers ToMe merges (Flux.2, Qwen-Image, Z-Image, Chroma,
CogView, Lumina 2, HiDream, HunyuanVideo, LTX, CogVideoX, Wan, Mochi, Kandinsky 5... with their edit, inpainting,
image-to-video and ControlNet variants), built from the tiny transformer presets of :mod:`tome_tools.presets` with
seeded random weights and tiny VAEs of each pipeline's own class; nothing is downloaded. (SD, SDXL, SD3, Flux,
PixArt, AnimateDiff, SVD and Wan's text-to-video have their builders in :mod:`tome_tools.diffusers_models`.)

No tokenizer or text encoder can be had offline, so the pipelines hold none: each call passes text embeddings
(and their masks where the pipeline takes them) instead. A recipe is data: the pipeline class, the transformer
preset, the VAE, the call's keyword arguments and any extra component (a ControlNet); :func:`build_zoo_pipeline`
puts one together. :data:`NOT_BUILT` says which pipelines cannot be built so, and why.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch

import diffusers

from tome_tools.diffusers_models import random_transformer
from tome_tools.presets import SMALL_VAE, TINY_VAE, TRANSFORMERS, VIDEO_TRANSFORMERS

Randn = Callable[..., torch.Tensor]
Call = Callable[[Dict[str, Any], Randn], Dict[str, Any]]  # (transformer config, seeded randn) -> call kwargs


def _image(randn: Randn, height: int, width: int) -> Any:
    """A seeded RGB PIL image (the edit pipelines check and resize PIL images)."""
    import PIL.Image

    pixels = (randn(height, width, 3).sigmoid() * 255).to(torch.uint8).numpy()
    return PIL.Image.fromarray(np.ascontiguousarray(pixels))


# ---------------------------------------------------------------------------------------------------------
# VAEs: each pipeline's own class, tiny. A builder takes the transformer's config (its latent channels). The video
# VAEs take their latent channels from the transformer's output: conditioned variants (image to video) concatenate
# more channels at its input.


def _flux2_vae(config: Dict[str, Any], packing: int = 4) -> torch.nn.Module:
    """AutoencoderKLFlux2, 2x downsampling; latents packed 2x2 into the transformer's channels (``packing`` 4; 1:
    its latent channels are the transformer's, Bria-FIBO 2's)."""
    return diffusers.AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(4, 4), layers_per_block=1, latent_channels=config["in_channels"] // packing, norm_num_groups=1,
        use_quant_conv=False, use_post_quant_conv=False, sample_size=32,
    )


def _qwen_vae(levels: int) -> Callable[[Dict[str, Any]], torch.nn.Module]:
    """AutoencoderKLQwenImage with ``levels`` 2x downsamplings (Qwen-Image-Edit resizes its reference image to a
    1024x1024 area whatever is asked: its VAE compresses 16x, so the reference is 32x32 tokens, and is narrow:
    encoding 1024x1024 pixels is most of that pipeline's time)."""

    def build(config: Dict[str, Any]) -> torch.nn.Module:
        z_dim = config["in_channels"] // 4
        return diffusers.AutoencoderKLQwenImage(
            base_dim=2, z_dim=z_dim, dim_mult=[1] * (levels + 1), num_res_blocks=1,
            temperal_downsample=[False] + [True] * (levels - 1), latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
        )
    return build


def _kl_vae(packing: int = 1, base: Dict[str, Any] = TINY_VAE, key: str = "in_channels") -> Callable[[Dict[str, Any]], torch.nn.Module]:
    """The tiny 2x AutoencoderKL of the SD pipelines (or ``base``) with the transformer's latent channels: its
    ``key`` channels (its output's where conditions are concatenated at its input), divided by ``packing`` where
    the pipeline packs 2x2 latent pixels into a token (4)."""

    def build(config: Dict[str, Any]) -> torch.nn.Module:
        return diffusers.AutoencoderKL(**{**base, "latent_channels": config[key] // packing, "shift_factor": 0.0})
    return build


def _hunyuan_video_vae(config: Dict[str, Any]) -> torch.nn.Module:
    """AutoencoderKLHunyuanVideo (8x in space, 4x in time; diffusers' own test size)."""
    return diffusers.AutoencoderKLHunyuanVideo(
        latent_channels=config["out_channels"], block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4, up_block_types=("HunyuanVideoUpBlock3D",) * 4,
    )


def _ltx_vae(config: Dict[str, Any]) -> torch.nn.Module:
    """AutoencoderKLLTXVideo (4x in space and time; diffusers' own test size)."""
    vae = diffusers.AutoencoderKLLTXVideo(
        latent_channels=config["out_channels"], block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, patch_size=1,
    )
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    return vae


def _cogvideox_vae(config: Dict[str, Any]) -> torch.nn.Module:
    """AutoencoderKLCogVideoX (8x in space, 4x in time; diffusers' own test size)."""
    return diffusers.AutoencoderKLCogVideoX(
        down_block_types=("CogVideoXDownBlock3D",) * 4, up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8), latent_channels=config["out_channels"], layers_per_block=1, norm_num_groups=2,
        temporal_compression_ratio=config["temporal_compression_ratio"],
    )


def _hunyuan_video_15_vae(config: Dict[str, Any]) -> torch.nn.Module:
    """AutoencoderKLHunyuanVideo15 (4x in space, 2x in time; diffusers' own test size)."""
    return diffusers.AutoencoderKLHunyuanVideo15(
        latent_channels=config["out_channels"], block_out_channels=(16, 16), layers_per_block=1,
        spatial_compression_ratio=4, temporal_compression_ratio=2, downsample_match_channel=False, upsample_match_channel=False,
    )


def _mochi_vae(config: Dict[str, Any]) -> torch.nn.Module:
    """AutoencoderKLMochi (the pipeline assumes 8x in space, 6x in time; diffusers' own test size)."""
    return diffusers.AutoencoderKLMochi(
        latent_channels=config["in_channels"], out_channels=3, encoder_block_out_channels=(32, 32, 32, 32),
        decoder_block_out_channels=(32, 32, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
    )


def _wan_vae(config: Dict[str, Any]) -> torch.nn.Module:
    """AutoencoderKLWan, 8x in space, 4x in time (diffusers' SkyReels-V2 test size)."""
    z_dim = config["out_channels"]
    return diffusers.AutoencoderKLWan(
        base_dim=3, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
    )


def _allegro_vae(config: Dict[str, Any]) -> torch.nn.Module:
    """AutoencoderKLAllegro, 8x in space, 4x in time (diffusers' own test size)."""
    return diffusers.AutoencoderKLAllegro(
        down_block_types=("AllegroDownBlock3D",) * 4, up_block_types=("AllegroUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8), latent_channels=config["out_channels"], layers_per_block=1, norm_num_groups=2,
        temporal_compression_ratio=4,
    )


def _magvit_vae(config: Dict[str, Any]) -> torch.nn.Module:
    """AutoencoderKLMagvit (EasyAnimate's), 8x in space, 4x in time (diffusers' own test size)."""
    return diffusers.AutoencoderKLMagvit(
        down_block_types=("SpatialDownBlock3D",) + ("SpatialTemporalDownBlock3D",) * 3,
        up_block_types=("SpatialUpBlock3D",) + ("SpatialTemporalUpBlock3D",) * 3, block_out_channels=(8, 8, 8, 8),
        latent_channels=config["out_channels"], layers_per_block=1, norm_num_groups=2, spatial_group_norm=False,
    )


def _kandinsky5_vae(config: Dict[str, Any]) -> torch.nn.Module:
    """AutoencoderKLHunyuanVideo as Kandinsky 5 and 6 hold it (:func:`_hunyuan_video_vae`, 8x in space, 4x in time)."""
    return _hunyuan_video_vae({"out_channels": config["out_visual_dim"]})


def _kandinsky6_audio(config: Dict[str, Any], seed: int) -> Dict[str, Any]:
    """Kandinsky 6's MMAudio VAE and vocoder, tiny; at a 1600 Hz sample rate five frames get 11 audio tokens."""
    torch.manual_seed(seed)
    return dict(
        audio_vae=diffusers.MMAudioVAE(
            mel_bins=8, latent_channels=config["in_audio_dim"], hidden_channels=8, channel_multipliers=(1,),
            layers_per_block=1, sample_rate=1600, n_fft=64, hop_length=16,
        ).eval(),
        vocoder=diffusers.MMAudioVocoder(
            num_mels=8, upsample_initial_channel=8, upsample_rates=(32,), upsample_kernel_sizes=(64,),
            resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),),
        ).eval(),
    )


def _hunyuan_image_vae(config: Dict[str, Any]) -> torch.nn.Module:
    """AutoencoderKLHunyuanImage, 8x (diffusers' own test size)."""
    return diffusers.AutoencoderKLHunyuanImage(
        in_channels=3, out_channels=3, latent_channels=config["in_channels"], block_out_channels=(32, 64, 64, 64),
        layers_per_block=1, spatial_compression_ratio=8, sample_size=128,
    )


# ---------------------------------------------------------------------------------------------------------
# Calls: the text embeddings (and masks) each pipeline takes in place of its text encoder, and the sizes.


def _padded_mask(tokens: int = 7, kept: int = 5, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A text mask of one prompt padded after ``kept`` tokens."""
    mask = torch.ones(1, tokens, dtype=dtype)
    mask[:, kept:] = 0
    return mask


def _flux_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    return dict(
        prompt_embeds=randn(1, 7, config["joint_attention_dim"]), pooled_prompt_embeds=randn(1, config["pooled_projection_dim"]),
        height=32, width=32,
    )


def _flux2_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    return dict(prompt_embeds=randn(1, 7, config["joint_attention_dim"]), height=32, width=32)


def _flux2_edit_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # the reference image's tokens follow the output's (Flux.2 checks images are at least 64 px a side)
    return dict(_flux2_call(config, randn), image=_image(randn, 64, 64))


def _bria_fibo2_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    """Text encoder features (the Perceiver's bundle and the injection blocks') of two prompts, of 8 and 2 tokens
    (padded: their gist counts differ, so the gist goes after the image), and of a negative prompt."""
    bundles, width = 1 + len(config["injection_layer_ids"]), config["cap_feat_dim"]
    return dict(
        prompt_embeds=randn(2, bundles, 8, width), prompt_embeds_mask=torch.tensor([[True] * 8, [True] * 2 + [False] * 6]),
        negative_prompt_embeds=randn(2, bundles, 5, width), height=32, width=48,
    )


def _ernie_image_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    """A prompt and a shorter negative prompt (ERNIE-Image pads them into one batch, masking the padding)."""
    text = config["text_in_dim"]
    return dict(prompt_embeds=[randn(7, text)], negative_prompt_embeds=[randn(4, text)], height=64, width=64)


def _flux2_klein_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    text = config["joint_attention_dim"]
    return dict(prompt_embeds=randn(1, 7, text), negative_prompt_embeds=randn(1, 7, text), guidance_scale=4.0, height=32, width=32)


def _flux2_klein_edit_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    return dict(_flux2_klein_call(config, randn), image=_image(randn, 64, 64))


def _flux2_klein_kv_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # step-distilled: no negative prompt; the reference's keys and values are cached at the first step and reused
    return dict(prompt_embeds=randn(1, 7, config["joint_attention_dim"]), image=_image(randn, 64, 64), height=32, width=32)


def _text_cfg(width_key: str, masks: Optional[str] = None, **extra: Any) -> Call:
    """A prompt and a negative prompt of 7 tokens of the transformer's ``width_key`` width at 32x32 pixels (CFG), with
    masks named ``{masks}`` / ``negative_{masks}`` where the pipeline takes them (the negative one padded after 5)."""

    def build(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
        text = config[width_key]
        call = dict(prompt_embeds=randn(1, 7, text), negative_prompt_embeds=randn(1, 7, text), height=32, width=32, **extra)
        if masks:
            call.update({masks: torch.ones(1, 7, dtype=torch.long), f"negative_{masks}": _padded_mask()})
        return call
    return build


def _qwen_text(config: Dict[str, Any], randn: Randn, negative: bool = True) -> Dict[str, Any]:
    """Qwen-Image's prompt embeddings and masks; the negative prompt is padded after 5 tokens (true CFG)."""
    text = config["joint_attention_dim"]
    call = dict(prompt_embeds=randn(1, 7, text), prompt_embeds_mask=torch.ones(1, 7, dtype=torch.long))
    if negative:
        call.update(negative_prompt_embeds=randn(1, 7, text), negative_prompt_embeds_mask=_padded_mask(), true_cfg_scale=2.0)
    return call


def _qwen_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    return dict(_qwen_text(config, randn), height=32, width=32)


def _qwen_edit_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    return dict(_qwen_text(config, randn, negative=False), image=_image(randn, 32, 32), height=128, width=128)


def _qwen_controlnet_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    return dict(_qwen_call(config, randn), control_image=randn(1, 3, 32, 32), controlnet_conditioning_scale=1.0)


def _z_image_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # one caption per prompt, unpadded ([tokens, width]); the negative one shorter
    text = config["cap_feat_dim"]
    return dict(prompt_embeds=[randn(7, text)], negative_prompt_embeds=[randn(5, text)], guidance_scale=3.0, height=32, width=32)


def _chroma_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    text = config["joint_attention_dim"]
    mask = torch.ones(1, 7)  # float, as the pipeline's own text encoding gives it
    return dict(
        prompt_embeds=randn(1, 7, text), prompt_attention_mask=mask, negative_prompt_embeds=randn(1, 7, text),
        negative_prompt_attention_mask=_padded_mask(dtype=mask.dtype), guidance_scale=5.0, height=32, width=32,
    )


def _hunyuan_video_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # LLaMA hidden states with their mask, CLIP's pooled embedding; 5 frames (2 latent frames) of 64x96 pixels
    return dict(
        prompt_embeds=randn(1, 7, config["text_embed_dim"]), pooled_prompt_embeds=randn(1, config["pooled_projection_dim"]),
        prompt_attention_mask=_padded_mask(), height=64, width=96, num_frames=5,
    )


def _hunyuan_video_15_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # Qwen2.5-VL and ByT5 hidden states with their masks, for the prompt and the negative one (the guider's CFG);
    # 3 frames (2 latent frames) of 32x48 pixels
    text, glyphs = config["text_embed_dim"], config["text_embed_2_dim"]
    call: Dict[str, Any] = dict(height=32, width=48, num_frames=3)
    for prefix in ("", "negative_"):
        call.update({
            f"{prefix}prompt_embeds": randn(1, 7, text), f"{prefix}prompt_embeds_mask": _padded_mask(),
            f"{prefix}prompt_embeds_2": randn(1, 4, glyphs), f"{prefix}prompt_embeds_mask_2": torch.ones(1, 4, dtype=torch.long),
        })
    return call


def _ltx_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    text = config["caption_channels"]
    return dict(
        prompt_embeds=randn(1, 7, text), prompt_attention_mask=torch.ones(1, 7, dtype=torch.long),
        negative_prompt_embeds=randn(1, 7, text), negative_prompt_attention_mask=_padded_mask(), guidance_scale=3.0,
        height=32, width=64, num_frames=5,
    )


def _cogvideox_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    text = config["text_embed_dim"]
    return dict(
        prompt_embeds=randn(1, config["max_text_seq_length"], text),
        negative_prompt_embeds=randn(1, config["max_text_seq_length"], text), guidance_scale=6.0, height=64, width=96,
        num_frames=5,
    )


def _cogview4_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    text = config["text_embed_dim"]
    return dict(prompt_embeds=randn(1, 16, text), negative_prompt_embeds=randn(1, 16, text), guidance_scale=5.0, height=32, width=48)


def _lumina2_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # Lumina 2 assumes an 8x VAE whatever it holds (the latent is 1/8 of the size). Captions of one length: with
    # captions of different lengths (padded) its joint blocks run unmerged (tests/torch/test_zoo.py checks that).
    text = config["cap_feat_dim"]
    mask = torch.ones(1, 8, dtype=torch.bool)
    return dict(
        prompt_embeds=randn(1, 8, text), prompt_attention_mask=mask, negative_prompt_embeds=randn(1, 8, text),
        negative_prompt_attention_mask=mask, guidance_scale=4.0, height=96, width=128,
    )


def _lumina_next_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # an 8x VAE assumed as Lumina 2's; the negative caption padded after 5 of its 8 tokens
    text = config["cross_attention_dim"]
    negative_mask = torch.tensor([[1] * 5 + [0] * 3])
    return dict(
        prompt_embeds=randn(1, 8, text), prompt_attention_mask=torch.ones(1, 8, dtype=torch.long),
        negative_prompt_embeds=randn(1, 8, text), negative_prompt_attention_mask=negative_mask, guidance_scale=4.0,
        height=96, width=128,
    )


def _hidream_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # T5 and per-layer Llama-3 hidden states ([layers, batch, tokens, width]) and a pooled CLIP embedding; a square
    # latent (a non-square one is padded to a square and masked: run unmerged, tests/torch/test_zoo.py)
    t5, llama = config["caption_channels"]
    layers = max(config["llama_layers"]) + 1
    text = lambda: dict(t5=randn(1, 8, t5), llama3=randn(layers, 1, 6, llama), pooled=randn(1, config["text_emb_dim"]))  # noqa: E731
    prompt, negative = text(), text()
    return dict(
        prompt_embeds_t5=prompt["t5"], prompt_embeds_llama3=prompt["llama3"], pooled_prompt_embeds=prompt["pooled"],
        negative_prompt_embeds_t5=negative["t5"], negative_prompt_embeds_llama3=negative["llama3"],
        negative_pooled_prompt_embeds=negative["pooled"], guidance_scale=5.0, height=32, width=32,
    )


def _with_image(call: Call, name: str = "image", pil: bool = False) -> Call:
    """``call`` with a conditioning image of its size (first frame, control image): a PIL image or ``[1, 3, H, W]``
    in [0, 1], under ``name``."""

    def build(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
        kwargs = call(config, randn)
        height, width = kwargs["height"], kwargs["width"]
        return dict(kwargs, **{name: _image(randn, height, width) if pil else randn(1, 3, height, width).sigmoid()})
    return build


def _video_cfg(
    width_key: str, masks: Optional[str] = None, tokens: int = 7, frames: int = 5, **extra: Any
) -> Call:
    """:func:`_text_cfg` for a video: ``tokens`` tokens, ``frames`` frames of 64x96 pixels (2 latent frames)."""

    def build(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
        text = config[width_key]
        call = dict(
            prompt_embeds=randn(1, tokens, text), negative_prompt_embeds=randn(1, tokens, text), height=64, width=96,
            num_frames=frames, **extra,
        )
        if masks:
            call.update({masks: torch.ones(1, tokens, dtype=torch.long), f"negative_{masks}": _padded_mask(tokens, 5)})
        return call
    return build


def _kandinsky5_call(config: Dict[str, Any], randn: Randn, frames: int = 5) -> Dict[str, Any]:
    # Qwen2.5-VL hidden states of a prompt (cumulative lengths over the batch) and CLIP's pooled embedding
    call: Dict[str, Any] = dict(height=64, width=96, num_frames=frames, guidance_scale=5.0)
    for prefix, tokens in (("", 7), ("negative_", 5)):
        call.update({
            f"{prefix}prompt_embeds_qwen": randn(1, tokens, config["in_text_dim"]),
            f"{prefix}prompt_embeds_clip": randn(1, config["in_text_dim2"]),
            f"{prefix}prompt_cu_seqlens": torch.tensor([0, tokens], dtype=torch.int32),
        })
    return call


def _kandinsky6_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # Qwen2.5-VL hidden states and CLIP's pooled embedding of a prompt and a shorter negative one
    call: Dict[str, Any] = dict(height=64, width=96, num_frames=5, guidance_scale=5.0)
    for prefix, tokens in (("", 7), ("negative_", 5)):
        call.update({
            f"{prefix}prompt_embeds": randn(1, tokens, config["in_text_dim"]),
            f"{prefix}pooled_prompt_embeds": randn(1, config["in_text_dim2"]),
        })
    return call


def _latte_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    text = config["caption_channels"]
    return dict(
        prompt_embeds=randn(1, 7, text), negative_prompt_embeds=randn(1, 7, text), guidance_scale=5.0, height=32, width=32,
        video_length=config["video_length"], clean_caption=False, mask_feature=False, negative_prompt=None,
    )


def _hunyuandit_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # BERT and mT5 hidden states, each of exactly its text length (the model learns padding for those lengths); its
    # pipeline places rotary positions for an 8x VAE
    call: Dict[str, Any] = dict(guidance_scale=5.0, height=128, width=128, use_resolution_binning=False)
    for prefix in ("", "negative_"):
        call.update({
            f"{prefix}prompt_embeds": randn(1, config["text_len"], config["cross_attention_dim"]),
            f"{prefix}prompt_attention_mask": torch.ones(1, config["text_len"], dtype=torch.long),
            f"{prefix}prompt_embeds_2": randn(1, config["text_len_t5"], config["cross_attention_dim_t5"]),
            f"{prefix}prompt_attention_mask_2": torch.ones(1, config["text_len_t5"], dtype=torch.long),
        })
    return call


def _hunyuan_image_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # Qwen2.5-VL and ByT5 hidden states with their masks (the negative prompt's padded)
    call: Dict[str, Any] = dict(height=64, width=96)
    for prefix, mask in (("", torch.ones(1, 7, dtype=torch.long)), ("negative_", _padded_mask())):
        call.update({
            f"{prefix}prompt_embeds": randn(1, 7, config["text_embed_dim"]), f"{prefix}prompt_embeds_mask": mask,
            f"{prefix}prompt_embeds_2": randn(1, 4, config["text_embed_2_dim"]),
            f"{prefix}prompt_embeds_mask_2": torch.ones(1, 4, dtype=torch.long),
        })
    return call


def _prx_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    text = config["context_in_dim"]
    return dict(
        prompt_embeds=randn(1, 7, text), negative_prompt_embeds=randn(1, 7, text),
        prompt_attention_mask=torch.ones(1, 7, dtype=torch.bool), negative_prompt_attention_mask=_padded_mask(dtype=torch.bool),
        guidance_scale=4.0, height=32, width=32, use_resolution_binning=False,
    )


def _glm_image_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # the prior tokens its vision-language model would generate (one per output token), given: it then runs without it
    tokens = (32 // 2 // config["patch_size"]) ** 2
    prior = (randn(1, tokens).abs() * 1000).long() % config["prior_vq_quantizer_codebook_size"]
    text = config["text_embed_dim"]
    return dict(
        prompt_embeds=randn(1, 7, text), negative_prompt_embeds=randn(1, 7, text), prior_token_ids=prior,
        guidance_scale=1.5, height=32, width=32,
    )


def _dit_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # class-conditional; the latent is the model's sample size (its positions are fixed)
    return dict(class_labels=[3], guidance_scale=4.0)


def _wan_i2v_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # the first frame: its latent and mask concatenated to the latents' channels (Wan 2.2's image to video; Wan
    # 2.1's also takes CLIP image embeddings, which its pipeline only computes itself: it refuses image_embeds with
    # the image it still needs)
    return dict(_video_cfg("text_dim", guidance_scale=5.0)(config, randn), image=_image(randn, 64, 96))


def _wan_vace_call(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
    # a control video and its mask (the masked half regenerated)
    import PIL.Image

    call = _video_cfg("text_dim", guidance_scale=5.0)(config, randn)
    frames = [_image(randn, 64, 96) for _ in range(call["num_frames"])]
    mask = np.zeros((64, 96), dtype=np.uint8)
    mask[:, 48:] = 255
    return dict(call, video=frames, mask=[PIL.Image.fromarray(mask, mode="L")] * call["num_frames"])


def _img2img(call: Call) -> Call:
    """``call`` with an input image of its size in [0, 1] and a strength (of 2 steps, 1 runs)."""

    def build(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
        kwargs = call(config, randn)
        return dict(kwargs, image=randn(1, 3, kwargs["height"], kwargs["width"]).sigmoid(), strength=0.75)
    return build


def _inpaint(call: Call) -> Call:
    """``call`` with an image of its size in [0, 1], a mask over its right half and a strength (of 2 steps, 1 runs)."""

    def build(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
        kwargs = _img2img(call)(config, randn)
        mask = torch.zeros(1, 1, kwargs["height"], kwargs["width"])
        mask[..., kwargs["width"] // 2 :] = 1
        return dict(kwargs, mask_image=mask)
    return build


def _frames(call: Call, name: str) -> Call:
    """``call`` with a video of its size and length (PIL frames) under ``name``, which sets the length."""

    def build(config: Dict[str, Any], randn: Randn) -> Dict[str, Any]:
        kwargs = call(config, randn)
        frames = kwargs.pop("num_frames")
        return dict(kwargs, **{name: [_image(randn, kwargs["height"], kwargs["width"]) for _ in range(frames)]})
    return build


# ---------------------------------------------------------------------------------------------------------
# Extra components


def _qwen_controlnet(config: Dict[str, Any], seed: int) -> Dict[str, Any]:
    """QwenImageControlNetModel shaped like the transformer (one block), zero-initialised outputs given values."""
    config = {k: v for k, v in config.items() if k != "guidance_embeds"}
    return {"controlnet": random_transformer("QwenImageControlNetModel", {**config, "num_layers": 1}, seed)}


def _z_image_controlnet(config: Dict[str, Any], seed: int) -> Dict[str, Any]:
    """ZImageControlNetModel shaped like the transformer, a control block at its layer 0 taking the VAE's latents,
    zero-initialised outputs given values; the pipeline gives it the transformer's embedders and refiners
    (``from_transformer``)."""
    shared = ("all_patch_size", "all_f_patch_size", "dim", "n_refiner_layers", "n_heads", "n_kv_heads", "qk_norm")
    own = dict(control_layers_places=[0], control_in_dim=config["in_channels"])
    return {"controlnet": random_transformer("ZImageControlNetModel", {**{k: config[k] for k in shared}, **own}, seed)}


def _hunyuandit_controlnet(config: Dict[str, Any], seed: int) -> Dict[str, Any]:
    """HunyuanDiT2DControlNetModel shaped like the transformer, zero-initialised outputs given values."""
    config = {k: v for k, v in config.items() if k != "num_layers"}
    return {"controlnet": random_transformer("HunyuanDiT2DControlNetModel", {**config, "transformer_num_layers": 4}, seed)}


@dataclass(frozen=True)
class ZooPipeline:
    """How to build one tiny pipeline: diffusers' ``pipeline`` class name, the ``transformer`` preset (of
    ``TRANSFORMERS`` or ``VIDEO_TRANSFORMERS``), its ``vae`` from the transformer's config, the ``call``'s keyword
    arguments (text embeddings, sizes, images) from the transformer's config and a seeded ``randn``, ``extra``
    components from the transformer preset's config and a seed, fixed constructor ``options`` and the
    ``scheduler`` (a flow-matching Euler one unless the pipeline takes another), pipeline ``attributes`` set
    after construction, and ``overrides`` of the transformer preset's config (a conditioned variant's input
    channels)."""

    pipeline: str
    transformer: str
    vae: Callable[[Dict[str, Any]], torch.nn.Module]
    call: Call
    extra: Optional[Callable[[Dict[str, Any], int], Dict[str, Any]]] = None
    options: Dict[str, Any] = field(default_factory=dict)
    scheduler: Callable[[], Any] = diffusers.FlowMatchEulerDiscreteScheduler
    attributes: Dict[str, Any] = field(default_factory=dict)
    overrides: Dict[str, Any] = field(default_factory=dict)


ZOO_PIPELINES: Dict[str, ZooPipeline] = {
    # FLUX.1's variants (its text-to-image, Kontext and ControlNet pipelines: tome_tools.diffusers_models)
    "flux-img2img": ZooPipeline("FluxImg2ImgPipeline", "tiny-flux", _kl_vae(4), _img2img(_flux_call)),
    "flux-inpaint": ZooPipeline("FluxInpaintPipeline", "tiny-flux", _kl_vae(4), _inpaint(_flux_call)),
    "flux-fill": ZooPipeline(  # the masked image's latents and the 2x2-packed mask concatenated to the latents
        "FluxFillPipeline", "tiny-flux", _kl_vae(4, key="out_channels"), _inpaint(_flux_call),
        overrides=dict(in_channels=16 + 16 + 16, out_channels=16),
    ),
    "flux-control": ZooPipeline(  # FLUX.1 Canny/Depth: the control image's latents concatenated to the latents
        "FluxControlPipeline", "tiny-flux", _kl_vae(4, key="out_channels"), _with_image(_flux_call, "control_image"),
        overrides=dict(in_channels=2 * 16, out_channels=16),
    ),
    "flux-kontext-inpaint": ZooPipeline(  # Kontext resizes to max_area unless told not to
        "FluxKontextInpaintPipeline", "tiny-flux", _kl_vae(4),
        lambda config, randn: dict(_inpaint(_flux_call)(config, randn), _auto_resize=False, max_area=32 * 32),
    ),
    "flux2": ZooPipeline("Flux2Pipeline", "tiny-flux2", _flux2_vae, _flux2_call),
    "bria-fibo2": ZooPipeline(
        "BriaFibo2Pipeline", "tiny-bria-fibo2", lambda config: _flux2_vae(config, packing=1), _bria_fibo2_call
    ),
    "bria-fibo2-edit": ZooPipeline(  # the image to edit: its tokens after the output's (Bria-FIBO 2's context latents)
        "BriaFibo2Pipeline", "tiny-bria-fibo2", lambda config: _flux2_vae(config, packing=1),
        lambda config, randn: dict(_bria_fibo2_call(config, randn), image=[_image(randn, 32, 32)]),
    ),
    "ernie-image": ZooPipeline("ErnieImagePipeline", "tiny-ernie-image", _flux2_vae, _ernie_image_call),
    "flux2-edit": ZooPipeline("Flux2Pipeline", "tiny-flux2", _flux2_vae, _flux2_edit_call),
    "flux2-klein": ZooPipeline("Flux2KleinPipeline", "tiny-flux2-klein", _flux2_vae, _flux2_klein_call),
    "flux2-klein-edit": ZooPipeline("Flux2KleinPipeline", "tiny-flux2-klein", _flux2_vae, _flux2_klein_edit_call),
    "flux2-klein-kv": ZooPipeline("Flux2KleinKVPipeline", "tiny-flux2-klein", _flux2_vae, _flux2_klein_kv_call),
    "qwen-image": ZooPipeline("QwenImagePipeline", "tiny-qwen-image", _qwen_vae(2), _qwen_call),
    "qwen-image-edit": ZooPipeline("QwenImageEditPipeline", "tiny-qwen-image", _qwen_vae(4), _qwen_edit_call),
    "qwen-image-controlnet": ZooPipeline(
        "QwenImageControlNetPipeline", "tiny-qwen-image", _qwen_vae(2), _qwen_controlnet_call, _qwen_controlnet
    ),
    "z-image": ZooPipeline("ZImagePipeline", "tiny-z-image", _kl_vae(), _z_image_call),
    "z-image-controlnet": ZooPipeline(
        "ZImageControlNetPipeline", "tiny-z-image", _kl_vae(), _with_image(_z_image_call, "control_image"), _z_image_controlnet
    ),
    "z-image-img2img": ZooPipeline("ZImageImg2ImgPipeline", "tiny-z-image", _kl_vae(), _img2img(_z_image_call)),
    "chroma": ZooPipeline("ChromaPipeline", "tiny-chroma", _kl_vae(4), _chroma_call),
    "chroma-img2img": ZooPipeline("ChromaImg2ImgPipeline", "tiny-chroma", _kl_vae(4), _img2img(_chroma_call)),
    "hunyuan-video": ZooPipeline("HunyuanVideoPipeline", "tiny-hunyuan-video", _hunyuan_video_vae, _hunyuan_video_call),
    "ltx": ZooPipeline("LTXPipeline", "tiny-ltx", _ltx_vae, _ltx_call),
    "cogvideox": ZooPipeline(
        "CogVideoXPipeline", "tiny-cogvideox", _cogvideox_vae, _cogvideox_call, scheduler=diffusers.CogVideoXDDIMScheduler
    ),
    "cogview4": ZooPipeline(
        "CogView4Pipeline", "tiny-cogview4", _kl_vae(), _cogview4_call,
        scheduler=lambda: diffusers.FlowMatchEulerDiscreteScheduler(
            base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
        ),
    ),
    "lumina2": ZooPipeline("Lumina2Pipeline", "tiny-lumina2", _kl_vae(), _lumina2_call),
    "lumina-next": ZooPipeline("LuminaPipeline", "tiny-lumina-next", _kl_vae(), _lumina_next_call),
    # HiDream rescales every request to an area of default_sample_size squared latent pixels (128: 4096 tokens)
    "hidream-image": ZooPipeline(
        "HiDreamImagePipeline", "tiny-hidream-image", _kl_vae(), _hidream_call, attributes={"default_sample_size": 16}
    ),
    "hunyuan-video-15": ZooPipeline(
        "HunyuanVideo15Pipeline", "tiny-hunyuan-video-15", _hunyuan_video_15_vae, _hunyuan_video_15_call,
        extra=lambda config, seed: {"guider": diffusers.ClassifierFreeGuidance(guidance_scale=4.0)},
        overrides=dict(in_channels=2 * 4 + 1),  # the latents, a condition's latents and its mask
    ),
    "ovis-image": ZooPipeline(
        "OvisImagePipeline", "tiny-ovis", _kl_vae(4), _text_cfg("joint_attention_dim", guidance_scale=5.0, negative_prompt=None)
    ),
    "bria": ZooPipeline("BriaPipeline", "tiny-bria", _kl_vae(4), _text_cfg("joint_attention_dim", guidance_scale=5.0)),
    "auraflow": ZooPipeline(
        "AuraFlowPipeline", "tiny-auraflow", _kl_vae(), _text_cfg("joint_attention_dim", "prompt_attention_mask", guidance_scale=3.5)
    ),
    "cogview3plus": ZooPipeline(
        "CogView3PlusPipeline", "tiny-cogview3plus", _kl_vae(), _text_cfg("text_embed_dim", guidance_scale=5.0),
        scheduler=diffusers.CogVideoXDDIMScheduler,
    ),
    "nucleusmoe-image": ZooPipeline(
        "NucleusMoEImagePipeline", "tiny-nucleusmoe-image", _qwen_vae(2),
        _text_cfg("joint_attention_dim", "prompt_embeds_mask", guidance_scale=4.0),
    ),
    "mochi": ZooPipeline(  # 7 frames: 2 latent frames (6x in time)
        "MochiPipeline", "tiny-mochi", _mochi_vae, _video_cfg("text_embed_dim", "prompt_attention_mask", 16, 7, guidance_scale=4.5)
    ),
    "skyreels-v2": ZooPipeline(
        "SkyReelsV2Pipeline", "tiny-skyreels-v2", _wan_vae, _video_cfg("text_dim", guidance_scale=6.0),
        scheduler=lambda: diffusers.UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction"),
    ),
    "allegro": ZooPipeline(
        "AllegroPipeline", "tiny-allegro", _allegro_vae,
        _video_cfg("caption_channels", "prompt_attention_mask", guidance_scale=7.5, negative_prompt=None),
        scheduler=diffusers.DDIMScheduler,
    ),
    "easyanimate": ZooPipeline(
        "EasyAnimatePipeline", "tiny-easyanimate", _magvit_vae, _video_cfg("text_embed_dim", "prompt_attention_mask", guidance_scale=5.0)
    ),
    "kandinsky5": ZooPipeline(
        "Kandinsky5T2VPipeline", "tiny-kandinsky5", _kandinsky5_vae, _kandinsky5_call,
        scheduler=lambda: diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
    ),
    "kandinsky6": ZooPipeline(  # video and audio
        "Kandinsky6TI2VAPipeline", "tiny-kandinsky6", _kandinsky5_vae, _kandinsky6_call, extra=_kandinsky6_audio,
    ),
    "kandinsky6-image2video": ZooPipeline(  # its reference frame appended after the noisy ones
        "Kandinsky6TI2VAPipeline", "tiny-kandinsky6", _kandinsky5_vae, _with_image(_kandinsky6_call, pil=True),
        extra=_kandinsky6_audio,
    ),
    "latte": ZooPipeline("LattePipeline", "tiny-latte", _kl_vae(), _latte_call, scheduler=diffusers.DDIMScheduler),
    "hunyuandit": ZooPipeline(
        "HunyuanDiTPipeline", "tiny-hunyuandit", _kl_vae(base=SMALL_VAE), _hunyuandit_call, scheduler=diffusers.DDPMScheduler,
        options=dict(requires_safety_checker=False),
    ),
    "hunyuandit-controlnet": ZooPipeline(
        "HunyuanDiTControlNetPipeline", "tiny-hunyuandit", _kl_vae(base=SMALL_VAE), _with_image(_hunyuandit_call, "control_image"),
        extra=_hunyuandit_controlnet, scheduler=diffusers.DDPMScheduler, options=dict(requires_safety_checker=False),
    ),
    "hunyuan-image": ZooPipeline(
        "HunyuanImagePipeline", "tiny-hunyuan-image", _hunyuan_image_vae, _hunyuan_image_call,
        extra=lambda config, seed: {"guider": diffusers.AdaptiveProjectedMixGuidance()},  # its CFG (none without)
    ),
    "prx": ZooPipeline("PRXPipeline", "tiny-prx", _kl_vae(), _prx_call),
    "glm-image": ZooPipeline("GlmImagePipeline", "tiny-glm-image", _kl_vae(), _glm_image_call),
    "dit": ZooPipeline("DiTPipeline", "tiny-dit", _kl_vae(), _dit_call, scheduler=diffusers.DDIMScheduler),
    "wan-image2video": ZooPipeline(
        "WanImageToVideoPipeline", "tiny-wan", _wan_vae, _wan_i2v_call, overrides=dict(in_channels=3 * 4)
    ),
    "wan-vace": ZooPipeline("WanVACEPipeline", "tiny-wan-vace", _wan_vae, _wan_vace_call),
    "skyreels-v2-diffusion-forcing": ZooPipeline(
        "SkyReelsV2DiffusionForcingPipeline", "tiny-skyreels-v2", _wan_vae, _video_cfg("text_dim", guidance_scale=6.0, prompt=None),
        scheduler=lambda: diffusers.UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction"),
    ),
    # conditioned variants: the control image's latents concatenated to the latents' channels (CogView4 Control,
    # HunyuanVideo and CogVideoX image to video) or the first frame's tokens in place (HunyuanVideo token_replace, LTX)
    "cogview4-control": ZooPipeline(
        "CogView4ControlPipeline", "tiny-cogview4", _kl_vae(2), _with_image(_cogview4_call, "control_image"),
        scheduler=lambda: diffusers.FlowMatchEulerDiscreteScheduler(
            base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
        ),
        overrides=dict(in_channels=8),
    ),
    "qwen-image-inpaint": ZooPipeline("QwenImageInpaintPipeline", "tiny-qwen-image", _qwen_vae(2), _inpaint(_qwen_call)),
    "z-image-inpaint": ZooPipeline("ZImageInpaintPipeline", "tiny-z-image", _kl_vae(), _inpaint(_z_image_call)),
    "flux2-klein-inpaint": ZooPipeline("Flux2KleinInpaintPipeline", "tiny-flux2-klein", _flux2_vae, _inpaint(_flux2_klein_call)),
    "ltx-condition": ZooPipeline("LTXConditionPipeline", "tiny-ltx", _ltx_vae, _with_image(_ltx_call)),
    "cogvideox-video2video": ZooPipeline(
        "CogVideoXVideoToVideoPipeline", "tiny-cogvideox", _cogvideox_vae, _frames(_cogvideox_call, "video"),
        scheduler=diffusers.CogVideoXDDIMScheduler,
    ),
    "cogvideox-fun-control": ZooPipeline(
        "CogVideoXFunControlPipeline", "tiny-cogvideox", _cogvideox_vae, _frames(_cogvideox_call, "control_video"),
        scheduler=diffusers.CogVideoXDDIMScheduler, overrides=dict(in_channels=8),
    ),
    "kandinsky5-image2video": ZooPipeline(
        # 21 frames (6 latent frames): its image to video renormalises the first 4 latent frames by the later ones
        "Kandinsky5I2VPipeline", "tiny-kandinsky5", _kandinsky5_vae,
        _with_image(lambda config, randn: _kandinsky5_call(config, randn, frames=21), pil=True),
        scheduler=lambda: diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
        overrides=dict(visual_cond=True),  # the latents, the first frame's and its mask, concatenated
    ),
    "hunyuan-video-image2video": ZooPipeline(
        "HunyuanVideoImageToVideoPipeline", "tiny-hunyuan-video", _hunyuan_video_vae, _with_image(_hunyuan_video_call, pil=True),
        overrides=dict(in_channels=2 * 4 + 1, guidance_embeds=False, image_condition_type="latent_concat"),
    ),
    "hunyuan-video-image2video-token-replace": ZooPipeline(
        "HunyuanVideoImageToVideoPipeline", "tiny-hunyuan-video", _hunyuan_video_vae, _with_image(_hunyuan_video_call, pil=True),
        overrides=dict(image_condition_type="token_replace"),
    ),
    "ltx-image2video": ZooPipeline("LTXImageToVideoPipeline", "tiny-ltx", _ltx_vae, _with_image(_ltx_call)),
    "cogvideox-image2video": ZooPipeline(
        "CogVideoXImageToVideoPipeline", "tiny-cogvideox", _cogvideox_vae, _with_image(_cogvideox_call, pil=True),
        scheduler=diffusers.CogVideoXDDIMScheduler,
        overrides=dict(
            in_channels=8, attention_head_dim=16, use_rotary_positional_embeddings=True, use_learned_positional_embeddings=True,
            sample_height=8, sample_width=12, sample_frames=5,  # learned positions: the call's latent size only
        ),
    ),
}


# Pipelines of merged model classes that no recipe builds, and why (diffusers 0.42.1).
NOT_BUILT: Dict[str, str] = {
    "LongCatImagePipeline": "cannot run on embeddings: encode_prompt takes len(prompt) even when prompt_embeds are "
    "given, and a prompt given with prompt_embeds is refused",
    "LongCatImageEditPipeline": "its constructor reads text_processor.image_processor: it needs a Qwen2-VL processor "
    "(tokenizer files) even when prompt_embeds are given",
    "ChronoEditPipeline": "computes CLIP image embeddings from the image with its image encoder and refuses "
    "image_embeds given together with the image it still needs",
    "WanImageToVideoPipeline (Wan 2.1, image_dim set)": "the same: it refuses image_embeds with the image; Wan 2.2's "
    "image to video (no image embeddings) is built",
    "HunyuanVideo15ImageToVideoPipeline": "encodes the image with its SigLIP image encoder (no image embeddings "
    "argument)",
    "JoyImageEditPlusPipeline": "cannot run on embeddings: it formats one chat prompt per item of prompt even when "
    "prompt_embeds are given (prompt None is not iterable), and a prompt given with prompt_embeds is refused",
    "QwenImage21Pipeline": "its constructor tokenizes its system prompt with its Qwen3-VL processor "
    "(processor.apply_chat_template): it needs the processor's tokenizer files even when prompt_embeds are given; its "
    "model's prefill and key-cached steps are checked in test_zoo",
    "Ideogram4Pipeline": "cannot run on embeddings: it takes no prompt_embeds and formats each prompt with its "
    "tokenizer's chat template, then reads its Qwen3-VL-style text encoder's inner layers (tokenizer files and that "
    "encoder are needed); its two transformers' calls (the conditional one on its packed rows [left padding; text; "
    "image], the unconditional one on the image alone) are checked in test_zoo",
    "ChromaInpaintPipeline": "fails unpatched: it reads transformer.config.guidance_embeds, which Chroma's "
    "transformer has not",
    "Cosmos2TextToImagePipeline / CosmosTextToWorldPipeline": "they need the cosmos_guardrail package (not installed "
    "here: its safety checker is built in the constructor)",
}


def build_zoo_pipeline(kind: str, seed: int = 0) -> Tuple[Any, Dict[str, Any]]:
    """The tiny pipeline of ``kind`` (:data:`ZOO_PIPELINES`) and the keyword arguments of its call (text
    embeddings in place of its text encoders, sizes, images); give steps, a generator and an output type. Every
    constructor argument the recipe does not fill (text encoders, tokenizers, processors) is None."""
    if kind not in ZOO_PIPELINES:
        raise ValueError(f"kind must be one of {', '.join(ZOO_PIPELINES)}, got {kind!r}")
    recipe = ZOO_PIPELINES[kind]
    name, config = (TRANSFORMERS.get(recipe.transformer) or VIDEO_TRANSFORMERS[recipe.transformer])
    config = {**config, **recipe.overrides}
    transformer = random_transformer(name, config, seed)
    torch.manual_seed(seed + 1)
    parts: Dict[str, Any] = dict(
        transformer=transformer, vae=recipe.vae(dict(transformer.config)).eval(),
        scheduler=recipe.scheduler(), **recipe.options,
    )
    if recipe.extra is not None:
        parts.update(recipe.extra(config, seed + 2))
    cls = getattr(diffusers, recipe.pipeline)
    for parameter in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if parameter.name not in parts and parameter.default is inspect.Parameter.empty:
            parts[parameter.name] = None  # text encoders, tokenizers, processors
    generator = torch.Generator().manual_seed(seed + 3)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    pipe = cls(**parts)
    for name, value in recipe.attributes.items():
        setattr(pipe, name, value)
    return pipe, recipe.call(dict(transformer.config), randn)


__all__ = ["NOT_BUILT", "ZOO_PIPELINES", "ZooPipeline", "build_zoo_pipeline"]
