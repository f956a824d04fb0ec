"""Every model class diffusers exports (transformers, UNets, ControlNets) merges or is refused with its own reason.

The zoo is enumerated from the installed diffusers, so a release that adds a model class fails here until the
class is classified: merged (a tiny builder below, checked against the unpatched model) or refused (a reason in
:data:`tome_core.models.model_zoo.REFUSED`, which ``patch`` gives). Oracles: the unpatched model (``ratio=0`` and
``remove`` exact), the token counts that the attention modules really see, the text they see.
"""

from __future__ import annotations

import inspect
import math
import pathlib
import re
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

import diffusers
import warnings

from diffusers.models.attention_processor import Attention

import tome_core.torch as tome
from tome_core.adapters.diffusers import FRAMEWORK
from tome_core.algorithm.backend import get_ops
from tome_core.hooks.attention_bias import SizeBias
from tome_core.models.model_tree import blocks_of
from tome_core.models.families import TEXT_SUFFIX
from tome_core.algorithm.match import bipartite_matches
from tome_core.algorithm.merge import merge, unmerge
from tome_tools import diffusers_models as zoo
from tome_core.models.model_zoo import NOT_GENERATION, REFUSED, refusal
from tome_tools.presets import TRANSFORMERS, VIDEO_TRANSFORMERS

ZOO_PACKAGES = ("transformers", "unets", "controlnets")


def exported_models() -> List[str]:
    """The ModelMixin classes that ``diffusers.models`` exports from its transformers, UNets and ControlNets."""
    from diffusers.models.modeling_utils import ModelMixin

    names = []
    for name in dir(diffusers.models):
        cls = getattr(diffusers.models, name, None)
        if inspect.isclass(cls) and issubclass(cls, ModelMixin) and cls.__module__.split(".")[2:3] and cls.__module__.split(".")[2] in ZOO_PACKAGES:
            names.append(name)
    return sorted(names)


# Wrappers that hold several models of one class and run them in turn: patch reaches the models inside.
WRAPPERS = {
    "MultiControlNetModel": "ControlNetModel",
    "SD3MultiControlNetModel": "SD3ControlNetModel",
    "FluxMultiControlNetModel": "FluxControlNetModel",
    "MultiControlNetUnionModel": "ControlNetUnionModel",
    "HunyuanDiT2DMultiControlNetModel": "HunyuanDiT2DControlNetModel",
    "QwenImageMultiControlNetModel": "QwenImageControlNetModel",
}


def _unet():
    model = zoo.build_unet("tiny")
    generator = torch.Generator().manual_seed(1)
    return model, dict(
        sample=torch.randn(2, 4, 16, 16, generator=generator), timestep=torch.tensor(500),
        encoder_hidden_states=torch.randn(2, 7, model.config.cross_attention_dim, generator=generator),
    )


def _controlnet():
    unet, inputs = _unet()
    model = zoo.build_controlnet(unet)
    return model, {**inputs, "controlnet_cond": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))}


def _transformer(preset: str, height: int = 16, width: int = 12) -> Callable[[], Tuple[torch.nn.Module, Dict[str, Any]]]:
    def build():
        model = zoo.build_transformer(preset)
        return model, zoo.transformer_inputs(model, height, width, batch=2)
    return build


def _video_unet(kind: str):
    def build():
        model = zoo.build_video_unet(kind)
        return model, zoo.video_unet_inputs(model, frames=3, height=8, width=8)
    return build


def _wan():
    model = zoo.build_video_transformer("tiny-wan")
    generator = torch.Generator().manual_seed(3)
    return model, dict(
        hidden_states=torch.randn(2, 4, 2, 8, 12, generator=generator), timestep=torch.tensor([500, 500]),
        encoder_hidden_states=torch.randn(2, 5, 16, generator=generator),
    )


def _small_unet(**config):
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        block_out_channels=(16, 16), layers_per_block=2, sample_size=16, in_channels=4, out_channels=4,
        attention_head_dim=8, down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8, norm_num_groups=4,
        use_linear_projection=True, **config,
    )


def _inputs(seed: int = 1, batch: int = 2, **shapes) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=generator) for name, shape in shapes.items()}


def _controlnet_xs():
    unet = _small_unet()
    adapter = diffusers.ControlNetXSAdapter.from_unet(unet, size_ratio=1, conditioning_embedding_out_channels=(2, 2))
    model = diffusers.UNetControlNetXSModel.from_unet(unet, adapter).eval()
    inputs = _inputs(sample=(2, 4, 16, 16), encoder_hidden_states=(2, 4, 8), controlnet_cond=(2, 3, 32, 32))
    return model, {**inputs, "timestep": torch.tensor([10])}


def _transformer_2d():
    torch.manual_seed(0)
    model = diffusers.Transformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=8, norm_num_groups=4, cross_attention_dim=8)
    return model.eval(), _inputs(hidden_states=(2, 8, 8, 8), encoder_hidden_states=(2, 4, 8))


def _dreamlite():
    torch.manual_seed(0)
    model = diffusers.DreamLiteUNetModel(  # its first level has cross-attention only (no attn1): level 2 merges
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), cross_attention_dim=8,
        down_block_types=("DreamLiteCrossAttnNoSelfAttnDownBlock2D", "DreamLiteCrossAttnDownBlock2D"),
        up_block_types=("DreamLiteCrossAttnUpBlock2D", "DreamLiteUpBlock2D"), attention_head_dim=8,
        layers_per_block=1, norm_num_groups=8, transformer_layers_per_block=1,
    )
    inputs = _inputs(sample=(2, 4, 16, 16), encoder_hidden_states=(2, 4, 8))
    return model.eval(), {**inputs, "timestep": torch.tensor([10])}


def _i2vgen():
    torch.manual_seed(0)
    model = diffusers.I2VGenXLUNet(
        sample_size=None, in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), block_out_channels=(16, 32), layers_per_block=1,
        norm_num_groups=4, cross_attention_dim=8, attention_head_dim=4, num_attention_heads=None,
    )
    inputs = _inputs(sample=(1, 4, 2, 8, 8), image_latents=(1, 4, 2, 8, 8), image_embeddings=(1, 8), encoder_hidden_states=(1, 4, 8))
    return model.eval(), {**inputs, "timestep": torch.tensor([10]), "fps": torch.tensor([16])}


def _controlnet_union():
    torch.manual_seed(0)
    model = diffusers.ControlNetUnionModel(  # SDXL's: text-time embeddings, a transformer over control types
        block_out_channels=(16, 16), layers_per_block=1, in_channels=4, attention_head_dim=8, norm_num_groups=4,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"), cross_attention_dim=8,
        addition_embed_type="text_time", addition_time_embed_dim=4, projection_class_embeddings_input_dim=8 + 6 * 4,
        conditioning_embedding_out_channels=(2, 2), num_trans_channel=16, num_trans_head=2, num_proj_channel=16,
    )
    zoo._randomize_zeros(model, 1)  # zero convolutions: its residuals would be zero whatever its blocks do
    inputs = _inputs(sample=(2, 4, 16, 16), encoder_hidden_states=(2, 4, 8), cond=(2, 3, 32, 32), text_embeds=(2, 8), time_ids=(2, 6))
    return model.eval(), dict(
        sample=inputs["sample"], timestep=torch.tensor([10]), encoder_hidden_states=inputs["encoder_hidden_states"],
        controlnet_cond=[inputs["cond"]], control_type=torch.tensor([[1, 0, 0, 0, 0, 0]] * 2), control_type_idx=[0],
        added_cond_kwargs={"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]},
    )


def _video(preset: str, frames: int = 2, height: int = 8, width: int = 12):
    def build():
        model = zoo.build_video_transformer(preset)
        return model, zoo.video_transformer_inputs(model, frames, height, width, batch=2)
    return build


def _krea2():
    """Krea 2 on a 6x8 grid after 5 text tokens (the last one padding); its ids cover [text; image]."""
    config = dict(
        in_channels=8, num_layers=2, attention_head_dim=8, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, timestep_embed_dim=8, text_hidden_dim=16, num_text_layers=3, text_num_attention_heads=2,
        text_num_key_value_heads=1, text_intermediate_size=16, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(4, 2, 2),
    )
    rows, cols, text = 6, 8, 5
    ids = torch.zeros(text + rows * cols, 3)
    ids[text:, 1] = torch.arange(rows).repeat_interleave(cols)
    ids[text:, 2] = torch.arange(cols).repeat(rows)
    mask = torch.ones(2, text, dtype=torch.bool)
    mask[1, -1] = False
    return _built(
        "Krea2Transformer2DModel", config, hidden_states=(2, rows * cols, 8), encoder_hidden_states=(2, text, 3, 16),
        timestep=torch.tensor([0.5, 0.5]), position_ids=ids, encoder_attention_mask=mask,
    )()


def _ideogram4(packed: Tuple[int, ...] = ()):
    """Ideogram 4 on its pipeline's packed rows [left padding; text; image] (its own _prepare_ids), 5 text places
    (the second prompt's 3 tokens after 2 of padding), a 6x8 image. The rows in ``packed`` instead pack two samples
    [text (2); image (2x4)], each its own segment, at 0 and 26, padding after each."""
    config = dict(
        in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4, intermediate_size=32, adaln_dim=16,
        llm_features_dim=24, rope_theta=10_000, mrope_section=(2, 1, 1),
    )
    prepare = diffusers.Ideogram4Pipeline._prepare_ids
    ids, segments, indicator = prepare([5, 3], 6, 8, 5, torch.device("cpu"))
    sample, _, roles = prepare([2], 2, 4, 2, torch.device("cpu"))
    for b in packed:
        ids[b], segments[b], indicator[b] = 0, -1, -1
        for k in range(2):
            at = slice(26 * k, 26 * k + sample.shape[1])
            ids[b, at], segments[b, at], indicator[b, at] = sample[0], k + 1, roles[0]
    length = ids.shape[1]
    return _built(
        "Ideogram4Transformer2DModel", config, hidden_states=(2, length, 16), encoder_hidden_states=(2, length, 24),
        timestep=torch.tensor([0.5, 0.5]), position_ids=ids, segment_ids=segments, indicator=indicator,
    )()


def _minimax_h3(keyframes: Tuple[str, ...] = ("first",)):
    """MiniMax-H3 on its pipeline's layout (its own build_packed_sequence), one the batch shares: [text (4); a
    keyframe's condition frame (4x6); audio (2 channels x 3); video (3 frames of 4x6)], each with its rotary ids;
    the condition rows at the clean timestep, the rest at the noisy one."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    config = dict(
        num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2, num_refiner_layers=1, ffn_dim=32,
        in_channels=4, audio_in_channels=6, patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=24,
        time_embed_dim=16, rope_freq_dim=2,
    )
    ids, tags, video, audio, text, conditions, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(4, dtype=torch.long), 3, 8, 12, 3, (1, 2, 2), 2, audio_tag=2, video_tag=0, keyframe_anchors=keyframes,
    )
    steps = torch.zeros(ids.shape[0], dtype=torch.long)
    steps[video[:conditions]] = 1
    return _built(
        "MiniMaxH3Transformer3DModel", config, hidden_states=(2, video.numel(), 16), audio_hidden_states=(2, 6, 6),
        encoder_hidden_states=(2, 4, 8), timestep=torch.tensor([0.5, 1.0]), timestep_indices=steps, token_tags=tags,
        position_ids=ids, video_indices=video, audio_indices=audio, text_indices=text,
    )()


def _joyimage_edit_plus():
    """JoyImage-Edit-Plus: patches [B, N, C, 1, 2, 2], the 4x6 target's first, then each item's references (two for
    the first, one for the second, padded to its length); a key mask over [patches; text], the second text padded."""
    config = dict(
        patch_size=[1, 2, 2], in_channels=16, hidden_size=32, num_attention_heads=2, text_dim=16, num_layers=2,
        rope_dim_list=[4, 6, 6], theta=256,
    )
    shapes = [[(1, 4, 6), (1, 2, 3), (1, 3, 2)], [(1, 4, 6), (1, 3, 3)]]
    mask = torch.tensor([[1] * 12, [1] * 9 + [0] * 3])
    return _built(
        "JoyImageEditPlusTransformer3DModel", config, hidden_states=(2, 24 + 12, 16, 1, 2, 2),
        encoder_hidden_states=(2, 12, 16), encoder_hidden_states_mask=mask, timestep=torch.tensor([500.0, 500.0]),
        shape_list=shapes,
    )()


def _flux3_ids(rows: int, cols: int, layer: int = 0, scale: float = 0.5) -> torch.Tensor:
    """FLUX.3's image ids (t, h, w, l): h and w scaled by its image_rope_scale, references at layers -1, -2..."""
    ids = torch.zeros(rows * cols, 4)
    ids[:, 1] = torch.arange(rows).repeat_interleave(cols) * scale
    ids[:, 2] = torch.arange(cols).repeat(rows) * scale
    ids[:, 3] = layer
    return ids


_FLUX3 = dict(
    in_channels=8, cond_in_channels=8, num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
    joint_attention_dim=16, timestep_channels=16, axes_dims_rope=(2, 2, 2, 2),
)
_FLUX3_CALL = dict(
    hidden_states=(2, 48, 8), encoder_hidden_states=(2, 5, 16), timestep=torch.tensor([0.5, 0.5]),
    img_ids=_flux3_ids(6, 8), txt_ids=torch.zeros(5, 4),
)


def _omnigen():
    """OmniGen: 5 prompt tokens, an input image's 16 tokens in item 0's prompt (at 5..21), the time token, then the
    output's 16; its attention mask over all 38 tokens, the second item's last prompt token masked."""
    config = dict(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32, num_layers=2, pad_token_id=0,
        vocab_size=1000, in_channels=4, time_step_dim=4, rope_scaling={"long_factor": [1, 2], "short_factor": [1, 2]},
    )
    tokens = 21 + 1 + 16
    mask = torch.ones(2, tokens, tokens)
    mask[1, :, 20] = 0
    return _built(
        "OmniGenTransformer2DModel", config, hidden_states=(2, 4, 8, 8), timestep=torch.tensor([0.5, 0.5]),
        input_ids=torch.randint(0, 10, (2, 21), generator=torch.Generator().manual_seed(2)),
        input_img_latents=[torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))],
        input_image_sizes={0: [[5, 21]]}, attention_mask=mask, position_ids=torch.arange(tokens).repeat(2, 1),
    )()


def _built(name: str, config: Dict[str, Any], **inputs: Any):
    """A builder of diffusers' class ``name`` from ``config`` (seeded; zero-initialised output layers given
    values) called with ``inputs`` (tensors drawn from a seeded generator where given as shapes)."""
    def build():
        model = zoo.random_transformer(name, config, 0)
        generator = torch.Generator().manual_seed(1)
        drawn = {k: torch.randn(*v, generator=generator) if _is_shape(v) else v for k, v in inputs.items()}
        return model, drawn
    return build


def _is_shape(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(n, int) for n in value)


# Stable Cascade's stage B/C UNet: attention blocks on the feature map, one level with self-attention over [image;
# condition], one (half the size) attending to the condition alone (self_attn=False)
_CASCADE = dict(
    in_channels=4, out_channels=4, conditioning_dim=32, block_out_channels=[16, 32], num_attention_heads=[2, 2],
    down_num_layers_per_block=[1, 1], up_num_layers_per_block=[1, 1], down_blocks_repeat_mappers=[1, 1],
    up_blocks_repeat_mappers=[1, 1], switch_level=None, clip_text_pooled_in_channels=16, self_attn=[True, False],
    timestep_ratio_embedding_dim=16, dropout=[0.0, 0.0],
    block_types_per_layer=[["SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"]] * 2,
)
_WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16,
    freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
)
_WAN_CALL = dict(hidden_states=(2, 4, 3, 8, 12), encoder_hidden_states=(2, 5, 16), timestep=torch.tensor([500, 500]))
_COGVIEW = dict(
    hidden_states=(2, 4, 12, 20), encoder_hidden_states=(2, 8, 8), timestep=torch.tensor([500, 500]),
    original_size=torch.tensor([[96, 160]] * 2), target_size=torch.tensor([[96, 160]] * 2), crop_coords=torch.tensor([[0, 0]] * 2),
)
_HUNYUAN_DIT = dict(
    sample_size=8, patch_size=2, in_channels=4, attention_head_dim=8, num_attention_heads=2, cross_attention_dim=8,
    cross_attention_dim_t5=8, pooled_projection_dim=4, hidden_size=16, text_len=4, text_len_t5=4, activation_fn="gelu-approximate",
)


def _hunyuan_dit_call(controlnet: bool = False) -> Dict[str, Any]:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    call = dict(
        hidden_states=(2, 4, 12, 20), timestep=torch.tensor([500.0] * 2), encoder_hidden_states=(2, 4, 8),
        text_embedding_mask=torch.ones(2, 4), encoder_hidden_states_t5=(2, 4, 8), text_embedding_mask_t5=torch.ones(2, 4),
        image_meta_size=torch.tensor([[96.0, 160, 96, 160, 0, 0]] * 2), style=torch.zeros(2, dtype=torch.long),
        image_rotary_emb=get_2d_rotary_pos_embed(8, ((0, 0), (6, 10)), (6, 10), output_type="pt"),
    )
    return {**call, "controlnet_cond": (2, 4, 12, 20)} if controlnet else call


def _z_image():
    torch.manual_seed(0)
    model = diffusers.ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=16, n_layers=1, n_refiner_layers=1, n_heads=1,
        n_kv_heads=2, qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 4, 4],
        axes_lens=[256, 32, 32],
    ).eval()
    zoo._randomize_zeros(model, 1)
    generator = torch.Generator().manual_seed(1)
    x = [torch.randn(16, 1, 12, 20, generator=generator) for _ in range(2)]  # grid 6x10, padded to 64 tokens
    captions = [torch.randn(16, 16, generator=generator), torch.randn(40, 16, generator=generator)]  # a padded batch
    return model, dict(x=x, t=torch.tensor([0.3, 0.3]), cap_feats=captions)


def _z_image_controlnet(mode: Any = None, transformer: Any = None):
    """Z-Image's ControlNet with the tiny Z-Image transformer's embedders and refiners (``from_transformer``: of
    ``transformer``, or a new one), two control blocks (the second takes the stack of the first's hint and stream);
    ``mode``: its ``add_control_noise_refiner``."""
    built, inputs = _z_image()
    transformer = transformer or built
    shared = {k: transformer.config[k] for k in ("all_patch_size", "all_f_patch_size", "dim", "n_refiner_layers", "n_heads", "n_kv_heads", "qk_norm")}
    torch.manual_seed(0)
    model = diffusers.ZImageControlNetModel(
        control_layers_places=[0, 1], control_refiner_layers_places=[0] if mode else None, control_in_dim=16,
        add_control_noise_refiner=mode, **shared,
    ).eval()
    zoo._randomize_zeros(model, 2)
    model = diffusers.ZImageControlNetModel.from_transformer(model, transformer)
    generator = torch.Generator().manual_seed(2)
    return model, dict(inputs, control_context=[torch.randn(16, 1, 12, 20, generator=generator) for _ in range(2)])


def _uvit():
    """aMUSEd's UVit: VQ codes (B, 16, 12), downsampled by its down block to the 8x6 grid of its transformer layers;
    its vocabulary holds the 32 codes and the mask token (32)."""
    torch.manual_seed(0)
    model = diffusers.UVit2DModel(
        hidden_size=32, cond_embed_dim=16, micro_cond_encode_dim=2, micro_cond_embed_dim=10, encoder_hidden_size=16,
        vocab_size=40, codebook_size=32, in_channels=16, block_out_channels=16, num_res_blocks=1, downsample=True,
        upsample=True, block_num_heads=1, num_hidden_layers=2, num_attention_heads=1, intermediate_size=32,
    ).eval()
    generator = torch.Generator().manual_seed(1)
    return model, dict(
        input_ids=torch.randint(0, 32, (2, 16, 12), generator=generator), encoder_hidden_states=torch.randn(2, 5, 16, generator=generator),
        pooled_text_emb=torch.randn(2, 16, generator=generator), micro_conds=torch.randn(2, 5, generator=generator),
    )


def _allegro():
    from diffusers import AllegroPipeline

    model = zoo.random_transformer("AllegroTransformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=24, in_channels=4, out_channels=4, num_layers=1, cross_attention_dim=48,
        sample_width=8, sample_height=8, sample_frames=8, caption_channels=8,
    ), 0)

    class Positions:  # what the pipeline's rotary method reads
        vae_scale_factor_spatial = 8
        transformer = model

    rotary = AllegroPipeline._prepare_rotary_positional_embeddings(Positions(), 2, 64, 96, 2, "cpu")
    generator = torch.Generator().manual_seed(1)
    return model, dict(
        hidden_states=torch.randn(2, 4, 2, 8, 12, generator=generator), encoder_hidden_states=torch.randn(2, 7, 8, generator=generator),
        timestep=torch.tensor([500, 500]), encoder_attention_mask=torch.ones(2, 7), image_rotary_emb=rotary,
    )


def _consisid():
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    build = _built(
        "ConsisIDTransformer3DModel",
        dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=2,
             text_embed_dim=8, num_layers=1, sample_width=8, sample_height=8, sample_frames=8, patch_size=2,
             temporal_compression_ratio=4, max_text_seq_length=8, cross_attn_interval=1, is_kps=False,
             is_train_face=True, cross_attn_dim_head=1, cross_attn_num_heads=1, LFE_id_dim=2, LFE_vit_dim=2,
             LFE_depth=5, LFE_dim_head=8, LFE_num_heads=2, LFE_num_id_token=1, LFE_num_querie=1, LFE_output_dim=21,
             LFE_ff_mult=1, LFE_num_scale=1),
        hidden_states=(2, 2, 4, 8, 8), encoder_hidden_states=(2, 8, 8), timestep=torch.tensor([500, 500]),
        image_rotary_emb=get_3d_rotary_pos_embed(16, ((0, 0), (4, 4)), (4, 4), temporal_size=2),
        id_vit_hidden=[torch.ones([2, 2, 2])], id_cond=torch.ones(2, 2),
    )
    return build()


def _qwen_controlnet():
    config = {k: v for k, v in zoo.transformer_config("tiny-qwen-image")[1].items() if k != "guidance_embeds"}
    model = zoo.random_transformer("QwenImageControlNetModel", config, 0)
    inputs = zoo.transformer_inputs(zoo.build_transformer("tiny-qwen-image"), 16, 12, batch=2)
    return model, {**inputs, "controlnet_cond": torch.randn(2, 48, 16, generator=torch.Generator().manual_seed(2))}


def _cosmos_controlnet():
    """Cosmos' ControlNet resizes its padding mask with torchvision, which the test environment lacks (it would
    pull a CUDA torch): a nearest-neighbour resize of torch's stands in for it, in its module only."""
    import types

    from diffusers.models.controlnets import controlnet_cosmos

    resize = lambda x, size, interpolation=None: torch.nn.functional.interpolate(x, size=size, mode="nearest")  # noqa: E731
    controlnet_cosmos.transforms = types.SimpleNamespace(
        functional=types.SimpleNamespace(resize=resize), InterpolationMode=types.SimpleNamespace(NEAREST="nearest")
    )
    build = _built(
        "CosmosControlNetModel",
        dict(n_controlnet_blocks=2, in_channels=18, latent_channels=18, model_channels=32, num_attention_heads=2,
             attention_head_dim=16, mlp_ratio=2, text_embed_dim=32, adaln_lora_dim=4, patch_size=(1, 2, 2),
             max_size=(4, 32, 32), rope_scale=(2.0, 1.0, 1.0), extra_pos_embed_type=None, img_context_dim_in=32,
             img_context_dim_out=32, use_crossattn_projection=False),
        controls_latents=(1, 16, 3, 16, 12), latents=(1, 16, 3, 16, 12), timestep=torch.tensor([0.5]),
        encoder_hidden_states=(torch.ones(1, 12, 32), torch.ones(1, 4, 32)), condition_mask=torch.ones(1, 1, 3, 16, 12),
        conditioning_scale=1.0, padding_mask=torch.zeros(1, 1, 16, 12),
    )
    return build()


# Kandinsky 6 as released (ca_rope, cross_gates, fix_modulation), tiny: a 2x4x6 token grid, audio of 5 tokens
_KANDINSKY6 = VIDEO_TRANSFORMERS["tiny-kandinsky6"][1]
_KANDINSKY6_CALL = dict(
    hidden_states=(2, 2, 8, 12, 9), encoder_hidden_states=(2, 7, 16), pooled_projections=(2, 8),
    timestep=torch.tensor([500.0, 500.0]), audio_hidden_states=(2, 5, 4),
    encoder_attention_mask=torch.tensor([[True] * 7, [True] * 4 + [False] * 3]),
)


_BRIA_FIBO2 = TRANSFORMERS["tiny-bria-fibo2"][1]  # a 4x6 token grid below
_BRIA_FIBO2_CALL = dict(
    hidden_states=(2, 8, 8, 12), timestep=torch.tensor([0.5, 0.5]), encoder_hidden_states=(2, 2, 8, 16),
    context_latents=[torch.randn(2, 8, 4, 6, generator=torch.Generator().manual_seed(4))],  # a 2x3 image to edit
)
_BRIA_FIBO2_PADDED = dict(encoder_attention_mask=torch.tensor([[True] * 8, [True] * 2 + [False] * 6]))  # 8 and 4 gist tokens


# Qwen-Image 2.1: 7 text tokens with a 2x2 condition image in one slot after the third, then the 4x6 target's 24
# tokens (6 slots of 2x2): a stream of 3 + 4 + 4 + 24 = 35 tokens, the target last; the second prompt padded
_QWEN_IMAGE_21_CALL = dict(
    hidden_states=(2, 4 + 24, 4), encoder_hidden_states=(2, 8, 16), timestep=torch.tensor([0.5, 0.5]),
    img_shapes=[[(1, 2, 2), (1, 4, 6)]] * 2, img_mask=torch.tensor([[False] * 3 + [True] + [False] * 4 + [True] * 6] * 2),
    encoder_hidden_states_mask=torch.tensor([[True] * 8, [True] * 6 + [False] * 2]),
)


def _lumina_rotary(head_dim: int) -> torch.Tensor:
    """Lumina-Next's rotary table as its pipeline builds it (complex, [rows, cols, head_dim / 2]), 32x32 positions."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    return get_2d_rotary_pos_embed_lumina(head_dim, 32, 32)


# Classes that merge, each with a tiny model (random weights) and the keyword inputs of one call.
MERGED: Dict[str, Callable[[], Tuple[torch.nn.Module, Dict[str, Any]]]] = {
    "UNet2DConditionModel": _unet,
    "ControlNetModel": _controlnet,
    "SD3Transformer2DModel": _transformer("tiny-sd3"),
    "FluxTransformer2DModel": _transformer("tiny-flux"),
    "PixArtTransformer2DModel": _transformer("tiny-pixart"),
    "DiTTransformer2DModel": _transformer("tiny-dit", 16, 16),
    "UNetMotionModel": _video_unet("animatediff"),
    "UNetSpatioTemporalConditionModel": _video_unet("svd"),
    "UNet3DConditionModel": _video_unet("text-to-video"),
    "WanTransformer3DModel": _wan,
    "UNetControlNetXSModel": _controlnet_xs,
    "Transformer2DModel": _transformer_2d,
    "DreamLiteUNetModel": _dreamlite,
    "I2VGenXLUNet": _i2vgen,
    "ControlNetUnionModel": _controlnet_union,
    "Flux2Transformer2DModel": _transformer("tiny-flux2"),
    "ChromaTransformer2DModel": _transformer("tiny-chroma"),
    "LongCatImageTransformer2DModel": _transformer("tiny-longcat"),
    "OvisImageTransformer2DModel": _transformer("tiny-ovis"),
    "BriaTransformer2DModel": _transformer("tiny-bria"),
    "BriaFiboTransformer2DModel": _transformer("tiny-bria-fibo"),
    "QwenImageTransformer2DModel": _transformer("tiny-qwen-image"),
    "HunyuanVideoTransformer3DModel": _video("tiny-hunyuan-video"),
    "HunyuanVideo15Transformer3DModel": _video("tiny-hunyuan-video-15"),
    "CogVideoXTransformer3DModel": _video("tiny-cogvideox", width=8),
    "LTXVideoTransformer3DModel": _video("tiny-ltx"),
    "CogView3PlusTransformer2DModel": _built(
        "CogView3PlusTransformer2DModel",
        dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=2, out_channels=4,
             text_embed_dim=8, time_embed_dim=8, condition_dim=2, pos_embed_max_size=16, sample_size=8),
        **_COGVIEW,
    ),
    "CogView4Transformer2DModel": _built(
        "CogView4Transformer2DModel",
        dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=4, out_channels=4,
             text_embed_dim=8, time_embed_dim=8, condition_dim=4),
        **_COGVIEW,
    ),
    "HunyuanDiT2DModel": _built("HunyuanDiT2DModel", dict(_HUNYUAN_DIT, num_layers=4), **_hunyuan_dit_call()),
    "HunyuanDiT2DControlNetModel": _built(
        "HunyuanDiT2DControlNetModel", dict(_HUNYUAN_DIT, transformer_num_layers=4), **_hunyuan_dit_call(controlnet=True)
    ),
    "AuraFlowTransformer2DModel": _built(
        "AuraFlowTransformer2DModel",
        dict(sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1, attention_head_dim=8,
             num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32, out_channels=4, pos_embed_max_size=256),
        hidden_states=(2, 4, 12, 20), encoder_hidden_states=(2, 10, 32), timestep=torch.tensor([0.5, 0.5]),
    ),
    "HunyuanImageTransformer2DModel": _built(
        "HunyuanImageTransformer2DModel",
        dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=1, num_single_layers=1,
             num_refiner_layers=1, patch_size=(1, 1), guidance_embeds=False, text_embed_dim=32, text_embed_2_dim=32,
             rope_axes_dim=(4, 4)),
        hidden_states=(2, 4, 6, 10), timestep=torch.tensor([500.0, 500.0]), encoder_hidden_states=(2, 7, 32),
        encoder_attention_mask=torch.tensor([[1] * 7, [1] * 5 + [0] * 2]), encoder_hidden_states_2=(2, 3, 32),
        encoder_attention_mask_2=torch.ones(2, 3),
    ),
    "CosmosTransformer3DModel": _built(
        "CosmosTransformer3DModel",
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2, mlp_ratio=2,
             text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0),
             concat_padding_mask=False, extra_pos_embed_type="learnable"),
        hidden_states=(2, 4, 3, 8, 12), timestep=torch.tensor([0.5, 0.5]), encoder_hidden_states=(2, 12, 16), fps=30,
    ),
    "ZImageTransformer2DModel": _z_image,
    "ZImageControlNetModel": _z_image_controlnet,
    "UVit2DModel": _uvit,
    "CosmosControlNetModel": _cosmos_controlnet,
    "ConsisIDTransformer3DModel": _consisid,
    "QwenImageControlNetModel": _qwen_controlnet,
    "DreamLiteTransformer2DModel": _built(
        "DreamLiteTransformer2DModel",
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=8, norm_num_groups=4, cross_attention_dim=8),
        hidden_states=(2, 8, 8, 8), encoder_hidden_states=(2, 4, 8),
    ),
    "GlmImageTransformer2DModel": _built(
        "GlmImageTransformer2DModel",
        dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
             text_embed_dim=32, time_embed_dim=16, condition_dim=8, prior_vq_quantizer_codebook_size=64),
        hidden_states=(2, 4, 8, 12), encoder_hidden_states=(2, 12, 32), prior_token_id=torch.arange(48).reshape(2, 24) % 64,
        prior_token_drop=torch.zeros(2, dtype=torch.bool), timestep=torch.tensor([500, 500]),
        target_size=torch.tensor([[8.0, 12.0]] * 2), crop_coords=torch.tensor([[0.0, 0.0]] * 2),
    ),
    "NucleusMoEImageTransformer2DModel": _built(
        "NucleusMoEImageTransformer2DModel",
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
             joint_attention_dim=16, axes_dims_rope=(8, 4, 4), moe_enabled=True, capacity_factors=[8.0, 8.0],
             dense_moe_strategy="leave_first_block_dense"),
        hidden_states=(2, 24, 16), encoder_hidden_states=(2, 8, 16), encoder_hidden_states_mask=torch.ones(2, 8, dtype=torch.long),
        timestep=torch.tensor([1.0, 1.0]), img_shapes=[(1, 4, 6)] * 2,
    ),
    "WanAnimateTransformer3DModel": _built(
        "WanAnimateTransformer3DModel",
        dict(_WAN, in_channels=12, latent_channels=4, image_dim=16, motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16},
             motion_encoder_size=16, motion_style_dim=8, motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16,
             face_encoder_num_heads=2, inject_face_latents_blocks=2),
        hidden_states=(1, 12, 21, 16, 12), timestep=torch.tensor([500]), encoder_hidden_states=(1, 12, 16),
        encoder_hidden_states_image=(1, 12, 16), pose_hidden_states=(1, 4, 20, 16, 12), face_pixel_values=(1, 3, 77, 16, 16),
    ),
    "MochiTransformer3DModel": _built(
        "MochiTransformer3DModel",
        dict(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
             in_channels=4, out_channels=None, qk_norm="rms_norm", text_embed_dim=16, time_embed_dim=4,
             activation_fn="swiglu", max_sequence_length=16),
        hidden_states=(2, 4, 2, 8, 12), encoder_hidden_states=(2, 16, 16), timestep=torch.tensor([500, 500]),
        encoder_attention_mask=torch.tensor([[True] * 16, [True] * 10 + [False] * 6]),
    ),
    "Kandinsky5Transformer3DModel": _built(  # channels-last latent (B, F, H, W, C)
        "Kandinsky5Transformer3DModel",
        dict(in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, out_visual_dim=4, patch_size=(1, 2, 2),
             model_dim=16, ff_dim=32, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6)),
        hidden_states=(2, 2, 8, 12, 4), encoder_hidden_states=(2, 7, 16), timestep=torch.tensor([500.0, 500.0]),
        pooled_projections=(2, 8), visual_rope_pos=[torch.arange(2), torch.arange(4), torch.arange(6)],
        text_rope_pos=torch.arange(7),
    ),
    "Kandinsky6Transformer3DModel": _built(  # Kandinsky 5's latent; video and audio in fused blocks
        "Kandinsky6Transformer3DModel", _KANDINSKY6, **_KANDINSKY6_CALL,
    ),
    "BriaFibo2Transformer2DModel": _built(  # [image; context image; gist]: the batch pads the gist, so it goes last
        "BriaFibo2Transformer2DModel", _BRIA_FIBO2, **_BRIA_FIBO2_CALL, **_BRIA_FIBO2_PADDED,
    ),
    "QwenImage21Transformer2DModel": _built(  # [text with a condition image; target], a padded prompt
        "QwenImage21Transformer2DModel", TRANSFORMERS["tiny-qwen-image-21"][1], **_QWEN_IMAGE_21_CALL,
    ),
    "PRXTransformer2DModel": _built(
        "PRXTransformer2DModel",
        dict(in_channels=4, patch_size=2, context_in_dim=16, hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=2,
             axes_dim=[8, 8]),
        hidden_states=(2, 4, 12, 16), encoder_hidden_states=(2, 7, 16), timestep=torch.tensor([0.5, 0.5]),
        attention_mask=torch.tensor([[True] * 7, [True] * 4 + [False] * 3]),
    ),
    "ErnieImageTransformer2DModel": _built(  # sequence-first [image; text] blocks, a padded second prompt
        "ErnieImageTransformer2DModel",
        dict(hidden_size=16, num_attention_heads=1, num_layers=2, ffn_hidden_size=16, in_channels=16, out_channels=16,
             patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=(8, 4, 4), eps=1e-6, qk_layernorm=True),
        hidden_states=(2, 16, 12, 16), timestep=torch.tensor([500.0, 500.0]), text_bth=(2, 7, 16),
        text_lens=torch.tensor([7, 4]),
    ),
    "JoyImageEditTransformer3DModel": _built(  # an edit call: (batch, items, C, T, H, W), the target last
        "JoyImageEditTransformer3DModel",
        dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=32, num_attention_heads=2, text_dim=16, num_layers=2,
             rope_dim_list=[4, 6, 6], theta=256),
        hidden_states=(2, 2, 16, 1, 8, 12), encoder_hidden_states=(2, 12, 16), timestep=torch.tensor([500.0, 500.0]),
    ),
    "JoyImageEditPlusTransformer3DModel": _joyimage_edit_plus,
    "Krea2Transformer2DModel": _krea2,
    "Ideogram4Transformer2DModel": _ideogram4,
    "MiniMaxH3Transformer3DModel": _minimax_h3,
    "AnyFlowTransformer3DModel": _built(  # frames-first latent (B, F, C, H, W), a timestep per frame
        "AnyFlowTransformer3DModel",
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
             text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
             gate_value=0.25, deltatime_type="r"),
        hidden_states=(2, 2, 4, 8, 12), timestep=torch.full((2, 2), 500.0), r_timestep=torch.full((2, 2), 250.0),
        encoder_hidden_states=(2, 5, 16),
    ),
    "MotifVideoTransformer3DModel": _built(  # with its text cross-attentions and a decoder layer
        "MotifVideoTransformer3DModel",
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=1,
             num_single_layers=2, num_decoder_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
             text_embed_dim=16, image_embed_dim=4, rope_axes_dim=(4, 4, 4), enable_text_cross_attention_dual=True,
             enable_text_cross_attention_single=True),
        hidden_states=(2, 4, 2, 8, 12), encoder_hidden_states=(2, 6, 16), timestep=torch.tensor([500, 500]),
        encoder_attention_mask=torch.tensor([[1] * 6, [1] * 4 + [0] * 2]),
    ),
    "Flux3Transformer2DModel": _built(  # with a reference image: its tokens join after the output's
        "Flux3Transformer2DModel", _FLUX3, **_FLUX3_CALL, image_cond_hidden_states=(2, 16, 8),
        image_cond_ids=_flux3_ids(4, 4, layer=-1),
    ),
    "HunyuanVideoFramepackTransformer3DModel": _built(  # its image stream: [history 4x; history 2x; clean; latent]
        "HunyuanVideoFramepackTransformer3DModel",
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
             num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
             text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None,
             has_image_proj=True, image_proj_dim=16, has_clean_x_embedder=True),
        hidden_states=(2, 4, 3, 8, 8), timestep=torch.tensor([500, 500]), encoder_hidden_states=(2, 6, 16),
        pooled_projections=(2, 8), encoder_attention_mask=torch.tensor([[1] * 6, [1] * 4 + [0] * 2]),
        guidance=torch.tensor([3500.0, 3500.0]), image_embeds=(2, 3, 16), indices_latents=torch.arange(3),
        latents_clean=(2, 4, 2, 8, 8), indices_latents_clean=torch.arange(3, 5),
        latents_history_2x=(2, 4, 2, 8, 8), indices_latents_history_2x=torch.arange(5, 7),
        latents_history_4x=(2, 4, 8, 8, 8), indices_latents_history_4x=torch.arange(7, 15),
    ),
    "HeliosTransformer3DModel": _built(  # its image stream: [long; mid; short history; current frames]
        "HeliosTransformer3DModel",
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
             text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
             rope_dim=(4, 4, 4), has_multi_term_memory_patch=True, guidance_cross_attn=True,
             zero_history_timestep=True, is_amplify_history=True),
        hidden_states=(2, 4, 2, 8, 16), timestep=torch.tensor([500, 500]), encoder_hidden_states=(2, 6, 16),
        indices_hidden_states=torch.tensor([[4, 5]] * 2), indices_latents_history_short=torch.tensor([[3]] * 2),
        indices_latents_history_mid=torch.tensor([[2]] * 2), indices_latents_history_long=torch.tensor([[0, 0, 1, 1]] * 2),
        latents_history_short=(2, 4, 1, 8, 16), latents_history_mid=(2, 4, 1, 8, 16), latents_history_long=(2, 4, 4, 8, 16),
    ),
    "OmniGenTransformer2DModel": _omnigen,
    "AllegroTransformer3DModel": _allegro,
    "EasyAnimateTransformer3DModel": _built(
        "EasyAnimateTransformer3DModel",
        dict(attention_head_dim=16, num_attention_heads=2, in_channels=4, mmdit_layers=2, num_layers=3, out_channels=4,
             patch_size=2, sample_height=60, sample_width=90, text_embed_dim=16, time_embed_dim=8,
             time_position_encoding_type="3d_rope", timestep_activation_fn="silu"),
        hidden_states=(2, 4, 2, 8, 12), timestep=torch.tensor([500, 500]), encoder_hidden_states=(2, 16, 16),
    ),
    "LTX2VideoTransformer3DModel": _built(
        "LTX2VideoTransformer3DModel",
        dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
             cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
             audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
             caption_channels=16, rope_double_precision=False, rope_type="split"),
        hidden_states=(2, 48, 4), audio_hidden_states=(2, 9, 4), encoder_hidden_states=(2, 7, 16),
        audio_encoder_hidden_states=(2, 7, 16), timestep=torch.tensor([500.0, 500.0]),
        encoder_attention_mask=torch.ones(2, 7).bool(), num_frames=2, height=4, width=6, audio_num_frames=9, fps=25.0,
    ),
    "HiDreamImageTransformer2DModel": _built(
        "HiDreamImageTransformer2DModel",
        dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
             num_attention_heads=4, caption_channels=[8, 4], text_emb_dim=8, num_routed_experts=2,
             num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32), llama_layers=(0, 1),
             force_inference_output=True),
        hidden_states=(2, 4, 32, 32), encoder_hidden_states_t5=(2, 8, 8), encoder_hidden_states_llama3=(2, 2, 6, 4),
        pooled_embeds=(2, 8), timesteps=torch.tensor([500, 500]),
    ),
    "Lumina2Transformer2DModel": _built(
        "Lumina2Transformer2DModel",
        dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2, num_refiner_layers=1,
             num_attention_heads=3, num_kv_heads=1, multiple_of=2, ffn_dim_multiplier=None, norm_eps=1e-5,
             scaling_factor=1.0, axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=32),
        hidden_states=(2, 4, 12, 20), timestep=torch.tensor([0.3, 0.3]), encoder_hidden_states=(2, 16, 32),
        encoder_attention_mask=torch.ones(2, 16, dtype=torch.bool),
    ),
    "LuminaNextDiT2DModel": _built(  # its pipeline's rotary table and softmax-scale base; the second caption padded
        "LuminaNextDiT2DModel", TRANSFORMERS["tiny-lumina-next"][1],
        hidden_states=(2, 4, 12, 20), timestep=torch.tensor([0.3, 0.3]), encoder_hidden_states=(2, 7, 32),
        encoder_mask=torch.tensor([[1] * 7, [1] * 4 + [0] * 3]), image_rotary_emb=_lumina_rotary(8),
        cross_attention_kwargs={"base_sequence_length": 16},
    ),
    "SkyReelsV2Transformer3DModel": _built("SkyReelsV2Transformer3DModel", _WAN, **_WAN_CALL),
    "ChronoEditTransformer3DModel": _built("ChronoEditTransformer3DModel", dict(_WAN, rope_temporal_skip_len=8), **_WAN_CALL),
    "WanVACETransformer3DModel": _built(
        "WanVACETransformer3DModel", dict(_WAN, num_layers=4, vace_layers=[0, 2], vace_in_channels=8),
        **_WAN_CALL, control_hidden_states=(2, 8, 3, 8, 12),
    ),
    "UNet2DModel": _built(  # DDPM's UNet: lone attention layers (group norm and residual inside) at its second level
        "UNet2DModel",
        dict(sample_size=16, in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
             norm_num_groups=8, attention_head_dim=8, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
             up_block_types=("AttnUpBlock2D", "UpBlock2D")),
        sample=(2, 3, 16, 16), timestep=torch.tensor([500, 500]),
    ),
    "StableCascadeUNet": _built(
        "StableCascadeUNet", _CASCADE, sample=(2, 4, 16, 16), timestep_ratio=torch.tensor([0.5, 0.5]), clip_text_pooled=(2, 1, 16),
    ),
    "Kandinsky3UNet": _built(  # Kandinsky 3: attention blocks (self, and cross to the text) on the feature map from
        "Kandinsky3UNet",  # its second level (half the latent) down
        dict(in_channels=4, time_embedding_dim=8, groups=2, attention_head_dim=4, layers_per_block=2,
             block_out_channels=(16, 32), cross_attention_dim=8, encoder_hid_dim=12),
        sample=(2, 4, 16, 16), timestep=torch.tensor([500, 500]), encoder_hidden_states=(2, 5, 12),
        encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
    ),
}
# Classes that merge and are checked in their own tests (module named).
MERGED_ELSEWHERE = {
    "SD3ControlNetModel": "test_transformers.py (pipelines)",
    "FluxControlNetModel": "test_transformers.py (pipelines)",
    "LatteTransformer3DModel": "test_transformers.py",
    "SparseControlNetModel": "test_video_controlnet.py",
}


def test_every_exported_class_is_merged_or_refused_with_its_own_reason():
    unclassified = [
        name for name in exported_models()
        if name not in MERGED and name not in MERGED_ELSEWHERE and name not in WRAPPERS and name not in REFUSED
    ]
    assert not unclassified, f"classify these diffusers model classes (merge and test them, or refuse them with a reason): {unclassified}"
    both = sorted(set(REFUSED) & (set(MERGED) | set(MERGED_ELSEWHERE)))
    assert not both, f"merged and refused at once: {both}"
    assert all(WRAPPERS[name] in MERGED or WRAPPERS[name] in MERGED_ELSEWHERE for name in WRAPPERS)


def test_refusal_reasons_are_the_classes_own():
    generic = "contains no transformer block ToMe knows"
    for name, reason in REFUSED.items():
        assert len(reason) > 40 and generic not in reason, name


MODELS_PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_the_models_page_says_what_the_registry_says():
    """docs/models.md: every merged class in its family table, every refusal with the registry's reason and no
    other, and the coverage counts as the installed diffusers gives them."""
    page = MODELS_PAGE.read_text()
    merged_part, refused_part = page.split("## Refused, and why", 1)
    for name in [*MERGED, *MERGED_ELSEWHERE, *WRAPPERS]:
        assert re.search(rf"\b{name}\b", merged_part), f"docs/models.md does not list {name} among the merged classes"
    rows = dict(re.findall(r"^\| (\w+) \| (.+) \|$", refused_part, flags=re.M))
    assert rows.pop("class") == "reason" and rows == REFUSED
    exported = exported_models()
    generation = [name for name in exported if name not in NOT_GENERATION]
    merging = [name for name in generation if name not in REFUSED]
    not_yet = sum(r.startswith("not supported yet") for r in REFUSED.values())
    counts = (
        f"{len(exported)} classes exported; {len(exported) - len(generation)} do not generate images or video",
        f"of the other {len(generation)}, **{len(merging)} merge** ({100 * len(merging) // len(generation)}%) and "
        f"{len(generation) - len(merging)} are refused" + (f", {not_yet} of them" if not_yet else ", each with its reason"),
    )
    flat = " ".join(page.split())
    for count in counts:
        assert count in flat
    readme = " ".join((MODELS_PAGE.parents[1] / "README.md").read_text().split())
    assert readme.count(f"{len(merging)} of the {len(generation)} ") == 2  # the opening and the support table


def test_the_models_page_lists_the_pipelines_checked_and_those_not_built():
    from tome_tools.diffusers_zoo_pipelines import NOT_BUILT, ZOO_PIPELINES

    part = MODELS_PAGE.read_text().split("## Pipelines checked end to end", 1)[1].split("\n## ", 1)[0]
    for recipe in ZOO_PIPELINES.values():
        assert re.search(rf"\b{recipe.pipeline}\b", part), recipe.pipeline
    for name, why in NOT_BUILT.items():
        assert f"| {name} | {why} |" in part


def test_the_models_page_snippet_runs_as_its_comments_say(capsys, tmp_path):
    """As a user runs it, outside the clone (tests/torch/test_readme.py), the tiny SD3 saved under the id it loads."""
    from .test_readme import SD35, outside_the_clone

    code = "\n".join(re.findall(r"```python\n(.*?)```", MODELS_PAGE.read_text(), flags=re.S))
    with warnings.catch_warnings(), outside_the_clone(tmp_path, {f"{SD35}/transformer": zoo.build_transformer("tiny-sd3")}):
        warnings.simplefilter("ignore")
        exec(compile(code, str(MODELS_PAGE), "exec"), {})
    printed = capsys.readouterr().out
    assert "2 blocks, 64 -> 32 tokens (50% merged; tokens, similarity)" in printed
    assert "ToMe cannot patch SanaTransformer2DModel: its self-attention is linear attention" in printed


def _flat(output: Any) -> torch.Tensor:
    """One vector of every tensor in a model's output (ControlNets return tuples of residuals)."""
    if isinstance(output, torch.Tensor):
        return output.reshape(-1)
    if isinstance(output, (tuple, list)):
        return torch.cat([_flat(item) for item in output if item is not None])
    if isinstance(output, dict) and not hasattr(output, "to_tuple"):  # Z-Image ControlNet's hints by layer
        return torch.cat([_flat(output[key]) for key in sorted(output)])
    return _flat(output.to_tuple())


def _run(model, inputs) -> torch.Tensor:
    tuples = {"return_dict": False} if "return_dict" in inspect.signature(model.forward).parameters else {}
    with torch.no_grad():
        return _flat(model(**inputs, **tuples))


def _attention_calls(model, inputs):
    """Per call of an attention module: (module name, image tokens in, text given to it or None)."""
    seen = []

    def record(module, args, kwargs, name):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        text = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
        # not compared: Cosmos' (text, image context) pair; the attention's own input given again (Lumina 2, OmniGen)
        text = text.clone() if isinstance(text, torch.Tensor) and text is not hidden else None
        seen.append([name, hidden.shape[1] if hidden.dim() == 3 else None, text])

    def keys(module, args):  # an attention merged at its projections: the tokens its key projection gets
        seen[-1][1] = args[0].shape[1]

    attentions = [(name, m) for name, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    handles = [
        module.register_forward_pre_hook(lambda m, a, k, n=name: record(m, a, k, n), with_kwargs=True)
        for name, module in attentions
    ]
    # the attentions of blocks on a feature map (UNet2DModel, Stable Cascade, Kandinsky 3) keep their own input
    # whole; ToMe merges what their projections get
    inside = {id(m) for block, family in blocks_of(FRAMEWORK, model) if family.feature_map for m in block.modules()}
    handles += [m.to_k.register_forward_pre_hook(keys) for _, m in attentions if id(m) in inside]
    try:
        output = _run(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return [tuple(call) for call in seen], output


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", sorted(MERGED))
def test_merged_class_against_the_unpatched_model(name):
    model, inputs = MERGED[name]()
    assert type(model).__name__ == name
    plain, reference = _attention_calls(model, inputs)
    assert torch.equal(_run(model, inputs), reference)
    with pytest.warns(UserWarning, match="merges no tokens"):
        tome.patch(model, ratio=0.0)
    assert torch.equal(_run(model, inputs), reference)
    tome.patch(model, ratio=0.5)
    merged, output = _attention_calls(model, inputs)
    assert torch.isfinite(output).all() and _rel(output, reference) > 1e-6
    assert torch.equal(_run(model, inputs), output)  # same inputs, same output
    assert [n for n, *_ in merged] == [n for n, *_ in plain]
    fewer = [n for (n, tokens, _), (_, before, _) in zip(merged, plain) if tokens is not None and tokens < before]
    more = [n for (n, tokens, _), (_, before, _) in zip(merged, plain) if tokens is not None and tokens > before]
    assert fewer and not more, (fewer, more)
    first_text = next(((t, p) for (_, _, t), (_, _, p) in zip(merged, plain) if p is not None), None)
    if first_text is not None:  # the text reaches the first attention that takes it untouched
        assert torch.equal(*first_text)
    tome.patch(model)  # the default
    assert torch.isfinite(_run(model, inputs)).all()
    tome.remove(model)
    assert torch.equal(_run(model, inputs), reference)
    assert not tome.patched_models(model)


def test_patch_refuses_a_listed_class_with_its_reason():
    model = diffusers.UNet1DModel(
        sample_size=16, in_channels=2, out_channels=2, block_out_channels=(8, 8, 8), extra_in_channels=16,
        down_block_types=("DownBlock1DNoSkip", "DownBlock1D", "AttnDownBlock1D"),
        up_block_types=("AttnUpBlock1D", "UpBlock1D", "UpBlock1DNoSkip"), mid_block_type="UNetMidBlock1D",
    )
    with pytest.raises(ValueError, match="ToMe cannot patch UNet1DModel: runs on 1-D signals"):
        tome.patch(model)
    assert refusal(type(model)) == REFUSED["UNet1DModel"]


def _nearest(rows: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
    """The distance of each row of ``rows`` to its nearest row of ``among`` (exact, unlike cdist's matmul)."""
    return (rows[:, None] - among[None]).norm(dim=-1).min(dim=1).values


def test_unet2d_attention_merges_after_its_norm_and_adds_its_whole_input_back():
    """UNet2DModel's Attention normalises its 4-D input and adds it back inside itself. In ToMe for SD's
    arrangement, what its query projection gets must be the means of the *normed* tokens over each merged group,
    and its output minus its input must be one value per group (the unmerged attention, the residual unmerged)."""
    model, inputs = MERGED["UNet2DModel"]()
    attention = next(m for m in model.modules() if isinstance(m, Attention))
    tome.patch(model, ratio=0.5)
    seen = {}
    handles = [
        attention.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0])),
        attention.to_q.register_forward_pre_hook(lambda m, a: seen.setdefault("q", a[0])),
        attention.register_forward_hook(lambda m, a, out: seen.setdefault("y", out)),
    ]
    _run(model, inputs)
    for handle in handles:
        handle.remove()
    x, y, q = seen["x"], seen["y"], seen["q"]
    tokens = lambda t: t.flatten(2).transpose(1, 2)  # noqa: E731
    normed = tokens(attention.group_norm(x))
    delta = tokens(y * attention.rescale_output_factor - x)
    assert q.shape[1] < normed.shape[1]
    for b in range(x.shape[0]):
        rows, groups = torch.unique(delta[b].round(decimals=4), dim=0, return_inverse=True)
        assert rows.shape[0] == q.shape[1]  # one attention output per merged token, the whole input added back
        means = torch.stack([normed[b][groups == g].mean(0) for g in range(rows.shape[0])])
        assert _nearest(means, q[b]).max() < 1e-4  # merged after the norm (its statistics over all tokens)
    tome.remove(model)


@pytest.mark.parametrize("pipeline", ["DDPMPipeline", "DDIMPipeline"])
def test_unconditional_pipelines_merge_end_to_end(pipeline):
    """DDPM's and DDIM's pipelines (a UNet2DModel and a scheduler) from tiny components: patched (ToMe for SD's
    arrangement and the default) they run finite and differ from the unpatched pipeline; removed, they match it."""
    unet = MERGED["UNet2DModel"]()[0]
    scheduler = getattr(diffusers, pipeline.replace("Pipeline", "Scheduler"))(num_train_timesteps=1000)
    pipe = getattr(diffusers, pipeline)(unet=unet, scheduler=scheduler)
    _pipeline_end_to_end(
        pipe, lambda: pipe(batch_size=2, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np").images,
    )


def test_unet2d_kv_arrangement_keeps_every_query_and_pools_normed_keys():
    """The default (mode="auto") on UNet2DModel: keys and values one per 2x2 cell, drawn from the normed tokens,
    every query kept; an attention processor that fuses its projections is refused at patch."""
    model, inputs = MERGED["UNet2DModel"]()
    attention = next(m for m in model.modules() if isinstance(m, Attention))
    tome.patch(model)
    seen = {}
    handles = [
        attention.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0])),
        attention.to_q.register_forward_pre_hook(lambda m, a: seen.setdefault("q", a[0])),
        attention.to_k.register_forward_pre_hook(lambda m, a: seen.setdefault("k", a[0])),
    ]
    _run(model, inputs)
    for handle in handles:
        handle.remove()
    normed = attention.group_norm(seen["x"]).flatten(2).transpose(1, 2)
    assert torch.equal(seen["q"], normed) and seen["k"].shape[1] * 4 == normed.shape[1]
    assert all(_nearest(k, n).max() < 1e-5 for k, n in zip(seen["k"], normed))  # each key one of the normed tokens
    tome.remove(model)
    attention.fuse_projections()
    attention.set_processor(diffusers.models.attention_processor.FusedAttnProcessor2_0())
    with pytest.raises(ValueError, match="does not run its query, key and value projections"):
        tome.patch(model)


# ---------------------------------------------------------------------------------------------------------
# The mechanisms the newer families need, each against its oracle: reference tokens after the grid pass through
# (Flux.2, Qwen-Image-Edit); calls whose tokens ToMe cannot place run unmerged and say so once (Lumina 2's uneven
# captions, HiDream's padded latents, LTX without sizes, Z-Image's multi-image lists); a sub-layer run twice merges
# its first call only (CogView4); tokens aligned with a sub-layer's input merge alike (Nucleus-MoE's router); a
# self-attention given a mask it cannot gather runs on all its tokens (SkyReels-V2's diffusion forcing); size-aware
# attention over [image; text] in one tensor equals attention over repeated tokens.


def _seen(model, inputs):
    """Token counts each attention module receives."""
    calls, output = _attention_calls(model, inputs)
    return [tokens for _, tokens, _ in calls], output


def _seen_by(model, inputs, group):
    """Token counts the attention modules receive, as sets by ``group(module name)`` (None: left out)."""
    calls, output = _attention_calls(model, inputs)
    seen: Dict[str, set] = {}
    for name, tokens, _ in calls:
        if group(name) is not None:
            seen.setdefault(group(name), set()).add(tokens)
    return seen, output


def test_flux2_reference_tokens_pass_through_and_the_output_grid_merges():
    model = zoo.build_transformer("tiny-flux2")
    inputs = zoo.transformer_inputs(model, 8, 12, batch=2)  # a 4x6 token grid
    reference = torch.zeros(6, 4)  # a 2x3 reference image at index 10, after the output's tokens
    reference[:, 0] = 10
    reference[:, 1] = torch.arange(2).repeat_interleave(3)
    reference[:, 2] = torch.arange(3).repeat(2)
    inputs["img_ids"] = torch.cat([inputs["img_ids"], reference])
    inputs["hidden_states"] = torch.cat([inputs["hidden_states"], torch.randn(2, 6, 4)], 1)
    plain = _run(model, inputs)
    tome.patch(model, ratio=0.5)
    seen, output = _seen(model, inputs)
    # double block: 12 kept + 6 reference tokens; single block: text 7 + 12 + 6
    assert seen == [12 + 6, 7 + 12 + 6]
    assert torch.isfinite(output).all() and _rel(output, plain) > 1e-6
    tome.remove(model)
    assert torch.equal(_run(model, inputs), plain)


def test_qwen_image_edit_reference_tokens_pass_through():
    model = zoo.build_transformer("tiny-qwen-image")
    inputs = zoo.transformer_inputs(model, 8, 12, batch=2)
    inputs["hidden_states"] = torch.cat([inputs["hidden_states"], torch.randn(2, 6, 16)], 1)
    inputs["img_shapes"] = [[(1, 4, 6), (1, 2, 3)]] * 2
    plain = _run(model, inputs)
    tome.patch(model, ratio=0.5)
    seen, output = _seen(model, inputs)
    assert seen == [12 + 6, 12 + 6]
    assert torch.isfinite(output).all()
    tome.remove(model)
    assert torch.equal(_run(model, inputs), plain)


def _warned_once(call, match):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = call()
        second = call()
    said = [str(w.message) for w in caught if match in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    return first, second


def test_lumina2_with_uneven_captions_runs_its_joint_blocks_unmerged_and_says_so_once():
    model, inputs = MERGED["Lumina2Transformer2DModel"]()
    inputs["encoder_attention_mask"] = torch.tensor([[True] * 16, [True] * 10 + [False] * 6])
    tome.patch(model, ratio=0.5)
    (seen, output), _ = _warned_once(lambda: _seen(model, inputs), "captions of different lengths")
    # its image refiner (image only) merges; its joint layers see every token
    assert seen[0] < 60 and seen[-1] == 16 + 60
    assert torch.isfinite(output).all()


def test_hidream_padded_non_square_latent_runs_unmerged_and_says_so():
    model, inputs = MERGED["HiDreamImageTransformer2DModel"]()
    inputs["hidden_states"] = torch.randn(2, 4, 24, 16)  # non-square: padded to its largest size, masked
    plain = _run(model, inputs)
    tome.patch(model, ratio=0.5)
    output, _ = _warned_once(lambda: _run(model, inputs), "hidden_states_masks")
    assert torch.equal(output, plain)
    summary = tome.patched_models(model)[0].state.summary()  # the reason, with the blocks it held
    assert "blocks unmerged: they got hidden_states_masks (a non-square latent padded" in summary and "->" not in summary, summary


def test_ltx_reads_its_grid_from_video_coords_after_conditioning_tokens():
    """LTX-Video's condition pipeline gives no sizes: its video_coords place [condition frame; 2 frames of 4x6],
    the condition's 24 tokens passing through as a head; coordinates of no grid run unmerged, said once."""
    model = zoo.build_video_transformer("tiny-ltx")
    grid = lambda frames, t0=0.0: torch.stack(torch.meshgrid(  # noqa: E731
        torch.arange(frames) * 8.0 + t0, torch.arange(4) * 32.0, torch.arange(6) * 32.0, indexing="ij")).flatten(1)
    inputs = zoo.video_transformer_inputs(model, 3, 4, 6, batch=2)  # 72 tokens: 24 of the condition, then 48
    inputs = {k: v for k, v in inputs.items() if k not in ("num_frames", "height", "width")}
    inputs["video_coords"] = torch.cat([grid(1), grid(2)], dim=1)[None].repeat(2, 1, 1)
    plain = _run(model, inputs)
    tome.patch(model, ratio=0.5)
    seen, output = _seen_by(model, inputs, lambda name: "attn1" if name.endswith("attn1") else None)
    assert seen == {"attn1": {24 + 24}}  # the condition's tokens whole, the video's half merged
    assert torch.isfinite(output).all() and _rel(output, plain) > 1e-6
    inputs["video_coords"] = torch.randn(2, 3, 72)
    tome.patch(model, ratio=0.5)
    output, _ = _warned_once(lambda: _run(model, inputs), "gave none of num_frames, height, width, video_coords")
    assert torch.isfinite(output).all()


def test_z_image_list_of_lists_runs_unmerged_and_says_so():
    model, inputs = MERGED["ZImageTransformer2DModel"]()
    tome.patch(model, ratio=0.5)
    state = tome.patched_models(model)[0].state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:  # the omni call needs more inputs than these; ToMe decides before the model runs
            model(x=[inputs["x"]], t=inputs["t"], cap_feats=[inputs["cap_feats"]])
        except Exception:
            pass
    assert sum("list of lists" in str(w.message) for w in caught) == 1
    assert not state.call.merging


def _feed_forward_calls(blocks, child):
    """Hooks recording the token counts of every call of each block's ``child`` (registered after ToMe's: they see
    what the sub-layer gets); returns the list and the handles."""
    seen = []
    record = lambda m, a, k: seen.append(tuple(t.shape[1] for t in a if isinstance(t, torch.Tensor)))  # noqa: E731
    return seen, [getattr(block, child).register_forward_pre_hook(record, with_kwargs=True) for block in blocks]


def test_cogview4_feed_forward_merges_its_image_call_and_runs_its_text_call_whole():
    model, inputs = MERGED["CogView4Transformer2DModel"]()
    seen, handles = _feed_forward_calls(model.transformer_blocks, "ff")
    plain = _run(model, inputs)
    assert seen == [(60,), (8,), (60,), (8,)]  # image tokens, then the text, in each block
    for handle in handles:
        handle.remove()
    tome.patch(model, ratio=0.5, merge_mlp=True)
    seen, _ = _feed_forward_calls(model.transformer_blocks, "ff")
    output = _run(model, inputs)
    assert seen == [(30,), (8,), (30,), (8,)]
    assert torch.isfinite(output).all() and _rel(output, plain) > 1e-6


def test_flux3_merges_the_output_image_only_and_its_reference_passes_through():
    model, inputs = MERGED["Flux3Transformer2DModel"]()
    tome.patch(model, ratio=0.5)
    seen, _ = _seen_by(model, inputs, lambda name: name.rsplit(".", 2)[0] if name.endswith(".attn") else None)
    assert seen["txt_mode_blocks"] == {5}  # the text's own blocks: never hooked
    assert seen["mode_blocks.image_cond"] == {16}  # the reference image's own blocks: never hooked
    assert seen["mode_blocks.image"] == {24}  # the output's 48 tokens, half merged
    assert seen["single_transformer_blocks"] == {5 + 24 + 16}  # [text; merged output; reference]


def test_framepack_merges_the_latent_and_its_history_before_it_passes_through():
    model, inputs = MERGED["HunyuanVideoFramepackTransformer3DModel"]()
    blocks = lambda name: name.split(".")[0] if name.endswith(".attn") and "transformer_blocks" in name else None  # noqa: E731
    unpatched, plain = _seen_by(model, inputs, blocks)
    tome.patch(model, ratio=0.5)
    seen, output = _seen_by(model, inputs, blocks)
    # 38 tokens of history and clean frames, then 3 frames of 4x4 latent tokens; the latent's half merged
    assert unpatched == {"transformer_blocks": {38 + 48}, "single_transformer_blocks": {38 + 48}}
    assert seen == {"transformer_blocks": {38 + 24}, "single_transformer_blocks": {38 + 24}}
    assert torch.isfinite(output).all() and _rel(output, plain) > 1e-6


def test_wan_vace_control_blocks_merge_like_its_main_blocks():
    model, inputs = MERGED["WanVACETransformer3DModel"]()
    tome.patch(model, ratio=0.5)
    seen, _ = _seen_by(model, inputs, lambda name: name.split(".")[0] if name.endswith("attn1") else None)
    assert seen == {"blocks": {36}, "vace_blocks": {36}}  # 3 frames of 4x6 tokens, half merged in both


def test_helios_merges_its_current_frames_and_counts_them_for_its_history_scale():
    """Helios' attention tells its history from original_context_length (it scales the history's keys): that
    count becomes the merged one; its cross-attention runs on the current frames alone (no head there)."""
    model, inputs = MERGED["HeliosTransformer3DModel"]()
    attentions = [(i, name, getattr(block, name)) for i, block in enumerate(model.blocks) for name in ("attn1", "attn2")]

    def seen(run):
        calls = {}
        handles = [
            module.register_forward_pre_hook(
                lambda m, a, k, key=(i, name): calls.setdefault(key, (a[0].shape[1], a[4] if len(a) > 4 else None)) and None,
                with_kwargs=True,
            )
            for i, name, module in attentions
        ]
        output = run()
        for handle in handles:
            handle.remove()
        return calls, output

    plain_calls, plain = seen(lambda: _run(model, inputs))
    tome.patch(model, ratio=0.5, merge_crossattn=True)
    calls, output = seen(lambda: _run(model, inputs))
    history = plain_calls[(0, "attn1")][0] - 64  # 2 frames of 4x8 current tokens after the history
    assert history > 0 and plain_calls[(0, "attn2")] == (64, 64)
    assert calls[(0, "attn1")] == (history + 32, 32) and calls[(0, "attn2")] == (32, 32)
    assert torch.isfinite(output).all() and _rel(output, plain) > 1e-6


def test_omnigen_merges_the_output_after_its_prompt_and_gathers_its_mask():
    model, inputs = MERGED["OmniGenTransformer2DModel"]()
    plain = _run(model, inputs)
    tome.patch(model, ratio=0.5)
    seen = []
    for layer in model.layers:  # registered after ToMe's hooks: what attention gets
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, k: seen.append((k["hidden_states"].shape[1], tuple(k["attention_mask"].shape[-2:]))), with_kwargs=True
        )
    output = _run(model, inputs)
    assert seen == [(22 + 8, (30, 30))] * 2  # 21 prompt tokens and the time token whole, the output's 16 halved
    assert torch.isfinite(output).all() and _rel(output, plain) > 1e-6


def test_nucleus_moe_router_tokens_merge_alike():
    model, inputs = MERGED["NucleusMoEImageTransformer2DModel"]()
    plain = _run(model, inputs)
    tome.patch(model, ratio=0.5, merge_mlp=True)
    seen, _ = _feed_forward_calls(model.transformer_blocks, "img_mlp")
    output = _run(model, inputs)
    assert (12, 12) in seen and set(seen) <= {(12,), (12, 12)}  # the MoE block's router tokens merged alike
    assert torch.isfinite(output).all() and _rel(output, plain) > 1e-6


def test_self_attention_with_a_mask_it_cannot_gather_runs_on_all_tokens():
    model, inputs = MERGED["SkyReelsV2Transformer3DModel"]()
    model._set_ar_attention(3)  # autoregressive diffusion forcing: a block-causal mask over blocks of 3 frames
    inputs = {**inputs, "hidden_states": torch.randn(2, 4, 6, 8, 12), "timestep": torch.tensor([[900] * 3 + [500] * 3] * 2)}
    inputs["enable_diffusion_forcing"] = True
    plain = _run(model, inputs)
    tome.patch(model, ratio=0.5, merge_mlp=True)
    seen = []
    for block in model.blocks:  # registered after ToMe's hooks: what attention gets
        block.attn1.register_forward_pre_hook(lambda m, a, k: seen.append((a[0].shape[1], len(a) > 2 and a[2] is not None)), with_kwargs=True)
    output, _ = _warned_once(lambda: _run(model, inputs), "given an attention_mask over its tokens")
    assert seen and all(masked and tokens == 144 for tokens, masked in seen)  # 6 frames of 4x6 tokens, all of them
    assert torch.isfinite(output).all() and _rel(output, plain) > 1e-6  # the feed-forward merged


def test_size_aware_attention_over_image_then_text_in_one_tensor_equals_repeated_tokens():
    torch.manual_seed(0)
    attention = Attention(query_dim=16, heads=2, dim_head=8).eval()
    generator = torch.Generator().manual_seed(1)
    tokens, text = 48, 7
    metric = torch.randn(2, tokens, 16, generator=generator)
    match = bipartite_matches(get_ops(metric), metric, 8, 6, 2, 2, [int(tokens * 0.6)], None, 0, False)[0]
    image = merge(torch.randn(2, tokens, 16, generator=generator), match)
    words = torch.randn(2, text, 16, generator=generator)
    merged_in = torch.cat([image, words], 1)
    plain_in = torch.cat([unmerge(image, match), words], 1)  # every merged token repeated once per token it holds
    args, kwargs = FRAMEWORK.size_aware(attention, (), {"hidden_states": merged_in}, SizeBias(match, TEXT_SUFFIX, image))
    try:
        with torch.no_grad():
            sized = attention(*args, **kwargs)
    finally:
        FRAMEWORK.size_aware_done(attention, computed=True)
    with torch.no_grad():
        plain = attention(hidden_states=plain_in)
        unsized = attention(hidden_states=merged_in)
    torch.testing.assert_close(unmerge(sized[:, : match.kept], match), plain[:, :tokens], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sized[:, match.kept :], plain[:, tokens:], rtol=1e-4, atol=1e-5)
    assert _rel(unmerge(unsized[:, : match.kept], match), plain[:, :tokens]) > 1e-3  # the oracle can fail


def test_a_key_mask_after_the_image_keeps_its_text_part_in_place():
    """Z-Image's stream is [image; image padding; caption; caption padding] with a key mask over all of it;
    the shorter caption is padded. Merged, each attention must get the unpatched mask with the image's part
    gathered for the kept image tokens and the rest (padding and caption, after the image) unchanged: its
    padding stays masked, no image token is."""
    model, inputs = _z_image()
    seen: Dict[str, List[torch.Tensor]] = {"unpatched": [], "patched": []}
    attentions = [m for name, m in model.named_modules() if name.endswith(".attention")]

    def record(arm):
        return [a.register_forward_pre_hook(lambda m, a, k: seen[arm].append(k["attention_mask"]), with_kwargs=True) for a in attentions]

    with torch.no_grad():
        handles = record("unpatched")
        model(**inputs)
        for handle in handles:
            handle.remove()
        tome.patch(model, ratio=0.5)
        handles = record("patched")  # after the patch's own hooks: what the attention gets
        model(**inputs)
    masked = [(u, p) for u, p in zip(seen["unpatched"], seen["patched"]) if u is not None and u.shape != p.shape]
    assert masked  # the main blocks merged: 60 image tokens -> 30
    for unpatched, patched in masked:
        merged = unpatched.shape[1] - patched.shape[1]
        assert torch.equal(patched[:, 60 - merged :], unpatched[:, 60:])  # padding and caption, in place
        assert bool(patched[:, : 60 - merged].all())  # every kept image token attends
        assert not bool(patched.all())  # the shorter caption's padding stays masked


def test_lumina_next_on_duplicated_tokens_equals_the_unpatched_model():
    """Lumina-Next's attention gets its queries' and keys' rotary tables apart, its own input again as keys, returns
    [B, N, heads, d], and scales its softmax by sqrt(log_b(queries)) with b from its pipeline. Oracle: with every
    2x2 cell of the token grid holding one token four times and rotary tables that rotate nothing, merging loses
    nothing (size-aware keys, identical queries), so the patched model equals the unpatched one while its
    attention sees half the tokens, both rotary tables gathered. The oracle catches a missing size bias and the
    scale of 30 queries (the base put back after the patch's hook): the base given keeps the logarithm of 60."""
    model, inputs = MERGED["LuminaNextDiT2DModel"]()
    cells = torch.randn(2, 4, 3, 1, 2, 5, 1, 2, generator=torch.Generator().manual_seed(4))  # (cell row, -, pixel...)
    inputs["hidden_states"] = cells.expand(2, 4, 3, 2, 2, 5, 2, 2).reshape(2, 4, 12, 20)  # 6x10 tokens in 2x2 cells
    inputs["image_rotary_emb"] = torch.ones(32, 32, 4, dtype=torch.complex64)
    plain = _run(model, inputs)
    tome.patch(model, ratio=0.5, use_rand=False, merge_crossattn=True, merge_mlp=True)
    seen = []
    for layer in model.layers:  # registered after ToMe's hooks: what attention gets
        layer.attn1.register_forward_pre_hook(lambda m, a, k: seen.append(
            (k["hidden_states"].shape[1], k["query_rotary_emb"].shape, k["key_rotary_emb"].shape, k["base_sequence_length"])
        ), with_kwargs=True)
    torch.testing.assert_close(_run(model, inputs), plain, rtol=1e-4, atol=1e-5)
    tokens, queries, keys, base = seen[0]
    assert len(seen) == 2 and tokens == 30 and queries == keys == (1, 30, 4)
    assert math.log(30, base) == pytest.approx(math.log(60, 16))
    tome.patch(model, ratio=0.5, use_rand=False, proportional_attn=False)
    assert _rel(_run(model, inputs), plain) > 1e-3
    tome.patch(model, ratio=0.5, use_rand=False)
    for layer in model.layers:
        layer.attn1.register_forward_pre_hook(lambda m, a, k: (a, {**k, "base_sequence_length": 16}), with_kwargs=True)
    assert _rel(_run(model, inputs), plain) > 1e-3


def test_joyimage_edit_plus_merges_its_target_and_gathers_its_mask_and_rotary_rows():
    """JoyImage-Edit-Plus's sequence is [target 4x6; references; padding] per item (shape_list), its key mask and its
    rotary table (cos, sin) [B, patches, d] over it. Merged, each attention gets the target's 24 patches halved, the
    unpatched mask and table with the target's rows gathered for the kept patches and every other row in place
    (the references', the padding's, still masked, and the text's). A batch whose targets differ in size runs
    unmerged, said once."""
    model, inputs = _joyimage_edit_plus()
    seen: Dict[str, list] = {"unpatched": [], "patched": []}

    def record(arm):
        return [
            block.attn.register_forward_pre_hook(
                lambda m, a, k: seen[arm].append((k["hidden_states"].shape[1], k["attention_mask"], k["image_rotary_emb"])),
                with_kwargs=True,
            )
            for block in model.double_blocks
        ]

    handles = record("unpatched")
    plain = _run(model, inputs)
    for handle in handles:
        handle.remove()
    tome.patch(model, ratio=0.5)
    record("patched")  # after the patch's own hooks: what the attention gets
    output = _run(model, inputs)
    assert torch.isfinite(output).all() and _rel(output, plain) > 1e-6
    for (tokens, mask, rotary), (kept, merged_mask, merged_rotary) in zip(seen["unpatched"], seen["patched"]):
        assert (tokens, kept) == (36, 24)  # 12 of the target's 24 patches, then 12 of references and padding
        assert torch.equal(merged_mask[..., 12:], mask[..., 24:]) and bool(merged_mask[..., :12].all())
        assert not bool(merged_mask[1, ..., 12 + 9 :].all())  # the second item's padding stays masked
        for table, merged_table in zip(rotary, merged_rotary):
            assert torch.equal(merged_table[:, 12:], table[:, 24:])
            assert all(any(torch.equal(row, t) for t in table[0, :24]) for row in merged_table[0, :12])
    inputs["shape_list"] = [[(1, 4, 6), (1, 2, 3), (1, 3, 2)], [(1, 3, 6), (1, 3, 6)]]
    (tokens, output), _ = _warned_once(lambda: _seen(model, inputs), "output images different sizes")
    assert tokens == [36, 36] and torch.isfinite(output).all()


def test_kandinsky6_merges_its_video_sublayers_and_its_audio_sees_every_video_token():
    """Kandinsky 6's fused block calls its video sub-layers through a nested block (video_dec_block, whose forward
    never runs) and the audio's through another of the same class. Merged, the video self-attention gets the
    2x4x6 = 48 tokens halved with the rows of the unpatched rotary table, the video cross-attention 24 queries and
    the text as it was, the video feed-forward 24 tokens; the audio's sub-layers get their unpatched shapes, and the cross-modal attentions every
    video token (as queries with their whole rotary table, and as the audio's keys). Without audio, the video path
    alone merges alike."""
    model, inputs = _built("Kandinsky6Transformer3DModel", _KANDINSKY6, **_KANDINSKY6_CALL)()

    def calls(arm):
        seen = []

        def record(name):
            def hook(module, args, kwargs):
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                context = kwargs.get("encoder_hidden_states")
                rotary = kwargs.get("rotary_emb", kwargs.get("rope_q"))
                seen.append((name, hidden.clone(), None if context is None else context.clone(), rotary))
            return hook

        handles = [
            module.register_forward_pre_hook(record(name), with_kwargs=True)
            for name, module in model.named_modules()
            if name.startswith("visual_transformer_blocks.0.") and name.endswith(("attention", "feed_forward"))
        ]
        try:
            output = _run(model, inputs)
        finally:
            for handle in handles:
                handle.remove()
        return seen, output

    plain, reference = calls("unpatched")
    tome.patch(model, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    merged, output = calls("patched")
    assert torch.isfinite(output).all() and _rel(output, reference) > 1e-6
    assert [n for n, *_ in merged] == [n for n, *_ in plain] and len(plain) == 8
    for (name, x, context, rotary), (_, merged_x, merged_context, merged_rotary) in zip(plain, merged):
        tokens, kept = x.shape[1], merged_x.shape[1]
        video = name.split(".")[2] == "video_dec_block"
        assert kept == (tokens // 2 if video else tokens), name
        if name.endswith("video_dec_block.self_attention"):
            assert tokens == 48 and merged_rotary.shape[0] == 24
            assert all(any(torch.equal(row, t) for t in rotary) for row in merged_rotary)
        elif name.endswith("video_dec_block.cross_attention"):
            assert torch.equal(context, merged_context)
        elif name.endswith("va_cross_attention"):
            assert tokens == 48 and torch.equal(rotary, merged_rotary)
        elif name.endswith("av_cross_attention"):
            assert context.shape[1] == merged_context.shape[1] == 48
    del inputs["audio_hidden_states"]
    tome.remove(model)
    plain, reference = calls("unpatched")
    tome.patch(model, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    merged, output = calls("patched")
    assert [(n, x.shape[1] // 2) for n, x, *_ in plain] == [(n, x.shape[1]) for n, x, *_ in merged] and len(merged) == 3
    assert torch.isfinite(output).all() and _rel(output, reference) > 1e-6


def test_kandinsky6_image_to_video_reference_frame_passes_through():
    """Kandinsky 6's image to video appends the clean reference frame to the 2 noisy ones, of token type 1 and at
    rotary position 0 (visual_token_type_ids, visual_rope_pos). Merged, the first block's self-attention gets the 48
    noisy tokens halved, then the reference frame's 24 tokens and their rotary rows exactly as unpatched; types that
    are not noisy frames then conditions run unmerged, said once."""
    types = torch.tensor([[0, 0, 1]] * 2)
    model, inputs = _built(
        "Kandinsky6Transformer3DModel", _KANDINSKY6, **{**_KANDINSKY6_CALL, "hidden_states": (2, 3, 8, 12, 9)},
        visual_token_type_ids=types, visual_rope_pos=(torch.tensor([0, 1, 0]), torch.arange(4), torch.arange(6)),
    )()
    attention = model.visual_transformer_blocks[0].video_dec_block.self_attention
    seen = []
    attention.register_forward_pre_hook(lambda m, a, k: seen.append((a[0].clone(), k["rotary_emb"])), with_kwargs=True)
    reference = _run(model, inputs)
    tome.patch(model, ratio=0.5)
    attention.register_forward_pre_hook(lambda m, a, k: seen.append((a[0].clone(), k["rotary_emb"])), with_kwargs=True)
    output = _run(model, inputs)
    assert torch.isfinite(output).all() and _rel(output, reference) > 1e-6
    (x, rotary), _, (merged_x, merged_rotary) = seen[0], seen[1], seen[2]  # each call: the hook before, and after the patch's
    assert (x.shape[1], merged_x.shape[1]) == (72, 48)
    assert torch.equal(merged_x[:, 24:], x[:, 48:]) and torch.equal(merged_rotary[24:], rotary[48:])
    assert all(any(torch.equal(row, t) for t in rotary[:48]) for row in merged_rotary[:24])
    inputs["visual_token_type_ids"] = torch.tensor([[0, 1, 0]] * 2)
    (tokens, output), _ = _warned_once(lambda: _seen(model, inputs), "visual_token_type_ids do not give noisy frames")
    assert 72 in tokens and 48 not in tokens and torch.isfinite(output).all()


@pytest.mark.parametrize("padded", [False, True], ids=["gist-first", "gist-padded-last"])
def test_bria_fibo2_merges_its_image_between_gist_and_context_tokens_wherever_the_gist_goes(padded):
    """Bria-FIBO 2's main blocks get one stream: the gist tokens (the text), the 4x6 image's 24 tokens, then a 2x3
    context image's 6; when the batch pads the gist (prompts of 8 and 2 text tokens: 8 and 4 gist tokens), the gist
    goes last, under a key mask. Merged (its first main block alone, whose input is then the unpatched one), the
    attention gets the image's tokens halved, every gist and context token, mask entry and rotary row exactly as
    unpatched, and the kept tokens' rotary rows from the image's."""
    model, inputs = _built("BriaFibo2Transformer2DModel", _BRIA_FIBO2, **_BRIA_FIBO2_CALL, **(_BRIA_FIBO2_PADDED if padded else {}))()
    attention = model.layers[0].attention
    seen = []

    def record():
        return attention.register_forward_pre_hook(
            lambda m, a, k: seen.append((a[0].clone(), k["attention_mask"], k["freqs_cis"])), with_kwargs=True
        )

    handle = record()
    reference = _run(model, inputs)
    handle.remove()
    tome.patch(model, ratio=0.5, blocks=[1])  # block 0 is the noise refiner's
    record()  # after the patch's hooks: what the attention gets
    output = _run(model, inputs)
    assert torch.isfinite(output).all() and _rel(output, reference) > 1e-6
    (x, mask, rotary), (merged_x, merged_mask, merged_rotary) = seen
    assert (x.shape[1], merged_x.shape[1]) == (38, 26)
    image, rest = (slice(0, 24), slice(24, None)) if padded else (slice(8, 32), slice(32, None))
    kept, merged_rest = (slice(0, 12), slice(12, None)) if padded else (slice(8, 20), slice(20, None))
    assert torch.equal(merged_x[:, merged_rest], x[:, rest]) and torch.equal(merged_rotary[:, merged_rest], rotary[:, rest])
    assert torch.equal(merged_x[:, :kept.start], x[:, :image.start])  # the gist in front (none when it goes last)
    assert torch.equal(merged_rotary[:, :kept.start], rotary[:, :image.start])
    assert all(any(torch.equal(row, r) for r in rotary[0, image]) for row in merged_rotary[0, kept])
    if padded:
        assert torch.equal(merged_mask[:, 12:], mask[:, 24:]) and bool(merged_mask[:, :12].all())
        assert not bool(merged_mask[1].all())  # the second prompt's padded gist stays masked
    else:
        assert mask is None and merged_mask is None


def test_qwen_image_21_merges_its_target_after_the_prefix_and_its_key_cache_stays_exact():
    """Qwen-Image 2.1's stream is [text with a condition image; target] and its attention block-causal: the prefix
    (11 tokens) never sees the target. Merged, the attention gets the prefix and the target's 24 tokens halved, the
    prefix's outputs equal the unpatched model's exactly, and its prefix key cache holds what it holds unpatched: the
    cached steps (the target alone, 12 tokens) give the patched prefill's target rows exactly. With the flex
    processor (a BlockMask it cannot gather) its attention runs on all tokens, said once, and its MLP still merges."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21FlexAttnProcessor, QwenImage21KVCache

    model, inputs = MERGED["QwenImage21Transformer2DModel"]()
    plain_cache = QwenImage21KVCache(2)
    with torch.no_grad():
        reference = model(**inputs, return_dict=False)[0]
        model(**inputs, kv_cache=plain_cache, kv_cache_mode="extract")
    tome.patch(model, ratio=0.5, merge_mlp=True)
    seen = []
    model.transformer_blocks[0].attn.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["hidden_states"].shape[1]), with_kwargs=True
    )
    cache = QwenImage21KVCache(2)
    with torch.no_grad():
        output = model(**inputs, return_dict=False)[0]
        extract = model(**inputs, kv_cache=cache, kv_cache_mode="extract", return_dict=False)[0]
        cached = model(**inputs, kv_cache=cache, kv_cache_mode="cached", return_dict=False)[0]
    assert seen == [11 + 12, 11 + 12, 12]
    assert torch.equal(output[:, :11], reference[:, :11]) and _rel(output[:, 11:], reference[:, 11:]) > 1e-6
    assert torch.equal(extract, output) and torch.equal(cached, output[:, 11:])
    for plain, merged in zip(plain_cache.layer_caches, cache.layer_caches):
        assert torch.equal(plain.k, merged.k) and torch.equal(plain.v, merged.v)
    tome.remove(model)
    model.set_attn_processor(QwenImage21FlexAttnProcessor())
    tome.patch(model, ratio=0.5, merge_mlp=True)
    seen.clear()
    model.transformer_blocks[0].img_mlp.register_forward_pre_hook(lambda m, a: seen.append(("mlp", a[0].shape[1])))
    (tokens, output), _ = _warned_once(lambda: _seen(model, inputs), "attn is given an attention_mask over its tokens")
    assert set(tokens) == {35} and seen[:2] == [35, ("mlp", 23)] and torch.isfinite(output).all()


def test_qwen_image_21_prefix_passes_through_the_kernel_under_kv():
    """Edges round three, 3: ``mode="kv"`` failed on Qwen-Image 2.1's prefix segments (an attention call over the
    head of text and condition images alone: a size bias had a branch for it, the kernel's keys none). The prefix
    now stays exact and the key cache's steps give the prefill's rows."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    model, inputs = MERGED["QwenImage21Transformer2DModel"]()
    with torch.no_grad():
        reference = model(**inputs, return_dict=False)[0]
    tome.patch(model, ratio=0.5, mode="kv")
    cache = QwenImage21KVCache(2)
    with torch.no_grad():
        output = model(**inputs, return_dict=False)[0]
        extract = model(**inputs, kv_cache=cache, kv_cache_mode="extract", return_dict=False)[0]
        cached = model(**inputs, kv_cache=cache, kv_cache_mode="cached", return_dict=False)[0]
    assert torch.allclose(output[:, :11], reference[:, :11], atol=1e-6)
    assert float((output[:, 11:] - reference[:, 11:]).abs().max()) > 1e-6
    assert torch.equal(extract, output) and torch.equal(cached, output[:, 11:])


def _cascade_pipeline(stage: str) -> Tuple[Any, Dict[str, Any]]:
    """Stable Cascade's prior (stage C: text, pooled text and image conditions, latents from the image size) or
    decoder (stage B: pooled text, the prior's image embeddings, a tiny Paella VQ-GAN) pipeline from tiny
    components, and its call's keyword arguments (text embeddings in place of its text encoder's output; a tiny
    text encoder is there for its dtype, which the pipelines read even when given the embeddings)."""
    import transformers
    from diffusers.pipelines.deprecated.wuerstchen.modeling_paella_vq_model import PaellaVQModel

    torch.manual_seed(3)
    encoder = transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
        vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, projection_dim=16,
    )).eval()

    generator = torch.Generator().manual_seed(2)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    text = dict(prompt_embeds=randn(1, 5, 16), prompt_embeds_pooled=randn(1, 1, 16))
    if stage == "prior":
        prior = zoo.random_transformer("StableCascadeUNet", dict(_CASCADE, clip_text_in_channels=16, clip_image_in_channels=8), 0)
        pipe = diffusers.StableCascadePriorPipeline(
            tokenizer=None, text_encoder=encoder, prior=prior, scheduler=diffusers.DDPMWuerstchenScheduler(), resolution_multiple=8.0,
        )
        negative = dict(negative_prompt_embeds=randn(1, 5, 16), negative_prompt_embeds_pooled=randn(1, 1, 16))
        return pipe, dict(text, **negative, height=128, width=128, guidance_scale=2.0)
    decoder = zoo.random_transformer("StableCascadeUNet", _CASCADE, 0)
    torch.manual_seed(1)
    vqgan = PaellaVQModel(bottleneck_blocks=1, num_vq_embeddings=2, embed_dim=16).eval()
    pipe = diffusers.StableCascadeDecoderPipeline(
        decoder=decoder, tokenizer=None, text_encoder=encoder, scheduler=diffusers.DDPMWuerstchenScheduler(), vqgan=vqgan,
    )
    return pipe, dict(text, image_embeddings=randn(1, 4, 4, 4), guidance_scale=0.0)


def _pipeline_end_to_end(pipe: Any, call: Callable[[], Any]) -> None:
    """``pipe`` patched (ToMe for SD's arrangement and the default) runs finite, merges and differs from itself
    unpatched; removed, it matches that again."""
    pipe.set_progress_bar_config(disable=True)
    reference = torch.as_tensor(call())
    for options in (dict(ratio=0.5), {}):
        tome.patch(pipe, **options)
        output = torch.as_tensor(call())
        assert torch.isfinite(output).all() and float((output - reference).abs().max()) > 1e-6
        assert tome.patched_models(pipe)[0].state.ledger.stats
    tome.remove(pipe)
    assert torch.equal(torch.as_tensor(call()), reference)


@pytest.mark.parametrize("stage", ["prior", "decoder"])
def test_stable_cascade_pipelines_merge_end_to_end(stage):
    """StableCascadePriorPipeline (classifier-free guidance, text and image conditions) and
    StableCascadeDecoderPipeline from tiny components."""
    pipe, kwargs = _cascade_pipeline(stage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the pipelines say they are deprecated
        _pipeline_end_to_end(pipe, lambda: _flat(pipe(
            **kwargs, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt", return_dict=False,
        )))


def test_kandinsky3_pipeline_merges_end_to_end():
    """Kandinsky3Pipeline from tiny components (its UNet, a tiny MoVQ), classifier-free guidance with a text mask."""
    unet = MERGED["Kandinsky3UNet"]()[0]
    torch.manual_seed(1)
    movq = diffusers.VQModel(
        block_out_channels=[32, 32], down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"], in_channels=3,
        latent_channels=4, layers_per_block=1, norm_num_groups=8, norm_type="spatial", num_vq_embeddings=12, out_channels=3,
        up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"], vq_embed_dim=4,
    ).eval()
    pipe = diffusers.Kandinsky3Pipeline(
        tokenizer=None, text_encoder=None, unet=unet, scheduler=diffusers.DDPMScheduler(beta_schedule="squaredcos_cap_v2"),
        movq=movq,
    )
    text = torch.randn(1, 5, 12, generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    _pipeline_end_to_end(pipe, lambda: pipe(
        prompt_embeds=text, negative_prompt_embeds=torch.zeros_like(text), attention_mask=mask,
        negative_attention_mask=torch.zeros_like(mask), height=128, width=128, num_inference_steps=2,
        generator=torch.Generator().manual_seed(0), output_type="np",
    ).images)


def test_amused_pipeline_merges_end_to_end():
    """AmusedPipeline from tiny components (its UVit, a tiny VQ model whose 32 codes it predicts; text embeddings in
    place of its CLIP text encoder), classifier-free guidance, 32x24 pixels: 16x12 codes, an 8x6 grid in its layers.
    Its output is discrete (codes sampled from the logits), so the logits its UVit gives are what must differ; its
    first step sees only mask tokens, all alike, which merge exactly."""
    transformer = _uvit()[0]
    torch.manual_seed(1)
    vqvae = diffusers.VQModel(
        block_out_channels=[8, 8], down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=4, num_vq_embeddings=32,
        vq_embed_dim=4, lookup_from_codebook=True, force_upcast=False,  # it decodes the codes (aMUSEd's VQ-GAN)
    ).eval()
    pipe = diffusers.AmusedPipeline(
        vqvae=vqvae, tokenizer=None, text_encoder=None, transformer=transformer,
        scheduler=diffusers.AmusedScheduler(mask_token_id=32),
    )
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(2)
    text = dict(
        prompt_embeds=torch.randn(1, 16, generator=generator), encoder_hidden_states=torch.randn(1, 5, 16, generator=generator),
        negative_prompt_embeds=torch.randn(1, 16, generator=generator),
        negative_encoder_hidden_states=torch.randn(1, 5, 16, generator=generator),
    )
    logits: List[torch.Tensor] = []
    hook = transformer.register_forward_hook(lambda module, args, output: logits.append(output))

    def call() -> Tuple[torch.Tensor, torch.Tensor]:
        logits.clear()
        image = pipe(**text, height=32, width=24, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np")
        return torch.as_tensor(image.images), torch.cat(logits)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the pipeline says it is deprecated
            reference, plain = call()
            for options in (dict(ratio=0.5), {}):
                tome.patch(pipe, **options)
                image, merged = call()
                assert image.shape == reference.shape and torch.isfinite(image).all() and torch.isfinite(merged).all()
                assert _rel(merged, plain) > 1e-6 and tome.patched_models(pipe)[0].state.ledger.stats
            tome.remove(pipe)
            image, unpatched = call()
    finally:
        hook.remove()
    assert torch.equal(image, reference) and torch.equal(unpatched, plain)


def _cascade_projections(model, inputs, **options):
    """Per SDCascadeAttnBlock of a patched StableCascadeUNet: (its self_attn flag, the condition's tokens it
    attends to, what its attention's query projection got, what its key projection got)."""
    tome.patch(model, **options)
    seen, handles = [], []
    for block in (m for m in model.modules() if type(m).__name__ == "SDCascadeAttnBlock"):
        call = {"self": block.self_attn}
        seen.append(call)
        handles += [  # after ToMe's hooks: they see what the projections get
            block.kv_mapper.register_forward_hook(lambda m, a, out, c=call: c.setdefault("cond", out)),
            block.attention.to_q.register_forward_pre_hook(lambda m, a, c=call: c.setdefault("q", a[0])),
            block.attention.to_k.register_forward_pre_hook(lambda m, a, c=call: c.setdefault("k", a[0])),
        ]
    _run(model, inputs)
    for handle in handles:
        handle.remove()
    tome.remove(model)
    return [(c["self"], c["cond"], c["q"], c["k"]) for c in seen]


def test_stable_cascade_merges_the_image_keys_before_the_condition_and_its_condition_only_blocks_as_cross():
    """Stable Cascade's attention block attends to [normed image; condition] (self_attn=True) or to the condition
    alone (self_attn=False). ToMe for SD's arrangement: the key projection gets the image part merged as the
    queries are, the condition's tokens after it exactly as they were; a condition-only block merges its queries
    as a cross-attention does (merge_crossattn) and never its keys. The default (kv in 2x2 cells) keeps every query. Blocks merge at
    the finest level unless max_downsample reaches the coarser one."""
    model, inputs = MERGED["StableCascadeUNet"]()
    fine = inputs["sample"].shape[-2] * inputs["sample"].shape[-1]
    calls = _cascade_projections(model, inputs, ratio=0.5, max_downsample=2, merge_crossattn=True)
    assert sorted(s for s, *_ in calls) == [False, False, True, True]
    for self_attn, cond, q, k in calls:
        tokens = fine if self_attn else fine // 4  # the condition-only level is the coarser one here
        assert q.shape[1] == tokens // 2
        if self_attn:
            assert k.shape[1] == q.shape[1] + cond.shape[1] and torch.equal(k[:, q.shape[1]:], cond)
            assert torch.allclose(k[:, : q.shape[1]], q, atol=1e-6, rtol=0)
        else:
            assert torch.equal(k, cond)
    for self_attn, cond, q, k in _cascade_projections(model, inputs, ratio=0.5, merge_crossattn=True):  # the coarser level unmerged
        assert q.shape[1] == (fine // 2 if self_attn else fine // 4)
    for self_attn, cond, q, k in _cascade_projections(model, inputs):  # the default
        assert q.shape[1] == (fine if self_attn else fine // 4)
        assert torch.equal(k, cond) if not self_attn else k.shape[1] == fine // 4 + cond.shape[1]


def test_kandinsky3_merges_after_its_block_norm_and_its_cross_attention_keeps_the_text_and_its_mask():
    """Kandinsky 3's attention block norms the feature map (a conditional group norm over every token), attends
    and adds the result back. ToMe for SD's arrangement: a self-attention's query projection gets the means of the
    normed tokens over each merged group, its key projection the same merged tokens, and the attention returns
    one row per group (unmerged before the residual); a cross-attention (merge_crossattn) merges its queries
    alone: its keys are the text as given, its text mask passes untouched."""
    model, inputs = MERGED["Kandinsky3UNet"]()
    tome.patch(model, ratio=0.5, merge_crossattn=True)
    calls, handles = [], []
    for block in (m for m in model.modules() if type(m).__name__ == "Kandinsky3AttentionBlock"):
        attention = block.attention
        handles += [  # after ToMe's hooks: they see what the projections get
            block.in_norm.register_forward_hook(lambda m, a, out: calls.append({"normed": out})),
            attention.register_forward_pre_hook(lambda m, a: calls[-1].update(x=a[0], context=a[1], mask=a[2])),
            attention.to_q.register_forward_pre_hook(lambda m, a: calls[-1].setdefault("q", a[0])),
            attention.to_k.register_forward_pre_hook(lambda m, a: calls[-1].setdefault("k", a[0])),
            attention.register_forward_hook(lambda m, a, out: calls[-1].update(y=out)),
        ]
    _run(model, inputs)
    for handle in handles:
        handle.remove()
    tome.remove(model)
    assert {c["context"] is c["x"] for c in calls} == {True, False}  # self- and cross-attention blocks both ran
    for call in calls:
        normed, q, k, y = call["normed"].flatten(2).transpose(1, 2), call["q"], call["k"], call["y"]
        assert torch.equal(call["x"], normed) and q.shape[1] == normed.shape[1] // 2
        if call["context"] is call["x"]:
            assert torch.equal(k, q) and call["mask"] is None
        else:
            assert torch.equal(k, call["context"]) and call["mask"] is not None
        for b in range(y.shape[0]):  # one attention output per merged token, each the attention of a normed mean
            rows, groups = torch.unique(y[b].round(decimals=5), dim=0, return_inverse=True)
            assert rows.shape[0] == q.shape[1]
            means = torch.stack([normed[b][groups == g].mean(0) for g in range(rows.shape[0])])
            assert _nearest(means, q[b]).max() < 1e-4


def test_stable_cascade_stage_b_merges_from_its_finest_level_with_attention():
    """Stage B (the decoder) has no attention at its two finest levels: ToMe's default finest level is the first
    one with attention (here the second, half the patch grid, after a stride-2 downscaler), so its blocks merge by
    default, and the coarser level joins with max_downsample. Stage C's two levels share one grid: both merge."""
    layers = [["SDCascadeResBlock", "SDCascadeTimestepBlock"]] + [_CASCADE["block_types_per_layer"][0]] * 2
    stage_b = dict(
        _CASCADE, block_out_channels=[16, 32, 32], num_attention_heads=[0, 2, 2], down_num_layers_per_block=[1] * 3,
        up_num_layers_per_block=[1] * 3, down_blocks_repeat_mappers=[1] * 3, up_blocks_repeat_mappers=[1] * 3,
        self_attn=True, dropout=[0.0] * 3, block_types_per_layer=layers, patch_size=2,
    )
    inputs = dict(sample=torch.randn(2, 4, 16, 16), timestep_ratio=torch.tensor([0.5, 0.5]), clip_text_pooled=torch.randn(2, 1, 16))
    for config, options, levels in (
        (stage_b, {}, {2}), (stage_b, dict(max_downsample=4), {2, 4}), (dict(_CASCADE, switch_level=[False], self_attn=True), {}, {1}),
    ):
        model = zoo.random_transformer("StableCascadeUNet", config, 0)
        tome.patch(model, ratio=0.5, **options)
        _run(model, inputs)
        stats = tome.patched_models(model)[0].state.ledger.stats
        assert set(stats) == levels and all(level.blocks == (2 if config is stage_b else 4) for level in stats.values())


def _first_attention(model, inputs) -> Dict[str, torch.Tensor]:
    """What the first block's attention of an Ideogram 4 model gets: its tokens, mask and rotary (cos, sin)."""
    seen: Dict[str, torch.Tensor] = {}

    def record(module, args, kwargs):
        if not seen:
            cos, sin = kwargs["image_rotary_emb"]
            seen.update(x=args[0].clone(), mask=kwargs["attention_mask"].clone(), cos=cos.clone(), sin=sin.clone())

    handle = model.layers[0].attention.register_forward_pre_hook(record, with_kwargs=True)
    try:
        output = _run(model, inputs)
    finally:
        handle.remove()
    return {**seen, "output": output}


def test_ideogram4_image_run_told_by_its_indicator_merges_and_every_other_row_reaches_attention_as_unpatched():
    """Ideogram 4's pipeline packs [left padding; text; image] per row, the padding as long as the prompt is short:
    the indicator, not the order, tells the image's tokens. Its first attention must get every padding and text
    row (tokens, both axes of the segment mask, rotary rows) exactly as unpatched, and half the image's 48 tokens,
    each with an unpatched image token's rotary row and mask entries."""
    model, inputs = MERGED["Ideogram4Transformer2DModel"]()
    head, image = 5, 48
    plain = _first_attention(model, inputs)
    assert plain["x"].shape[1] == head + image
    tome.patch(model, ratio=0.5)
    merged = _first_attention(model, inputs)
    tome.remove(model)
    kept = head + image // 2
    assert merged["x"].shape[1] == kept and merged["mask"].shape[-2:] == (kept, kept)
    assert torch.equal(merged["x"][:, :head], plain["x"][:, :head])
    assert torch.equal(merged["mask"][..., :head, :head], plain["mask"][..., :head, :head])
    # image entries of the mask: each row's text entries, and within the image, as any unpatched image token's
    assert torch.equal(merged["mask"][..., head:, :head], plain["mask"][..., head : head + 1, :head].expand(-1, -1, image // 2, -1))
    assert torch.equal(merged["mask"][..., :head, head:], plain["mask"][..., :head, head : head + 1].expand(-1, -1, -1, image // 2))
    assert merged["mask"][..., head:, head:].all() and plain["mask"][..., head:, head:].all()
    for table in ("cos", "sin"):
        assert torch.equal(merged[table][:, :head], plain[table][:, :head])
        for b in range(2):
            assert (_nearest(merged[table][b, head:], plain[table][b, head:]) == 0).all()
    assert _rel(merged["output"], plain["output"]) > 1e-6


def test_ideogram4_rows_packing_samples_merge_the_last_image_where_every_row_has_it_in_place():
    """Rows that each pack two samples [text; image] at the same places: the last sample's 2x4 image merges, and
    every token before it (the first sample, whole) and after it (padding) reaches the first attention as unpatched,
    with its mask entries and rotary rows. A batch whose rows place them differently (the pipeline's row beside a
    packed one) runs unmerged, equal to the unpatched model, and says why once."""
    model, inputs = _ideogram4(packed=(0, 1))
    plain = _first_attention(model, inputs)
    tome.patch(model, ratio=0.5)
    merged = _first_attention(model, inputs)
    head, image, tail = 28, 8, 17
    length = head + image + tail
    assert plain["x"].shape[1] == length and merged["x"].shape[1] == length - image // 2
    kept = list(range(head)) + list(range(length - image // 2 - tail, length - image // 2))
    same = list(range(head)) + list(range(length - tail, length))
    for name in ("x", "cos", "sin"):
        assert torch.equal(merged[name][:, kept], plain[name][:, same])
    assert torch.equal(merged["mask"][..., kept, :][..., kept], plain["mask"][..., same, :][..., same])
    _, mixed = _ideogram4(packed=(1,))
    with pytest.warns(UserWarning, match="rows packing other samples elsewhere"):
        output = _run(model, mixed)
    tome.remove(model)
    assert torch.equal(output, _run(model, mixed))


def test_minimax_h3_video_run_told_by_its_tags_merges_and_text_condition_and_audio_rows_pass_as_unpatched():
    """MiniMax-H3's layout [text (4); condition frame (24, tagged video too); audio (6); video (72)], shared by the
    batch: the first attention gets every row before the video's last run (text, the condition frame, audio) and
    its rotary rows exactly as unpatched, and half the video's 3x4x6 tokens, each with an unpatched video token's
    rotary row; the model's outputs keep their shapes (the video velocity for all 96 video rows)."""
    model, inputs = MERGED["MiniMaxH3Transformer3DModel"]()
    seen = []

    def record(module, args):
        if not seen:
            seen.append((args[0].clone(), *(table.clone() for table in args[1])))

    def run():  # the hook added last, after the patch's own
        handle = model.transformer_blocks[0].attn.register_forward_pre_hook(record)
        with torch.no_grad():
            output = model(**inputs, return_dict=False)
        handle.remove()
        return output

    plain = run()
    (x, cos, sin), seen[:] = seen[0], []
    tome.patch(model, ratio=0.5)
    merged = run()
    tome.remove(model)
    mx, mcos, msin = seen[0]
    head, video = 4 + 24 + 6, 72
    assert x.shape[1] == head + video and mx.shape[1] == head + video // 2 and mcos.shape[0] == head + video // 2
    assert torch.equal(mx[:, :head], x[:, :head])
    for table, whole in ((mcos, cos), (msin, sin)):
        assert torch.equal(table[:head], whole[:head])
        assert (_nearest(table[head:], whole[head:]) == 0).all()
    assert [t.shape for t in merged] == [t.shape for t in plain] and _rel(merged[0], plain[0]) > 1e-6


def _calls(module: torch.nn.Module, record: Callable[..., Any], **options: Any) -> Tuple[List[Any], Any]:
    """The list that gets what ``record(args, kwargs)`` gives at each call of ``module`` (``prepend=True``: before
    ToMe's hooks, on the unmerged input), and the hook's handle."""
    seen: List[Any] = []
    handle = module.register_forward_pre_hook(lambda m, a, k: seen.append(record(a, k)), with_kwargs=True, **options)
    return seen, handle


def _hidden(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """A call's ``hidden_states`` (its first input)."""
    return kwargs.get("hidden_states", args[0] if args else None)


def _merged_on(metric: torch.Tensor, grid: Tuple[int, int], shared: bool) -> Any:
    """ToMe for SD's match at ratio 0.5 (fixed partition, 2x2 cells) of the ``grid`` tokens first in ``metric``."""
    tokens = grid[0] * grid[1]
    return bipartite_matches(get_ops(metric), metric[:, :tokens], *grid, 2, 2, [tokens // 2], None, 0, shared)[0]


@pytest.mark.parametrize("mode", [None, "control_layers"])
def test_z_image_control_blocks_merge_their_control_tokens_on_the_main_streams_match(mode):
    """A control block gets [hints; control stream] first and the main stream x [image; caption] second: its
    sub-layers run on the control stream, merged with the match of x's 6x10 image tokens (as VACE's for Wan),
    caption and padding in place. With add_control_noise_refiner="control_layers" the blocks run first on the
    image tokens alone, then on [image; caption]."""
    model, inputs = _z_image_controlnet(mode)
    tome.patch(model, ratio=0.5, use_rand=False)
    block = model.control_layers[1]  # the one given the stack [hint; stream] of the first
    main, first = _calls(block, lambda a, k: k.get("x", a[1] if len(a) > 1 else None))
    whole, hook = _calls(block.attention, _hidden, prepend=True)
    merged, last = _calls(block.attention, _hidden)
    try:
        _run(model, inputs)
    finally:
        for handle in (first, hook, last):
            handle.remove()
    assert len(main) == len(whole) == len(merged) == (2 if mode else 1)
    for x, unmerged, got in zip(main, whole, merged):
        match = _merged_on(x, (6, 10), shared=True)  # rotary rows: one match for the batch
        assert got.shape[1] == unmerged.shape[1] - 30
        assert torch.equal(got[:, : match.kept], merge(unmerged[:, :60], match))
        assert torch.equal(got[:, match.kept :], unmerged[:, 60:])  # padding and caption in place
        own = _merged_on(unmerged, (6, 10), shared=True)  # matched on the control tokens: another merge
        assert not torch.equal(got[:, : own.kept], merge(unmerged[:, :60], own))


def test_z_image_controlnet_runs_its_transformers_refiner_unmerged_and_its_hints_drive_the_patched_transformer():
    """The ControlNet runs the Z-Image transformer's own noise refiner (from_transformer): the transformer's patch
    hooks it, and outside the transformer's call it runs on every token, so patching the transformer leaves the
    ControlNet's hints exact; the patched ControlNet's hints keep every token and drive the patched transformer."""
    transformer, inputs = _z_image()
    controlnet, control = _z_image_controlnet(transformer=transformer)
    with torch.no_grad():
        hints = controlnet(**control)
        plain = _flat(transformer(**inputs, controlnet_block_samples=hints, return_dict=False))
    tome.patch(transformer, ratio=0.5)
    refined, handle = _calls(transformer.noise_refiner[0].attention, lambda a, k: _hidden(a, k).shape[1])
    try:
        with torch.no_grad():
            again = controlnet(**control)
            assert refined == [64]  # the ControlNet's call: 6x10 image tokens and 4 of padding, unmerged
            assert all(torch.equal(again[key], hints[key]) for key in hints)
            tome.patch(controlnet, ratio=0.5)
            merged = controlnet(**control)
            output = _flat(transformer(**inputs, controlnet_block_samples=merged, return_dict=False))
    finally:
        handle.remove()
    assert refined == [64, 64, 34]  # the transformer's own call merges it: 30 of the 60 image tokens
    assert {key: value.shape for key, value in merged.items()} == {key: value.shape for key, value in hints.items()}
    assert all(_rel(merged[key], hints[key]) > 1e-6 for key in hints)
    assert torch.isfinite(output).all() and _rel(output, plain) > 1e-6


def test_uvit_merges_its_transformer_layers_on_the_grid_its_down_block_gives():
    """aMUSEd's UVit flattens its down block's (B, C, 8, 6) output (VQ codes 16x12, downsampled) into the tokens
    of its transformer layers: the down block's output gives their grid (its ModelLayout.grid_source), so a layer's
    self-attention gets the tokens merged on that 8x6 grid (a 6x8 grid merges others); the cross-attention-only
    blocks inside the down and up blocks (SkipFFTransformerBlock) see every token."""
    model, inputs = _uvit()
    tome.patch(model, ratio=0.5, use_rand=False)
    layer = model.transformer_layers[0]
    metric, first = _calls(layer, _hidden)
    whole, hook = _calls(layer.attn1, _hidden, prepend=True)
    merged, last = _calls(layer.attn1, _hidden)
    skip, skipped = _calls(model.up_block.attention_blocks[0].attn1, lambda a, k: _hidden(a, k).shape[1])
    try:
        _run(model, inputs)
    finally:
        for handle in (first, hook, last, skipped):
            handle.remove()
    match = _merged_on(metric[0], (8, 6), shared=False)
    assert torch.equal(merged[0], merge(whole[0], match)) and merged[0].shape[1] == 24
    wrong = _merged_on(metric[0], (6, 8), shared=False)
    assert not torch.equal(merged[0], merge(whole[0], wrong))
    assert skip == [48]
    assert "2 blocks, 48 -> 24 tokens" in tome.patched_models(model)[0].state.summary()
