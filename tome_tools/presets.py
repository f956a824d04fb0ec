"""Model architectures with random weights, for examples, benchmarks and tests: nothing is downloaded.

Configs are plain dicts in diffusers' format, which ppdiffusers and diffusers' Flax models read too.
Framework-free: each adapter's ``models`` module builds these with its own classes.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, Optional, Tuple

# UNet architectures. "sd15"/"sd21"/"sdxl" match the released models' shapes; "sd15-small" halves the
# width of sd15 for quick runs; "tiny" and "tiny-xl" are the test-sized models (channels multiples of 32,
# as Flax's GroupNorm needs).
UNETS: Dict[str, Dict[str, Any]] = {
    "sd15": dict(
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        layers_per_block=2,
        cross_attention_dim=768,
        attention_head_dim=8,
        sample_size=64,
    ),
    "sd15-small": dict(
        block_out_channels=(160, 320, 640, 640),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        layers_per_block=1,
        cross_attention_dim=768,
        attention_head_dim=8,
        sample_size=64,
    ),
    "sd21": dict(
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        layers_per_block=2,
        cross_attention_dim=1024,
        attention_head_dim=(5, 10, 20, 20),
        use_linear_projection=True,
        sample_size=96,
    ),
    "sdxl": dict(
        block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        layers_per_block=2,
        transformer_layers_per_block=(1, 2, 10),
        cross_attention_dim=2048,
        attention_head_dim=(5, 10, 20),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
        sample_size=128,
    ),
    "tiny": dict(
        block_out_channels=(32, 64, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        layers_per_block=1,
        cross_attention_dim=32,
        attention_head_dim=8,
        sample_size=16,
    ),
    "tiny-xl": dict(
        block_out_channels=(32, 64, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        layers_per_block=1,
        transformer_layers_per_block=(1, 2, 2),
        cross_attention_dim=64,
        attention_head_dim=8,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=80,  # 6 time ids * 8 + pooled text embedding 32
        sample_size=16,
    ),
}

# Diffusion transformer architectures: (diffusers class name, config). "sd3" is SD3 medium's shape, "pixart"
# PixArt-alpha 1024's; "sd3-small" and "flux-small" keep the real width and block structure with fewer blocks
# (a full Flux does not fit in 24 GiB in float32); "tiny-*" are the test-sized models.
TRANSFORMERS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "sd3": (
        "SD3Transformer2DModel",
        dict(
            sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192,
        ),
    ),
    "flux-small": (
        "FluxTransformer2DModel",
        dict(
            patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ),
    ),
    "pixart": (
        "PixArtTransformer2DModel",
        dict(
            sample_size=128, num_layers=28, patch_size=2, attention_head_dim=72, num_attention_heads=16,
            caption_channels=4096, in_channels=4, cross_attention_dim=1152, out_channels=8, attention_bias=True,
            activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
            norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=2, use_additional_conditions=False,
        ),
    ),
    "tiny-sd3": (
        "SD3Transformer2DModel",
        dict(
            sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
            caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
        ),
    ),
    "tiny-flux": (
        "FluxTransformer2DModel",
        dict(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
        ),
    ),
}


TRANSFORMERS["tiny-pixart"] = (
    "PixArtTransformer2DModel",
    {
        **TRANSFORMERS["pixart"][1], "sample_size": 32, "num_layers": 2, "attention_head_dim": 8,
        "num_attention_heads": 4, "caption_channels": 32, "cross_attention_dim": 32, "interpolation_scale": None,
        "use_additional_conditions": None,
    },
)
TRANSFORMERS["sd3-small"] = ("SD3Transformer2DModel", {**TRANSFORMERS["sd3"][1], "num_layers": 6})
# SD3.5's MM-DiT-X: a second, image-only self-attention in the first blocks and RMS-normalised q/k.
TRANSFORMERS["tiny-sd35"] = (
    "SD3Transformer2DModel", {**TRANSFORMERS["tiny-sd3"][1], "dual_attention_layers": (0,), "qk_norm": "rms_norm"}
)
# The newer image transformers, tiny (diffusers' own model-test sizes): packed tokens, Flux-style ids or
# Qwen-Image's img_shapes (tome_tools.diffusers_models.transformer_inputs builds their calls).
_TINY_FLUX_LIKE = dict(
    patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32,
)
TRANSFORMERS.update({
    "tiny-flux2": (
        "Flux2Transformer2DModel",
        {**_TINY_FLUX_LIKE, "timestep_guidance_channels": 256, "axes_dims_rope": (4, 4, 4, 4)},
    ),
    # Flux.2 Klein: no guidance embedding (classifier-free guidance with a negative prompt instead)
    "tiny-flux2-klein": (
        "Flux2Transformer2DModel",
        {**_TINY_FLUX_LIKE, "timestep_guidance_channels": 256, "axes_dims_rope": (4, 4, 4, 4), "guidance_embeds": False},
    ),
    "tiny-chroma": (
        "ChromaTransformer2DModel",
        {
            **_TINY_FLUX_LIKE, "axes_dims_rope": (4, 4, 8), "approximator_num_channels": 8,
            "approximator_hidden_dim": 16, "approximator_layers": 1,
        },
    ),
    "tiny-longcat": (
        "LongCatImageTransformer2DModel", {**_TINY_FLUX_LIKE, "pooled_projection_dim": 32, "axes_dims_rope": (4, 4, 8)}
    ),
    "tiny-ovis": ("OvisImageTransformer2DModel", {**_TINY_FLUX_LIKE, "out_channels": 4, "axes_dims_rope": (4, 4, 8)}),
    "tiny-bria": (
        "BriaTransformer2DModel",
        {**_TINY_FLUX_LIKE, "attention_head_dim": 8, "pooled_projection_dim": None, "axes_dims_rope": (0, 4, 4)},
    ),
    "tiny-bria-fibo": (
        "BriaFiboTransformer2DModel",
        {
            **_TINY_FLUX_LIKE, "in_channels": 48, "attention_head_dim": 8, "joint_attention_dim": 64,
            "text_encoder_dim": 32, "pooled_projection_dim": None, "axes_dims_rope": (0, 4, 4),
        },
    ),
    # Bria-FIBO 2: 4 to 8 gist tokens from 2 to 8 text tokens (a batch of both pads the gist), one injection block
    "tiny-bria-fibo2": (
        "BriaFibo2Transformer2DModel",
        dict(
            in_channels=8, patch_size=2, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, cap_feat_dim=16,
            injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=4, max_num_gist_tokens=8, gist_step=4,
            gist_min_text_len=2, gist_max_text_len=8, axes_dims=(4, 6, 6), axes_lens=(16, 16, 16),
        ),
    ),
    # Qwen-Image 2.1: one stream [text with condition images; target], unpatched latents (patch 1)
    "tiny-qwen-image-21": (
        "QwenImage21Transformer2DModel",
        dict(
            patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            context_in_dim=16, mlp_ratio=2, axes_dims_rope=(4, 6, 6),
        ),
    ),
    "tiny-qwen-image": (
        "QwenImageTransformer2DModel",
        dict(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
            joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
        ),
    ),
    # tiny CogView4, Lumina 2 and HiDream-I1 (diffusers' model-test sizes): their pipelines' transformers
    "tiny-cogview4": (
        "CogView4Transformer2DModel",
        dict(
            patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=4, out_channels=4,
            text_embed_dim=8, time_embed_dim=8, condition_dim=4,
        ),
    ),
    "tiny-lumina2": (
        "Lumina2Transformer2DModel",
        dict(
            sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2, num_refiner_layers=1,
            num_attention_heads=3, num_kv_heads=1, multiple_of=2, ffn_dim_multiplier=None, norm_eps=1e-5,
            scaling_factor=1.0, axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=32,
        ),
    ),
    "tiny-lumina-next": (  # diffusers' model-test size; learn_sigma: its pipeline keeps half the output channels
        "LuminaNextDiT2DModel",
        dict(
            sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2, num_attention_heads=3,
            num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None, norm_eps=1e-5, learn_sigma=True, qk_norm=True,
            cross_attention_dim=32, scaling_factor=1.0,
        ),
    ),
    "tiny-hidream-image": (
        "HiDreamImageTransformer2DModel",
        dict(
            patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=4, caption_channels=(8, 4), text_emb_dim=8, num_routed_experts=2,
            num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32), llama_layers=(0, 1),
            force_inference_output=True,
        ),
    ),
    "tiny-auraflow": (
        "AuraFlowTransformer2DModel",
        dict(
            sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
            attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
            out_channels=4, pos_embed_max_size=256,
        ),
    ),
    "tiny-cogview3plus": (
        "CogView3PlusTransformer2DModel",
        dict(
            patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=2, out_channels=4,
            text_embed_dim=8, time_embed_dim=8, condition_dim=2, pos_embed_max_size=16, sample_size=8,
        ),
    ),
    "tiny-nucleusmoe-image": (
        "NucleusMoEImageTransformer2DModel",
        dict(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
            joint_attention_dim=16, axes_dims_rope=(8, 4, 4), moe_enabled=True, capacity_factors=[8.0, 8.0],
            dense_moe_strategy="leave_first_block_dense",
        ),
    ),    "tiny-hunyuandit": (
        "HunyuanDiT2DModel",
        dict(
            sample_size=8, patch_size=2, in_channels=4, attention_head_dim=8, num_attention_heads=2,
            cross_attention_dim=8, cross_attention_dim_t5=8, pooled_projection_dim=4, hidden_size=16, text_len=4,
            text_len_t5=4, activation_fn="gelu-approximate", num_layers=4,
        ),
    ),    "tiny-hunyuan-image": (
        "HunyuanImageTransformer2DModel",
        dict(
            in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1), guidance_embeds=False, text_embed_dim=32,
            text_embed_2_dim=32, rope_axes_dim=(4, 4),
        ),
    ),
    "tiny-ernie-image": (  # diffusers' model-test size, two layers
        "ErnieImageTransformer2DModel",
        dict(hidden_size=16, num_attention_heads=1, num_layers=2, ffn_hidden_size=16, in_channels=16, out_channels=16,
             patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=(8, 4, 4), eps=1e-6, qk_layernorm=True),
    ),
    "tiny-prx": (
        "PRXTransformer2DModel",
        dict(in_channels=4, patch_size=2, context_in_dim=16, hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=2, axes_dim=[8, 8]),
    ),    "tiny-glm-image": (
        "GlmImageTransformer2DModel",
        dict(
            patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
            text_embed_dim=32, time_embed_dim=16, condition_dim=8, prior_vq_quantizer_codebook_size=64,
        ),
    ),
})
TRANSFORMERS["tiny-dit"] = (
    "DiTTransformer2DModel",
    dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=16,
        patch_size=2, num_embeds_ada_norm=1000,
    ),
)


# Real width, reduced depth (random weights; no download): the released models' block widths, attention heads,
# text widths and rotary axes (their transformer/config.json, diffusers' defaults) with 1-2 blocks of each kind,
# for the bench (python -m tome_tools.bench --preset NAME [--micro]). Flux.2 dev (48 x 128 = 6144 channels, Mistral
# text 15360); Qwen-Image (24 x 128, Qwen2.5-VL text 3584); Z-Image (Turbo: 30 x 128 = 3840, Qwen3 text 2560; one
# noise and one caption refiner block of the two); HunyuanVideo (24 x 128, LLaVA-Llama text 4096, CLIP pooled
# 768; one text refiner block of the two); LTX-Video (0.9: 32 x 64 = 2048, T5 text 4096).
TRANSFORMERS.update({
    "flux2-small": (
        "Flux2Transformer2DModel",
        dict(
            patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=128,
            num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
            axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=True,
        ),
    ),
    "qwen-image-small": (
        "QwenImageTransformer2DModel",
        dict(
            patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=128, num_attention_heads=24,
            joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
        ),
    ),
    "z-image-small": (
        "ZImageTransformer2DModel",
        dict(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=2, n_refiner_layers=1,
            n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
            t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512],
        ),
    ),
    "hunyuan-video-small": (
        "HunyuanVideoTransformer3DModel",
        dict(
            in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
            qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
            rope_theta=256.0, rope_axes_dim=(16, 56, 56),
        ),
    ),
    "ltx-small": (
        "LTXVideoTransformer3DModel",
        dict(
            in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
            attention_head_dim=64, cross_attention_dim=2048, num_layers=2, caption_channels=4096,
            qk_norm="rms_norm_across_heads",
        ),
    ),
    # test-sized kin of the above
    "tiny-z-image": (
        "ZImageTransformer2DModel",
        dict(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=16, n_layers=1, n_refiner_layers=1,
            n_heads=1, n_kv_heads=2, qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
            axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
        ),
    ),
    "tiny-hunyuan-video-t": (
        "HunyuanVideoTransformer3DModel",
        dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
            text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4),
        ),
    ),
    "tiny-ltx-t": (
        "LTXVideoTransformer3DModel",
        dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
            num_layers=1, qk_norm="rms_norm_across_heads", caption_channels=16,
        ),
    ),
})
# The video transformers among TRANSFORMERS: frames (video frames) and frame size (pixels) of a bench call, and
# their VAE's compression (latent frames = (frames - 1) / time + 1; latent side = pixels / space). HunyuanVideo
# at its released 540p size (544x960; the 720p release, 720x1280 x 129 frames, is 118800 tokens) with 5 frames
# (2 latent frames, 4080 tokens, about a 1024 px image's); LTX-Video at its pipeline's default size and length
# (512x704, 161 frames: 21 latent frames of 16x22 tokens, 7392 tokens). --resolution sets the frame height, the
# width keeping the aspect ratio.
TRANSFORMER_VIDEOS: Dict[str, Dict[str, Any]] = {
    "hunyuan-video-small": dict(frames=5, size=(544, 960), time=4, space=8),
    "ltx-small": dict(frames=161, size=(512, 704), time=8, space=32),
    "tiny-hunyuan-video-t": dict(frames=5, size=(32, 48), time=4, space=8),
    "tiny-ltx-t": dict(frames=9, size=(64, 96), time=8, space=32),
}


def transformer_config(preset: str, **overrides: Any) -> Tuple[str, Dict[str, Any]]:
    """``(class name, config)`` of a transformer preset with ``overrides`` applied."""
    if preset not in TRANSFORMERS:
        raise ValueError(f"preset must be one of {', '.join(TRANSFORMERS)}, got {preset!r}")
    name, config = TRANSFORMERS[preset]
    return name, {**config, **overrides}


# Tiny VAE and CLIP text encoder for test pipelines.
TINY_VAE: Dict[str, Any] = dict(
    block_out_channels=(32, 64),
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    latent_channels=4,
    norm_num_groups=32,
    sample_size=32,
)
# A narrow VAE with the real 8x downsampling, for pipelines at real image sizes.
SMALL_VAE: Dict[str, Any] = dict(
    TINY_VAE,
    block_out_channels=(32, 32, 64, 64),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
)
TINY_TEXT_ENCODER: Dict[str, Any] = dict(
    bos_token_id=0,
    eos_token_id=2,
    hidden_size=32,
    intermediate_size=37,
    layer_norm_eps=1e-05,
    num_attention_heads=4,
    num_hidden_layers=2,
    pad_token_id=1,
    vocab_size=1000,
    max_position_embeddings=77,
    projection_dim=32,
)
TINY_CONTROLNET_CONDITIONING: Dict[str, Any] = dict(conditioning_embedding_out_channels=(16, 32))


# Tiny video UNets (diffusers' class name, config), test-sized: two levels, attention at full resolution only.
# "tiny-animatediff" is a MotionAdapter config; its UNetMotionModel is built from the "tiny-video-sd" UNet2D.
VIDEO_UNETS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "tiny-video-sd": (
        "UNet2DConditionModel",
        dict(
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            layers_per_block=1,
            cross_attention_dim=32,
            attention_head_dim=8,
            sample_size=8,
        ),
    ),
    "tiny-animatediff": (
        "MotionAdapter",
        dict(
            block_out_channels=(32, 64),
            motion_layers_per_block=1,
            motion_num_attention_heads=2,
            motion_norm_num_groups=32,
            motion_max_seq_length=32,
        ),
    ),
    "tiny-svd": (
        "UNetSpatioTemporalConditionModel",
        dict(
            sample_size=8,
            in_channels=8,
            out_channels=4,
            down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
            up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
            block_out_channels=(32, 64),
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=24,  # 3 time ids * 8
            layers_per_block=1,
            cross_attention_dim=32,
            num_attention_heads=(2, 4),
        ),
    ),
    "tiny-text-to-video": (
        "UNet3DConditionModel",
        dict(
            sample_size=8,
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
            up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"),
            layers_per_block=1,
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=32,
        ),
    ),
}


# Video transformers (diffusers' class name, config): one sequence of frames x height x width tokens.
VIDEO_TRANSFORMERS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "tiny-wan": (
        "WanTransformer3DModel",
        dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        ),
    ),
    # The newer video transformers, tiny (diffusers' own model-test sizes); one frame-major token sequence each
    "tiny-hunyuan-video": (
        "HunyuanVideoTransformer3DModel",
        dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
            text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None,
        ),
    ),
    "tiny-hunyuan-video-15": (
        "HunyuanVideo15Transformer3DModel",
        dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
            num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
            text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v",
        ),
    ),
    "tiny-cogvideox": (
        "CogVideoXTransformer3DModel",
        dict(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
            text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8, sample_frames=8, patch_size=2,
            patch_size_t=None, temporal_compression_ratio=4, max_text_seq_length=7,
        ),
    ),
    "tiny-ltx": (
        "LTXVideoTransformer3DModel",
        dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
            num_layers=1, qk_norm="rms_norm_across_heads", caption_channels=16,
        ),
    ),
    # Wan 2.1 T2V 1.3B: Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json (30 blocks of 12 heads x 128).
    "wan-1.3b": (
        "WanTransformer3DModel",
        dict(
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
            text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, eps=1e-6,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
        ),
    ),
}
# More tiny video transformers (diffusers' model-test sizes), for their pipelines
VIDEO_TRANSFORMERS.update({
    "tiny-mochi": (
        "MochiTransformer3DModel",
        dict(
            patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
            in_channels=4, out_channels=None, qk_norm="rms_norm", text_embed_dim=16, time_embed_dim=4,
            activation_fn="swiglu", max_sequence_length=16,
        ),
    ),
    "tiny-skyreels-v2": ("SkyReelsV2Transformer3DModel", dict(VIDEO_TRANSFORMERS["tiny-wan"][1])),
    "tiny-allegro": (
        "AllegroTransformer3DModel",
        dict(
            num_attention_heads=2, attention_head_dim=24, in_channels=4, out_channels=4, num_layers=1,
            cross_attention_dim=48, sample_width=8, sample_height=8, sample_frames=8, caption_channels=8,
        ),
    ),
    "tiny-easyanimate": (
        "EasyAnimateTransformer3DModel",
        dict(
            attention_head_dim=16, num_attention_heads=2, in_channels=4, mmdit_layers=2, num_layers=3, out_channels=4,
            patch_size=2, sample_height=60, sample_width=90, text_embed_dim=16, time_embed_dim=8,
            time_position_encoding_type="3d_rope", timestep_activation_fn="silu",
        ),
    ),
    "tiny-kandinsky5": (
        "Kandinsky5Transformer3DModel",
        dict(
            in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, out_visual_dim=4, patch_size=(1, 2, 2),
            model_dim=16, ff_dim=32, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6),
        ),
    ),
    # Kandinsky 6 as released (cross-modal rotary and gates, a reference frame's token type), video with audio
    "tiny-kandinsky6": (
        "Kandinsky6Transformer3DModel",
        dict(
            in_visual_dim=4, out_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, patch_size=(1, 2, 2),
            model_dim=16, ff_dim=32, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6), in_audio_dim=4,
            out_audio_dim=4, text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True,
            visual_token_type_num_embeddings=2,
        ),
    ),    # Wan VACE: control blocks on [inactive; reactive] latents and an 8x8-packed mask (2 * 4 + 64 channels)
    "tiny-wan-vace": (
        "WanVACETransformer3DModel", {**VIDEO_TRANSFORMERS["tiny-wan"][1], "vace_layers": [0, 1], "vace_in_channels": 72}
    ),
    "tiny-latte": (
        "LatteTransformer3DModel",
        dict(
            sample_size=8, num_layers=1, patch_size=2, attention_head_dim=4, num_attention_heads=2, caption_channels=8,
            in_channels=4, cross_attention_dim=8, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
            video_length=2,
        ),
    ),
})


def video_unet_config(preset: str, **overrides: Any) -> Tuple[str, Dict[str, Any]]:
    """A video preset's class name and a copy of its config with ``overrides`` applied."""
    if preset not in VIDEO_UNETS:
        raise ValueError(f"preset must be one of {', '.join(VIDEO_UNETS)}, got {preset!r}")
    name, config = VIDEO_UNETS[preset]
    return name, {**config, **overrides}


def unet_config(preset: str, **overrides: Any) -> Dict[str, Any]:
    """A copy of a preset's UNet config with ``overrides`` applied."""
    if preset not in UNETS:
        raise ValueError(f"preset must be one of {', '.join(UNETS)}, got {preset!r}")
    return {**UNETS[preset], **overrides}


def write_clip_tokenizer_files(folder: Optional[str] = None) -> Dict[str, str]:
    """Write a byte-level CLIP BPE vocabulary (no merges beyond a few) and return its file paths.

    Enough for CLIPTokenizer (transformers or paddlenlp) to tokenize any prompt offline. ``folder`` None: one
    folder of this user's temporary directory that every tiny pipeline shares (the files never change), so
    building pipelines leaves no folder behind each time; each file is written whole, then moved in place.
    """
    folder = folder or os.path.join(tempfile.gettempdir(), f"tome-tokenizer-{os.getuid() if hasattr(os, 'getuid') else 0}")
    os.makedirs(folder, exist_ok=True)
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to 256 + n.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    merges = [("t", "h"), ("th", "e</w>"), ("a", "n"), ("o", "n</w>")]
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: index for index, token in enumerate(tokens)}
    vocab_file = os.path.join(folder, "vocab.json")
    merges_file = os.path.join(folder, "merges.txt")
    for path, text in ((vocab_file, json.dumps(vocab)), (merges_file, "#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")):
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=folder, delete=False) as f:
            f.write(text)
        os.replace(f.name, path)
    return {"vocab_file": vocab_file, "merges_file": merges_file}


# Video UNets at their released shapes, for the benchmark's video presets (random weights).
# AnimateDiff's MotionAdapter: guoyww/animatediff-motion-adapter-v1-5-2, config.json (diffusers 0.22): 4 blocks of
# (320, 640, 1280, 1280) channels, 2 motion layers per block, a motion mid block, 8 heads, 32 positions. Its
# motion_activation_fn "geglu", motion_attention_bias false and motion_cross_attention_dim null are no longer
# constructor arguments: diffusers builds every motion module that way.
VIDEO_UNETS["animatediff-v1-5-2"] = (
    "MotionAdapter",
    dict(
        block_out_channels=(320, 640, 1280, 1280),
        motion_layers_per_block=2,
        motion_mid_block_layers_per_block=1,
        motion_num_attention_heads=8,
        motion_norm_num_groups=32,
        motion_max_seq_length=32,
        use_motion_mid_block=True,
    ),
)
# Stable Video Diffusion: stabilityai/stable-video-diffusion-img2vid, unet/config.json (14 frames; img2vid-xt is
# the same UNet with num_frames 25).
VIDEO_UNETS["svd"] = (
    "UNetSpatioTemporalConditionModel",
    dict(
        sample_size=96,
        in_channels=8,
        out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal",) * 3 + ("DownBlockSpatioTemporal",),
        up_block_types=("UpBlockSpatioTemporal",) + ("CrossAttnUpBlockSpatioTemporal",) * 3,
        block_out_channels=(320, 640, 1280, 1280),
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=768,  # 3 time ids * 256
        layers_per_block=2,
        transformer_layers_per_block=1,
        cross_attention_dim=1024,
        num_attention_heads=(5, 10, 20, 20),
        num_frames=14,
    ),
)

# The benchmark's video presets (``python -m tome_tools.bench --preset NAME``): the model (a UNet2D of UNETS or
# VIDEO_UNETS plus a MotionAdapter of VIDEO_UNETS, or a VIDEO_UNETS model), the frame count and the default frame
# size (height, width) in pixels, and the loop's DDIM schedule (the released pipeline's betas).
# "svd" runs by default at 256x448 (16:9 like its released 576x1024, ``--resolution 576``): on this project's
# 2-core CPU with one thread, one call on 14 frames at 320x576 already took 5 minutes (3 minutes of CPU, 7 GB).
VIDEO_PRESETS: Dict[str, Dict[str, Any]] = {
    "animatediff": dict(
        unet="sd15", adapter="animatediff-v1-5-2", frames=16, size=(512, 512),
        scheduler=dict(beta_schedule="linear", beta_start=0.00085, beta_end=0.012),
    ),
    "svd": dict(model="svd", frames=14, size=(256, 448), scheduler=dict(prediction_type="v_prediction")),
    "tiny-animatediff": dict(
        unet="tiny-video-sd", adapter="tiny-animatediff", frames=4, size=(64, 64),
        scheduler=dict(beta_schedule="linear", beta_start=0.00085, beta_end=0.012),
    ),
    "tiny-svd": dict(model="tiny-svd", frames=4, size=(64, 96), scheduler=dict(prediction_type="v_prediction")),
}
# Wan's video presets: a VIDEO_TRANSFORMERS model, frames counted in pixel frames, which Wan's VAE compresses 4x
# in time (the first frame alone, then each 4 into one latent frame: (frames - 1) / 4 + 1 latent frames, so frames
# are 4k + 1) and 8x in space; frame sides are multiples of 16 px (8x VAE, 2x2 patches). "wan" runs 17 frames (5
# latent frames) at 480x832, the released 480p size; the release's default is 81 frames (21 latent frames), which
# --frames 81 gives. Its loop's scheduler is the transformer's (tome_tools.bench_runner.TRANSFORMER_SPECS).
VIDEO_PRESETS["wan"] = dict(transformer="wan-1.3b", frames=17, size=(480, 832), time_compression=4, size_multiple=16)
VIDEO_PRESETS["tiny-wan"] = dict(transformer="tiny-wan", frames=9, size=(64, 96), time_compression=4, size_multiple=16)


def unet2d_config(name: str) -> Dict[str, Any]:
    """A UNet2DConditionModel config by name: a preset of :data:`UNETS` or a UNet2D entry of :data:`VIDEO_UNETS`."""
    if name in UNETS:
        return unet_config(name)
    cls, config = video_unet_config(name)
    if cls != "UNet2DConditionModel":
        raise ValueError(f"{name!r} is a {cls}, not a UNet2DConditionModel")
    return dict(config)


SD_PIPELINES = ("sd", "img2img", "inpaint", "sdxl", "controlnet")
SD_SCHEDULER = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False, steps_offset=1)


def assemble_sd_pipeline(library: Any, parts: Any, kind: str, seed: int, preset: str) -> Any:
    """A Stable Diffusion pipeline of ``kind`` (one of :data:`SD_PIPELINES`) with random weights: one recipe for
    diffusers and ppdiffusers, whose classes share their names (``library`` is either module). ``parts`` holds
    the framework's own builders: ``seed(n)``, ``build_unet(preset, seed, **overrides)``,
    ``build_controlnet(unet, seed, tiny=...)``, ``text_parts(seed, with_projection=False, width=32)``.

    SDXL always uses the "tiny-xl" UNet; the "tiny" preset gets a VAE that downsamples 2x, every other preset
    a narrow VAE with the real 8x."""
    if kind not in SD_PIPELINES:
        raise ValueError(f"kind must be one of {', '.join(SD_PIPELINES)}, got {kind!r}")
    parts.seed(seed)
    vae = library.AutoencoderKL(**(TINY_VAE if preset == "tiny" else SMALL_VAE))
    vae.eval()
    common = dict(vae=vae, scheduler=library.DDIMScheduler(**SD_SCHEDULER))
    if kind == "sdxl":
        first, second = parts.text_parts(seed + 1), parts.text_parts(seed + 2, with_projection=True)
        return library.StableDiffusionXLPipeline(
            unet=parts.build_unet("tiny-xl", seed), text_encoder=first["text_encoder"], tokenizer=first["tokenizer"],
            text_encoder_2=second["text_encoder"], tokenizer_2=second["tokenizer"], **common,
        )
    common.update(parts.text_parts(seed + 1, width=unet_config(preset)["cross_attention_dim"]),
                  safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    if kind == "inpaint":
        return library.StableDiffusionInpaintPipeline(unet=parts.build_unet(preset, seed, in_channels=9), **common)
    unet = parts.build_unet(preset, seed)
    if kind == "controlnet":
        controlnet = parts.build_controlnet(unet, seed + 3, tiny=preset == "tiny")
        return library.StableDiffusionControlNetPipeline(unet=unet, controlnet=controlnet, **common)
    cls = library.StableDiffusionImg2ImgPipeline if kind == "img2img" else library.StableDiffusionPipeline
    return cls(unet=unet, **common)

