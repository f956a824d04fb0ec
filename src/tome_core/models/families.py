"""What ToMe needs to know about each transformer block family and model class, as data (framework-free).

A :class:`BlockFamily` says which sub-layers of a block merge and where image and text tokens sit in them; a
:class:`ModelLayout` says what a model class's call and children tell beyond that (its grid, children that never
merge). The driver reads both through :func:`block_family` and :func:`model_layout`. Classes are named, not imported,
so the tables serve diffusers, ppdiffusers and any library that keeps diffusers' class names; ``"library:Class"``
(``"ldm:BasicTransformerBlock"``) names that library's class alone and wins over the bare name.

Adding a model family:

1. A block class laid out as an existing family's: its name in that family's ``classes``; a new layout: one
   :class:`BlockFamily` in :data:`BLOCK_FAMILIES` (shared sub-layers as a named tuple, such as ``_SELF_CROSS_MLP``).
2. A model class whose call places its tokens otherwise than its latent's shape over ``patch_size`` or its packed
   ids: one :class:`ModelLayout` in :data:`MODEL_LAYOUTS`, and a new reader in :mod:`tome_core.models.grid_readers`
   where none knows the placement.
3. Blocks that attend across frames: :data:`TEMPORAL`; a 2-D container whose input is its blocks' grid:
   :data:`GRID_CONTAINERS`; a class ToMe must refuse: :data:`tome_core.models.model_zoo.REFUSED`.
4. A mechanism no family has yet is code in :mod:`tome_core.hooks.block_hooks`, built once for every family.
5. Tests: a tiny config in ``tests/torch/test_zoo.py`` (``MERGED``) and a row in ``docs/models.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

# Where a sub-layer's attention finds text tokens beside the (merged) image tokens.
TEXT_NONE = "none"  # none: self-attention over the image tokens (or cross-attention to a separate context)
TEXT_AFTER = "after"  # joint attention over [image; text], text from ``encoder_hidden_states`` (SD3)
TEXT_BEFORE = "before"  # joint attention over [text; image], text from ``encoder_hidden_states`` (Flux)
TEXT_PREFIX = "prefix"  # the sub-layer's own input is [text; image] (Flux's single-stream block)
TEXT_SUFFIX = "suffix"  # the sub-layer's own input is [image; text] (HunyuanVideo's single-stream MLP)


def text_follows(text: str) -> bool:
    """Whether the text tokens come after the image's (``[image; text]``) in what a sub-layer with this ``text``
    attends to: its keys, the rows of its rotary tables and of its token masks."""
    return text in (TEXT_AFTER, TEXT_SUFFIX)


@dataclass(frozen=True)
class Sublayer:
    """One sub-layer of a block that runs on merged image tokens.

    child: the block's attribute holding it; a dotted path into a nested block whose own ``forward`` is never called
        (Kandinsky 6's ``video_dec_block.self_attention``); ``""``: the block itself.
    kind: the option that selects it and the ratio it uses: "attn", "crossattn" or "mlp".
    text: where text tokens sit in its input or attention (``TEXT_*``).
    output: index of the image stream when it returns a tuple (joint attention), else None.
    extra_outputs: further image-token outputs of that tuple (an IP-Adapter processor's), unmerged like ``output``.
    attention: its keys are its own merged tokens, so size-aware attention applies.
    kv_input: the keyword through which the attention takes keys and values apart from its queries (diffusers'
        ``encoder_hidden_states``); the ``kv`` and ``queries`` arrangements need one.
    text_if: a block flag that, when true, makes it attend to the text, not its own tokens (``only_cross_attention``).
    text_unless: a block flag that does so when false (Stable Cascade's ``self_attn``); merged as ``crossattn`` then.
    masks: ``(argument, token axes)`` of masks over its ``[text; image; tail]`` tokens (Chroma's ``attention_mask``
        ``[B, 1, L, L]``: axes -2 and -1), gathered like the rotary positions. No axes: a text-only mask that the
        processor extends itself. A self-attention given an ``attention_mask`` not listed runs unmerged.
    once: the block runs it on its image tokens, then on others (CogView4's ``ff`` on the text): only the first merges.
    aligned: arguments carrying the same tokens as its input (Lumina 2's ``encoder_hidden_states``): merged alike.
    counts: arguments giving how many of its input's tokens are the grid's (Helios' ``original_context_length``).
    log_bases: arguments giving the base of a logarithm of its query count that scales its softmax (Lumina-Next's
        ``base_sequence_length``): given the base under which the merged count keeps the unmerged model's scale.
    projections: ``(query, key, value, output)`` children of an attention that keeps its norm and residual inside
        itself (UNet2DModel's): ToMe merges at its projections' inputs and unmerges the output projection's output,
        so the norm and residual see every token (``kv``: key and value only; ``tokens``: the query's too).
    """

    child: str
    kind: str
    text: str = TEXT_NONE
    output: Optional[int] = None
    extra_outputs: Tuple[int, ...] = ()
    attention: bool = False
    kv_input: Optional[str] = None
    text_if: Optional[str] = None
    text_unless: Optional[str] = None
    masks: Tuple[Tuple[str, Tuple[int, ...]], ...] = ()
    once: bool = False
    aligned: Tuple[str, ...] = ()
    counts: Tuple[str, ...] = ()
    log_bases: Tuple[str, ...] = ()
    projections: Tuple[str, ...] = ()


def attends_text_only(block: Any, sublayer: Sublayer) -> bool:
    """Whether ``block``'s flags make ``sublayer``'s attention attend to the text instead of its own tokens
    (:attr:`Sublayer.text_if`, :attr:`Sublayer.text_unless`): it then has no keys of its own tokens to merge."""
    if sublayer.text_if is not None and getattr(block, sublayer.text_if, False):
        return True
    return sublayer.text_unless is not None and not getattr(block, sublayer.text_unless, True)


@dataclass(frozen=True)
class BlockFamily:
    """A transformer block class (by name) and the sub-layers ToMe wraps; the match is computed from its first input.

    rotary: the sub-layers' argument carrying rotary embeddings ``(cos, sin)`` of ``[text; image]`` tokens: merged
        tokens take their destination's position, and the batch shares one match.
    key_rotary: the keys' own rotary table, laid out as ``rotary``'s (Lumina-Next's ``key_rotary_emb``).
    rotary_axis: the token axis of those tables (Flux: ``[tokens, dim]``; Wan: ``[1, tokens, 1, dim]``).
    rotary_items: which items of the rotary tuple hold token positions (None: all; Qwen-Image: its image table).
    stream: where text sits in the block's own input (``TEXT_NONE``, ``TEXT_PREFIX`` or ``TEXT_SUFFIX``).
    timesteps: the largest timestep its pipeline passes (1 where it passes sigmas): bounds ``timestep_range``.
    timesteps_rise: its timestep rises while sampling (Z-Image), so a falling one starts a generation.
    unmerged_with: ``(argument, why)``: a block argument whose presence leaves the image tokens unplaced (Lumina 2's
        mask for captions of different lengths): such calls run unmerged, said once.
    sequence_first: the block's own input is ``[S, B, C]`` (ERNIE-Image's); its sub-layers get theirs batch-first.
    text_after_with: a block argument whose presence puts the text after the image in that call
        (:func:`with_text_after`; Bria-FIBO 2's padded gist).
    feature_map: the block's input is a ``(B, C, H, W)`` feature map, which gives its grid and its tokens.
    models: the model classes inside which alone its classes are blocks (diffusers' ``Attention``); empty: everywhere.
    metric: the block argument the match is computed from where its first input is not the grid's stream (Z-Image's
        ControlNet blocks: ``x``); None: the first input.
    text_input: the block argument whose tokens the block itself puts beside its image stream in what its sub-layers
        run on (FLUX.1's single-stream block joins its ``encoder_hidden_states`` in front): with them counted, its
        matches carry them (:func:`joined_text`).
    """

    name: str
    classes: Tuple[str, ...]
    sublayers: Tuple[Sublayer, ...]
    rotary: Optional[str] = None
    key_rotary: Optional[str] = None
    rotary_axis: int = 0
    rotary_items: Optional[Tuple[int, ...]] = None
    stream: str = TEXT_NONE
    timesteps: float = 1000.0
    timesteps_rise: bool = False
    unmerged_with: Optional[Tuple[str, str]] = None
    sequence_first: bool = False
    text_after_with: Optional[str] = None
    feature_map: bool = False
    models: Tuple[str, ...] = ()
    metric: Optional[str] = None
    text_input: Optional[str] = None


def joined_text(family: BlockFamily) -> Optional[str]:
    """Where text sits (``TEXT_PREFIX`` or ``TEXT_SUFFIX``) in what every sub-layer of ``family`` runs on, if they all
    run on one sequence of text and image tokens, its block's input or (:attr:`BlockFamily.text_input`) the block's
    join of text and input: then a match may carry the text (:attr:`~tome_core.algorithm.match.Match.joined`), so
    that merge, unmerge, size bias and rotary positions run on the whole sequence with no concatenation. None
    elsewhere (and where a sub-layer also reads counts or other arguments of its tokens, or merges inside itself)."""
    texts = {sublayer.text for sublayer in family.sublayers}
    text = texts.pop() if len(texts) == 1 else None
    if text not in (TEXT_PREFIX, TEXT_SUFFIX) or (family.stream != text and family.text_input is None) or any(
        sublayer.counts or sublayer.aligned or sublayer.projections or sublayer.once for sublayer in family.sublayers
    ):
        return None
    return text


def with_text_after(family: BlockFamily) -> BlockFamily:
    """``family`` in a call whose text follows the image (:attr:`BlockFamily.text_after_with`): text before the
    image, in the block's stream and in its sub-layers, reads as after it (``[text; image; tail]`` as ``[image;
    tail; text]``). Kept per family in a plain dict (read in calls a compiler traces, which warns of lru_cache)."""
    if family not in _TEXT_AFTER:
        after = {TEXT_PREFIX: TEXT_SUFFIX, TEXT_BEFORE: TEXT_AFTER}
        _TEXT_AFTER[family] = replace(
            family, stream=after.get(family.stream, family.stream), text_after_with=None,
            sublayers=tuple(replace(s, text=after.get(s.text, s.text)) for s in family.sublayers),
        )
    return _TEXT_AFTER[family]


_TEXT_AFTER: Dict[BlockFamily, BlockFamily] = {}


_FF = Sublayer("ff", "mlp")
# Self-attention, cross-attention to the text, an MLP (LTX-Video, Hunyuan-DiT, Cosmos, Allegro): diffusers' names.
_SELF_CROSS_MLP = (Sublayer("attn1", "attn", attention=True), Sublayer("attn2", "crossattn"), _FF)
# diffusers' BasicTransformerBlock: the same, its self-attention's keys and values apart from encoder_hidden_states.
_BASIC = (
    Sublayer("attn1", "attn", attention=True, kv_input="encoder_hidden_states", text_if="only_cross_attention"),
    *_SELF_CROSS_MLP[1:],
)
# Wan's block (and AnyFlow's copy): the same sub-layers, its MLP named ffn.
_WAN = (*_SELF_CROSS_MLP[:2], Sublayer("ffn", "mlp"))
# Joint attention over [text; image] and over [image; text] (the image's output first).
_JOINT_BEFORE = Sublayer("attn", "attn", text=TEXT_BEFORE, output=0, attention=True)
_JOINT_AFTER = Sublayer("attn", "attn", text=TEXT_AFTER, output=0, attention=True)
# Attention and MLP side by side on one [text; image] sequence (AuraFlow's, FLUX.3's and Krea 2's single blocks).
_PREFIX_ATTN_FF = (Sublayer("attn", "attn", text=TEXT_PREFIX, attention=True), Sublayer("ff", "mlp", text=TEXT_PREFIX))
# FLUX.1's double-stream block: joint attention over [text; image], an image MLP; its single-stream block: attention
# and MLP side by side on one normalised [text; image] sequence.
_FLUX_DOUBLE = (replace(_JOINT_BEFORE, extra_outputs=(2,)), _FF)
_FLUX_SINGLE = (_PREFIX_ATTN_FF[0], Sublayer("proj_mlp", "mlp", text=TEXT_PREFIX))
_KEY_MASK = (("attention_mask", (-1,)),)
_TEXT_MASK = ("attention_mask", ())  # a text-only mask its processor extends over the image tokens
# HunyuanVideo's double block: joint attention over [image; text] with a key mask over both; an image MLP.
_HUNYUAN_DOUBLE = (replace(_JOINT_AFTER, masks=_KEY_MASK), _FF)
_HUNYUAN_SINGLE = (_HUNYUAN_DOUBLE[0], Sublayer("proj_mlp", "mlp", text=TEXT_SUFFIX))  # the MLP on [image; text]
_COG_JOINT = replace(_JOINT_BEFORE, child="attn1")  # CogVideoX's, CogView's and EasyAnimate's
_JOYIMAGE = (_JOINT_AFTER, Sublayer("img_mlp", "mlp"))
_PADDED = ("hidden_states_masks", "a non-square latent padded to the largest size, the padding masked")
_Q_K_V_OUT = ("to_q", "to_k", "to_v", "to_out.0")


def _masked(sublayers: Tuple[Sublayer, ...], mask: Tuple[str, Tuple[int, ...]]) -> Tuple[Sublayer, ...]:
    """``sublayers`` with ``mask`` gathered at each attention."""
    return tuple(replace(s, masks=(mask,)) if s.kind == "attn" else s for s in sublayers)


_Z_IMAGE = BlockFamily(  # Z-Image: one stream [image; padding; caption; padding]
    "z-image", ("ZImageTransformerBlock",),
    (
        Sublayer("attention", "attn", text=TEXT_SUFFIX, attention=True, masks=_KEY_MASK),
        Sublayer("feed_forward", "mlp", text=TEXT_SUFFIX),
    ),
    rotary="freqs_cis", rotary_axis=1,  # complex, one per token [B, L, d/2]
    stream=TEXT_SUFFIX, timesteps=1.0, timesteps_rise=True,
)

BLOCK_FAMILIES: Tuple[BlockFamily, ...] = (
    # SD 1.x/2.x/XL UNets, ControlNets, PixArt, DiT; DreamLite's variant (attn1 may be absent)
    BlockFamily("basic", ("BasicTransformerBlock", "BasicTransformerBlockDreamLite"), _BASIC),
    # diffusers' Flax SD UNets and ControlNets: FlaxAttention takes its keys and values from context
    BlockFamily("flax-basic", ("FlaxBasicTransformerBlock",), (replace(_BASIC[0], kv_input="context"), *_BASIC[1:])),
    BlockFamily(  # the ldm UNetModel's (A1111-style UIs, sdkit): disable_self_attn makes attn1 attend to the context
        "ldm-basic", ("ldm:BasicTransformerBlock",),
        (replace(_BASIC[0], kv_input="context", text_if="disable_self_attn"), *_BASIC[1:]),
    ),
    # SD3 / SD3.5 (attn2: SD3.5's second, image-only self-attention)
    BlockFamily("mmdit", ("JointTransformerBlock",), (_JOINT_AFTER, Sublayer("attn2", "attn", attention=True), _FF)),
    BlockFamily(  # FLUX.1 and the models that copy its blocks: LongCat-Image, Ovis-Image
        "flux-double", ("FluxTransformerBlock", "LongCatImageTransformerBlock", "OvisImageTransformerBlock"),
        _FLUX_DOUBLE, rotary="image_rotary_emb", timesteps=1.0,
    ),
    BlockFamily(
        "flux-single",
        ("FluxSingleTransformerBlock", "LongCatImageSingleTransformerBlock", "OvisImageSingleTransformerBlock"),
        _FLUX_SINGLE, rotary="image_rotary_emb", timesteps=1.0, text_input="encoder_hidden_states",
    ),
    # Bria: FLUX.1's blocks; its pipelines pass the scheduler's timesteps (0-1000)
    BlockFamily("bria-double", ("BriaTransformerBlock",), _FLUX_DOUBLE, rotary="image_rotary_emb"),
    BlockFamily(
        "bria-single", ("BriaSingleTransformerBlock",), _FLUX_SINGLE, rotary="image_rotary_emb",
        text_input="encoder_hidden_states",
    ),
    # Bria-FIBO: a key-padding mask over [text; image] at every attention; its single blocks are handed [text; image]
    BlockFamily(
        "bria-fibo-double", ("BriaFiboTransformerBlock",), _masked(_FLUX_DOUBLE, _KEY_MASK[0]),
        rotary="image_rotary_emb",
    ),
    BlockFamily(
        "bria-fibo-single", ("BriaFiboSingleTransformerBlock",), _masked(_FLUX_SINGLE, _KEY_MASK[0]),
        rotary="image_rotary_emb", stream=TEXT_PREFIX,
    ),
    BlockFamily(  # Flux.2 (dev, Klein)
        "flux2-double", ("Flux2TransformerBlock",), _FLUX_DOUBLE, rotary="image_rotary_emb", timesteps=1.0,
    ),
    BlockFamily(  # one fused attention + MLP sub-layer
        "flux2-single", ("Flux2SingleTransformerBlock",), _PREFIX_ATTN_FF[:1],
        rotary="image_rotary_emb", stream=TEXT_PREFIX, timesteps=1.0,
    ),
    BlockFamily(  # Chroma: FLUX.1's blocks with an attention mask over [text; image] on both token axes
        "chroma-double", ("ChromaTransformerBlock",), _masked(_FLUX_DOUBLE, ("attention_mask", (-2, -1))),
        rotary="image_rotary_emb", timesteps=1.0,
    ),
    BlockFamily(
        "chroma-single", ("ChromaSingleTransformerBlock",), _masked(_FLUX_SINGLE, ("attention_mask", (-2, -1))),
        rotary="image_rotary_emb", stream=TEXT_PREFIX, timesteps=1.0,
    ),
    BlockFamily(  # Qwen-Image (+ Edit, Layered, ControlNet): rotary (image table, text table), complex
        "qwen-image", ("QwenImageTransformerBlock",), (_JOINT_BEFORE, Sublayer("img_mlp", "mlp")),
        rotary="image_rotary_emb", rotary_items=(0,), timesteps=1.0,
    ),
    BlockFamily(
        # Wan 2.1/2.2 (and its copies: Animate, ChronoEdit, SkyReels-V2). VACE's control blocks run on control tokens
        # of the same grid, matched on the main stream's (their first input)
        "wan", ("WanTransformerBlock", "SkyReelsV2TransformerBlock", "WanVACETransformerBlock"),
        _WAN, rotary="rotary_emb", rotary_axis=1,
    ),
    BlockFamily(  # HunyuanVideo (and FramePack's, which reuses its blocks); rotary over the image tokens only
        "hunyuan-video-double", ("HunyuanVideoTransformerBlock", "HunyuanVideoTokenReplaceTransformerBlock"),
        _HUNYUAN_DOUBLE, rotary="image_rotary_emb",
    ),
    BlockFamily(
        "hunyuan-video-single",
        ("HunyuanVideoSingleTransformerBlock", "HunyuanVideoTokenReplaceSingleTransformerBlock"),
        _HUNYUAN_SINGLE, rotary="image_rotary_emb",
    ),
    BlockFamily(  # HunyuanVideo 1.5: its processor extends the text-only mask over the (merged) image tokens
        "hunyuan-video-15", ("HunyuanVideo15TransformerBlock",), _masked(_HUNYUAN_DOUBLE, _TEXT_MASK),
        rotary="image_rotary_emb",
    ),
    BlockFamily(  # CogVideoX (1.0, 1.5), ConsisID: joint attention over [text; image], the MLP on [text; image]
        "cogvideox", ("CogVideoXBlock", "ConsisIDBlock"), (_COG_JOINT, _PREFIX_ATTN_FF[1]), rotary="image_rotary_emb",
    ),
    BlockFamily(  # LTX-2: video tokens (audio in a second stream, never merged); rotary tables [B, (heads,) tokens, d]
        "ltx2", ("LTX2VideoTransformerBlock",),
        (*_SELF_CROSS_MLP[:2], Sublayer("audio_to_video_attn", "crossattn"), _FF),  # video queries, audio keys
        rotary="query_rotary_emb", rotary_axis=-2,
    ),
    BlockFamily(  # LTX-Video: rotary tables [B, tokens, dim]
        "ltx", ("LTXVideoTransformerBlock",), _SELF_CROSS_MLP, rotary="image_rotary_emb", rotary_axis=1,
    ),
    # CogView3-Plus: joint attention over [text; image]; the MLP on [text; image]
    BlockFamily("cogview3plus", ("CogView3PlusTransformerBlock",), (_COG_JOINT, _PREFIX_ATTN_FF[1])),
    BlockFamily(  # CogView4 (and GLM-Image's blocks): the MLP runs on the image, then on the text
        "cogview4", ("CogView4TransformerBlock", "GlmImageTransformerBlock"),
        (_COG_JOINT, Sublayer("ff", "mlp", once=True)), rotary="image_rotary_emb",
    ),
    # Hunyuan-DiT: rotary positions reach the cross-attention's queries too
    BlockFamily("hunyuan-dit", ("HunyuanDiTBlock",), _SELF_CROSS_MLP, rotary="image_rotary_emb"),
    BlockFamily("auraflow-joint", ("AuraFlowJointTransformerBlock",), (_JOINT_BEFORE, _FF), timesteps=1.0),
    BlockFamily(  # its model hands it [registers; text; image]
        "auraflow-single", ("AuraFlowSingleTransformerBlock",), _PREFIX_ATTN_FF, stream=TEXT_PREFIX, timesteps=1.0,
    ),
    # HunyuanImage 2.1: HunyuanVideo's blocks on one frame
    BlockFamily("hunyuan-image-double", ("HunyuanImageTransformerBlock",), _HUNYUAN_DOUBLE, rotary="image_rotary_emb"),
    BlockFamily(
        "hunyuan-image-single", ("HunyuanImageSingleTransformerBlock",), _HUNYUAN_SINGLE, rotary="image_rotary_emb",
    ),
    BlockFamily(  # Cosmos (Predict 2 / 2.5): rotary over the image tokens; pipelines pass sigmas
        "cosmos", ("CosmosTransformerBlock",), _SELF_CROSS_MLP, rotary="image_rotary_emb", timesteps=1.0,
    ),
    _Z_IMAGE,
    # Z-Image's ControlNet: its block's sub-layers run on the last of a stack of control streams [k, B, L, C], laid
    # out as the main stream x (its second input), on whose grid and match they merge; its hints stay whole
    replace(_Z_IMAGE, name="z-image-control", classes=("ZImageControlTransformerBlock",), metric="x"),
    BlockFamily(  # Lumina-Image 2.0: one stream [caption; image] (its image refiner: image only)
        "lumina2", ("Lumina2TransformerBlock",),
        (
            Sublayer("attn", "attn", text=TEXT_PREFIX, attention=True, aligned=("encoder_hidden_states",)),
            Sublayer("feed_forward", "mlp", text=TEXT_PREFIX),
        ),
        rotary="image_rotary_emb", rotary_axis=1, stream=TEXT_PREFIX, timesteps=1.0, timesteps_rise=True,
        unmerged_with=("attention_mask", "captions of different lengths put the image at a different offset per item"),
    ),
    # HiDream-I1: rotary 2x2 rotation matrices per token [B, L, 1, d/2, 2, 2] over [image; text]; a non-square latent
    # is padded to its largest size, with a key mask over the padding (such calls run unmerged)
    BlockFamily(
        "hidream-double", ("HiDreamImageTransformerBlock",),
        (replace(_JOINT_AFTER, child="attn1"), Sublayer("ff_i", "mlp")),
        rotary="image_rotary_emb", rotary_axis=1, unmerged_with=_PADDED,
    ),
    BlockFamily(  # its model hands it [image; text] in one tensor
        "hidream-single", ("HiDreamImageSingleTransformerBlock",),
        (Sublayer("attn1", "attn", text=TEXT_SUFFIX, attention=True), Sublayer("ff_i", "mlp", text=TEXT_SUFFIX)),
        rotary="image_rotary_emb", rotary_axis=1, stream=TEXT_SUFFIX, unmerged_with=_PADDED,
    ),
    BlockFamily(  # Mochi: joint attention over [image; text], the text mask extended by its processor
        "mochi", ("MochiTransformerBlock",), (replace(_JOINT_AFTER, child="attn1", masks=(_TEXT_MASK,)), _FF),
        rotary="image_rotary_emb",
        timesteps_rise=True,  # its scheduler inverts the sigmas: 1000 * (1 - sigma)
    ),
    BlockFamily(  # Allegro: rotary as coordinate tables and per-token positions [1, N] (item 1, which moves)
        "allegro", ("AllegroTransformerBlock",), _SELF_CROSS_MLP,
        rotary="image_rotary_emb", rotary_axis=1, rotary_items=(1,),
    ),
    BlockFamily(  # EasyAnimate: joint attention over [text; image]; blocks past its MMDiT ones run ff on the text too
        "easyanimate", ("EasyAnimateTransformerBlock",),
        (_COG_JOINT, Sublayer("ff", "mlp", once=True)), rotary="image_rotary_emb",
    ),
    BlockFamily(  # Nucleus-MoE-Image: image queries over [image; text] keys; its MoE routes on unmodulated tokens
        "nucleus-moe", ("NucleusMoEImageTransformerBlock",),
        (
            Sublayer("attn", "attn", text=TEXT_AFTER, attention=True, masks=_KEY_MASK),
            Sublayer("img_mlp", "mlp", aligned=("hidden_states_unmodulated",)),
        ),
        rotary="image_rotary_emb", rotary_items=(0,), timesteps=1.0,
    ),
    BlockFamily(  # Kandinsky 5: its visual blocks (its text blocks run on the text alone and are never hooked)
        "kandinsky5", ("Kandinsky5TransformerDecoderBlock",),
        (
            Sublayer("self_attention", "attn", attention=True),
            Sublayer("cross_attention", "crossattn"),
            Sublayer("feed_forward", "mlp"),
        ),
        rotary="rotary_emb", rotary_axis=1,
        unmerged_with=("sparse_params", "NABLA sparse attention reorders the tokens into 8x8-token tiles"),
    ),
    BlockFamily(  # Kandinsky 6: a fused video-audio block that calls its video sub-layers inside a nested block
        "kandinsky6",  # (never its forward); its audio path and the cross-modal attentions run on all tokens
        ("Kandinsky6FusedTransformerDecoderBlock",),
        (
            Sublayer("video_dec_block.self_attention", "attn", attention=True),
            Sublayer("video_dec_block.cross_attention", "crossattn"),
            Sublayer("video_dec_block.feed_forward", "mlp"),
        ),
        rotary="rotary_emb",  # [tokens, 1, d/2, 2, 2] rotation matrices
    ),
    BlockFamily(  # PRX: image queries over [text; image] keys, a text-only mask; its MLP is inline (never merged)
        "prx", ("PRXBlock",),
        (Sublayer("attention", "attn", text=TEXT_BEFORE, attention=True, masks=(_TEXT_MASK,)),),
        rotary="image_rotary_emb", rotary_axis=2, timesteps=1.0,
    ),
    BlockFamily(  # Krea 2: its model hands it [text; image] (a key-padding mask over both); ids tell the grid
        "krea2", ("Krea2TransformerBlock",), _masked(_PREFIX_ATTN_FF, _KEY_MASK[0]),
        rotary="image_rotary_emb", stream=TEXT_PREFIX, timesteps=1.0,
    ),
    BlockFamily(  # AnyFlow: Wan's blocks; rotary tables by name ({"query": ..., "key": ...}) [1, 1, tokens, d/2]
        "anyflow", ("AnyFlowTransformerBlock",), _WAN, rotary="rotary_emb", rotary_axis=2,
    ),
    BlockFamily(  # Motif-Video: HunyuanVideo's double block, with an optional text cross-attention
        "motif-video-double", ("MotifVideoTransformerBlock",),
        (*_HUNYUAN_DOUBLE, Sublayer("cross_attn", "crossattn")), rotary="image_rotary_emb",
    ),
    BlockFamily(  # its decoder layers take the image tokens of the main stack as their "text"
        "motif-video-single", ("MotifVideoSingleTransformerBlock",),
        (_HUNYUAN_DOUBLE[0], Sublayer("cross_attn", "crossattn"), Sublayer("proj_mlp", "mlp", text=TEXT_SUFFIX)),
        rotary="image_rotary_emb",
    ),
    BlockFamily(  # FLUX.3's per-mode blocks (the image mode's; attention and MLP side by side on the image)
        "flux3-mode", ("Flux3ModeTransformerBlock",),
        (Sublayer("attn", "attn", attention=True), _FF), rotary="image_rotary_emb", timesteps=1.0,
    ),
    BlockFamily(  # its joint blocks: the block gets [image; references], its sub-layers [text; image; references]
        "flux3-single", ("Flux3SingleTransformerBlock",), _PREFIX_ATTN_FF, rotary="image_rotary_emb", timesteps=1.0,
    ),
    BlockFamily(  # Helios: Wan's blocks on [history at three resolutions; current frames], rotary [B, tokens, d]
        "helios", ("HeliosTransformerBlock",),
        (
            Sublayer("attn1", "attn", attention=True, counts=("original_context_length",)),
            Sublayer("attn2", "crossattn", counts=("original_context_length",)),  # on the current frames alone
            Sublayer("ffn", "mlp"),
        ),
        rotary="rotary_emb", rotary_axis=1,
    ),
    BlockFamily(  # OmniGen: one stream [prompt with input images; time token; output image], its attention mask
        "omnigen",  # over all of it (both axes); the attention gets its input again as encoder_hidden_states
        ("OmniGenBlock",),
        (
            Sublayer(
                "self_attn", "attn", attention=True, masks=(("attention_mask", (-2, -1)),), aligned=("encoder_hidden_states",),
            ),
            Sublayer("mlp", "mlp"),
        ),
        rotary="image_rotary_emb", timesteps=1.0,
    ),
    BlockFamily(  # ERNIE-Image: one [image; text] stream, sequence-first in the block; its attention gets it
        "ernie-image",  # batch-first with a key mask and one rotary table over both; its MLP runs sequence-first
        ("ErnieImageSharedAdaLNBlock",),
        (Sublayer("self_attention", "attn", text=TEXT_SUFFIX, attention=True, masks=_KEY_MASK),),
        rotary="image_rotary_emb", rotary_axis=1, stream=TEXT_SUFFIX, sequence_first=True,
    ),
    BlockFamily(  # JoyImage-Edit: image and text streams apart, joint attention over [image; text], an image MLP;
        "joyimage",  # rotary (cos, sin) per stream, the image's first; its edit items follow the target as a tail
        ("JoyImageTransformerBlock",), _JOYIMAGE, rotary="image_rotary_emb", rotary_items=(0,),
    ),
    BlockFamily(  # JoyImage-Edit-Plus: as JoyImage-Edit, with a key mask over [image patches; text] and one rotary
        "joyimage-edit-plus",  # table (cos, sin) [B, patches, d] per batch item, over the image patches only
        ("JoyImageEditPlusTransformerBlock",), _masked(_JOYIMAGE, _KEY_MASK[0]),
        rotary="image_rotary_emb", rotary_axis=1,
    ),
    BlockFamily(  # Lumina-Next: attention and cross-attention side by side on the image, their outputs
        "lumina-next",  # [B, N, heads, d] summed before one projection; queries' and keys' rotary tables apart
        ("LuminaNextDiTBlock",),
        (
            Sublayer(
                "attn1", "attn", attention=True, masks=_KEY_MASK, aligned=("encoder_hidden_states",),
                log_bases=("base_sequence_length",),
            ),
            Sublayer("attn2", "crossattn"),
            Sublayer("feed_forward", "mlp"),
        ),
        rotary="query_rotary_emb", key_rotary="key_rotary_emb", rotary_axis=1, timesteps=1.0,
        timesteps_rise=True,  # its pipeline passes 1 - t / 1000
    ),
    BlockFamily(  # Bria-FIBO 2: Z-Image's block on one stream [gist; image; context images], the gist a Perceiver's
        "bria-fibo2",  # summary of the text; [image; context; gist] under a key mask when the batch pads the gist
        ("BriaFibo2TransformerBlock",),
        (
            Sublayer("attention", "attn", text=TEXT_PREFIX, attention=True, masks=_KEY_MASK),
            Sublayer("cross_attention", "crossattn", text=TEXT_PREFIX),  # its injection blocks' (to the text)
            Sublayer("feed_forward", "mlp", text=TEXT_PREFIX),
        ),
        rotary="freqs_cis", rotary_axis=1,  # one complex table [1, tokens, d/2] over the stream
        stream=TEXT_PREFIX, timesteps=1.0, text_after_with="attn_mask",
    ),
    BlockFamily(  # Qwen-Image 2.1: one stream [text with condition images; target image] (ModelLayout.grid_last),
        "qwen-image-21",  # its attention block-causal (the prefix never sees the target), prefilled segment by segment;
        ("QwenImage21TransformerBlock",),  # its cached steps run on the target alone, the prefix's keys cached before it
        (
            Sublayer(
                "attn", "attn", text=TEXT_BEFORE, attention=True, masks=(("key_valid", (-1,)), ("attention_mask", (-1,))),
            ),
            Sublayer("img_mlp", "mlp"),
        ),
        rotary="rotary_emb", timesteps=1.0,  # one complex table [tokens, d/2] over the stream
    ),
    BlockFamily(  # UNet2DModel (DDPM, LDM): each Attention of its ResNet-style blocks, on the 4-D feature map, with
        "unet2d-attention",  # its group norm and residual inside
        ("Attention",),
        (Sublayer("", "attn", attention=True, projections=_Q_K_V_OUT),),
        feature_map=True, models=("UNet2DModel",),
    ),
    BlockFamily(  # Stable Cascade (Würstchen v3) stages B and C: an attention block on the 4-D feature map, its
        "cascade-attention",  # norm and residual in the block, the attention's own group norm absent
        ("SDCascadeAttnBlock",),
        (
            Sublayer(
                "attention", "attn", text=TEXT_AFTER, attention=True, text_unless="self_attn", projections=_Q_K_V_OUT,
            ),
        ),
        feature_map=True,
        timesteps=1.0,  # its timestep_ratio, from 1 to 0 while sampling
    ),
    BlockFamily(  # Kandinsky 3's attention block on the 4-D feature map: conditional group norm, attention (self, or
        "kandinsky3-attention",  # cross to the text) and residual, then a 1x1-convolution MLP, all in the block
        ("Kandinsky3AttentionBlock",),
        (Sublayer("attention", "attn", attention=True, projections=_Q_K_V_OUT),),
        feature_map=True,
    ),
    BlockFamily(  # Ideogram 4: one packed stream [left padding; text; image] per row (ModelLayout.roles place the
        "ideogram4",  # image), a segment mask over it on both axes and an MRoPE table (cos, sin) [B, tokens, d]
        ("Ideogram4TransformerBlock",),
        (
            Sublayer("attention", "attn", text=TEXT_PREFIX, attention=True, masks=(("attention_mask", (-2, -1)),)),
            Sublayer("feed_forward", "mlp", text=TEXT_PREFIX),
        ),
        rotary="image_rotary_emb", rotary_axis=1, stream=TEXT_PREFIX, timesteps=1.0,
        timesteps_rise=True,  # its time runs from 0 (noise) to 1 (clean)
    ),
    BlockFamily(  # MiniMax-H3: one packed stream [text; condition frames; audio; video] (ModelLayout.roles place the
        "minimax-h3",  # video), modulated per row outside its sub-layers; one rotary table (cos, sin) [tokens, d]
        ("MiniMaxH3TransformerBlock",), _PREFIX_ATTN_FF, rotary="rotary_emb", stream=TEXT_PREFIX, timesteps=1.0,
        timesteps_rise=True,  # its t = 1 - sigma: 1 is clean
    ),
)

_BY_CLASS: Dict[str, BlockFamily] = {
    name: family for family in BLOCK_FAMILIES if not family.models for name in family.classes
}
_SCOPED: Dict[str, Dict[str, BlockFamily]] = {}
for _family in BLOCK_FAMILIES:
    for _model in _family.models:
        _SCOPED.setdefault(_model, {}).update(dict.fromkeys(_family.classes, _family))


@dataclass(frozen=True)
class Temporal:
    """A module class whose blocks attend across frames (one sequence per pixel): ToMe never hooks them; ``children``:
    the attributes holding its temporal blocks where it also holds spatial ones (SVD's), empty: all of it."""

    name: str
    children: Tuple[str, ...] = ()


TEMPORAL: Tuple[Temporal, ...] = (
    # UNet3D's (text-to-video, I2VGen-XL) temp_attentions and transformer_in; ppdiffusers' AnimateDiff motion modules
    Temporal("TransformerTemporalModel"),
    Temporal("AnimateDiffTransformer3D"),  # diffusers' AnimateDiff motion modules (UNetMotionModel, MotionAdapter)
    Temporal("TransformerSpatioTemporalModel", ("temporal_transformer_blocks",)),  # SVD: spatial and temporal blocks
    Temporal("TemporalBasicTransformerBlock"),  # SVD's temporal block (diffusers and ppdiffusers)
    Temporal("FreeNoiseTransformerBlock"),  # diffusers' FreeNoise replaces AnimateDiff's motion blocks with it
    Temporal("I2VGenXLTransformerTemporalEncoder"),  # I2VGen-XL: image latents attended over frames
    Temporal("TransformerTemporal"),  # ppdiffusers' Hotshot-XL temporal layers
    Temporal("LatteTransformer3DModel", ("temporal_transformer_blocks",)),  # Latte: spatial and temporal blocks alternate
)

_TEMPORAL: Dict[str, Temporal] = {entry.name: entry for entry in TEMPORAL}


@dataclass(frozen=True)
class GridLayout:
    """How a video transformer's call gives its grid: one frame-major sequence of ``frames x rows x cols`` tokens,
    read as the frames' grids stacked in rows (as Wan's).

    frames_axis: the frames' axis of its 5-D latent (2: ``(B, C, F, H, W)``; 1: CogVideoX's ``(B, F, C, H, W)``);
        None for packed tokens ``[B, N, C]`` sized by ``sizes``. A list of latents (Z-Image) reads as their batch.
    temporal_patch: the config key of its temporal patch size (absent, None or naming None: 1).
    sizes: the call's arguments giving ``(frames, height, width)`` of packed tokens (latent units).
    patch_arguments: the call's arguments giving ``(temporal, spatial)`` patch sizes (Z-Image), defaulting to its
        ``forward``'s; else the config's (a 3-D ``patch_size`` gives both).
    channels_last: its latent is ``(B, F, H, W, C)`` (Kandinsky 5 and 6).
    coords: the call's per-token ``(t, h, w)`` coordinates ``[B, 3, N]``, read where ``sizes`` are not given: the
        video's frames last, after conditioning tokens (LTX-Video's condition pipeline).
    frame_types: the call's per-frame types ``[B, F]``: frames after the last of type 0 are conditions, a tail
        (Kandinsky 6's clean reference frame).
    """

    frames_axis: Optional[int] = 2
    temporal_patch: Optional[str] = "patch_size_t"
    sizes: Tuple[str, ...] = ()
    patch_arguments: Tuple[str, ...] = ()
    channels_last: bool = False
    coords: Optional[str] = None
    frame_types: Optional[str] = None


@dataclass(frozen=True)
class TokenRoles:
    """How a model's call on packed sequences tells its image tokens: by a per-token role, not their order
    (Ideogram 4's ``[left padding; text; image]`` rows, MiniMax-H3's ``[text; condition frames; audio; video]``).
    The image role's last run, at the same place in every row and segment under the same ids, is the grid; every
    other token passes through (:func:`~tome_core.models.levels.indicated_run`); other packings run unmerged.

    indicator: the call's argument of per-token roles ``[B, L]`` (or ``[L]``, one layout for the batch).
    image: the role value of the image's tokens.
    ids: the call's argument of per-token ids ``(t, row, col)`` ``[B, L, 3]`` (or ``[L, 3]``).
    segments: the call's argument of per-token sample ids ``[B, L]`` under a block-diagonal mask (None: none).
    """

    indicator: str
    image: int
    ids: str
    segments: Optional[str] = None

    @property
    def arguments(self) -> Tuple[str, ...]:
        """The call's arguments read: the indicator, the ids, and the segments where given."""
        return (self.indicator, self.ids) + ((self.segments,) if self.segments else ())


@dataclass(frozen=True)
class ModelLayout:
    """What a model class's call and children tell beyond its blocks' families (its grid reader is chosen from it).
    A class named nowhere has the default: its latent's shape over ``patch_size``, or its packed tokens' ids.

    video: its tokens are a frame-major video sequence (:class:`GridLayout`).
    roles: a per-token role tells which packed tokens are the image's (:class:`TokenRoles`).
    context_latents: its call's list argument of further images' latents ``(B, C, h, w)``, whose tokens follow the
        output's as a tail (Bria-FIBO 2's images to edit).
    grid_last: its blocks' image stream ends with the latent's tokens, after tokens that pass through (FramePack's
        and Helios' history, OmniGen's prompt, Qwen-Image 2.1's text and condition images).
    text_only: children (dotted paths) whose blocks never merge through this model: on the text alone (Z-Image's
        and Lumina 2's caption refiners), on other images (FLUX.3's references), or another model's own modules.
    lent: children that another model runs inside its own call (the Z-Image ControlNet borrows the transformer's
        noise refiner): their blocks merge only inside this model's call.
    grid_source: a child whose 4-D output ``(B, C, h, w)`` is the grid of the blocks after it (aMUSEd's UVit).
    unet: its levels, where it is a UNet laid out otherwise than diffusers' (:class:`UNetPath`).
    """

    classes: Tuple[str, ...]
    video: Optional[GridLayout] = None
    roles: Optional[TokenRoles] = None
    context_latents: Optional[str] = None
    grid_last: bool = False
    text_only: Tuple[str, ...] = ()
    lent: Tuple[str, ...] = ()
    grid_source: Optional[str] = None
    unet: Optional["UNetPath"] = None


@dataclass(frozen=True)
class UNetPath:
    """How a UNet not laid out as diffusers' runs through its levels: the ``ldm`` ``UNetModel`` runs
    ``input_blocks``, ``middle_block`` and ``output_blocks``; a part holding a downsampler halves the grid of the
    parts after it, an upsampler doubles it. Its latent is its call's first input, ``(B, C, H, W)``.

    parts: its children in the order its call runs them, each a module or a list of modules.
    downsample, upsample: the class names of the layers that halve and double the grid after their part.
    containers: its 2-D containers, whose 4-D input is the grid of the blocks inside (as :data:`GRID_CONTAINERS`).
    counted: its children in the order its blocks are counted, as diffusers counts the same UNet's (down, up,
        middle), so that the same options on the same weights merge alike in both libraries.
    """

    parts: Tuple[str, ...]
    downsample: Tuple[str, ...]
    upsample: Tuple[str, ...]
    containers: Tuple[str, ...]
    counted: Tuple[str, ...]


_Z_IMAGE_VIDEO = GridLayout(patch_arguments=("f_patch_size", "patch_size"))

MODEL_LAYOUTS: Tuple[ModelLayout, ...] = (
    ModelLayout(("HunyuanVideoTransformer3DModel", "HunyuanVideo15Transformer3DModel", "MotifVideoTransformer3DModel"), video=GridLayout()),
    ModelLayout(("HunyuanVideoFramepackTransformer3DModel", "HeliosTransformer3DModel"), video=GridLayout(), grid_last=True),
    ModelLayout(("CogVideoXTransformer3DModel", "ConsisIDTransformer3DModel", "AnyFlowTransformer3DModel"), video=GridLayout(frames_axis=1)),
    ModelLayout(
        ("LTXVideoTransformer3DModel", "LTX2VideoTransformer3DModel"),
        video=GridLayout(frames_axis=None, sizes=("num_frames", "height", "width"), coords="video_coords"),
    ),
    ModelLayout(
        ("ZImageTransformer2DModel",), video=_Z_IMAGE_VIDEO, text_only=("context_refiner", "siglip_refiner"),
        lent=("noise_refiner",),
    ),
    ModelLayout(("ZImageControlNetModel",), video=_Z_IMAGE_VIDEO, text_only=("noise_refiner", "context_refiner")),  # its transformer's, borrowed
    ModelLayout(("Kandinsky5Transformer3DModel",), video=GridLayout(frames_axis=1, channels_last=True)),
    ModelLayout(
        ("Kandinsky6Transformer3DModel",),
        video=GridLayout(frames_axis=1, channels_last=True, frame_types="visual_token_type_ids"),
    ),
    # a 2-D patch per frame, the frames' tokens in one sequence
    ModelLayout(("MochiTransformer3DModel", "AllegroTransformer3DModel", "EasyAnimateTransformer3DModel"), video=GridLayout(temporal_patch=None)),
    ModelLayout(("BriaFibo2Transformer2DModel",), context_latents="context_latents"),
    ModelLayout(("Ideogram4Transformer2DModel",), roles=TokenRoles("indicator", 2, "position_ids", "segment_ids")),
    ModelLayout(("MiniMaxH3Transformer3DModel",), roles=TokenRoles("token_tags", 0, "position_ids")),
    ModelLayout(("OmniGenTransformer2DModel", "QwenImage21Transformer2DModel"), grid_last=True),
    ModelLayout(("Lumina2Transformer2DModel",), text_only=("context_refiner",)),
    ModelLayout(("Flux3Transformer2DModel",), text_only=("txt_mode_blocks", "mode_blocks.image_cond")),  # (and the reference images)
    ModelLayout(("UVit2DModel",), grid_source="down_block"),
    ModelLayout(("ldm:UNetModel",), unet=UNetPath(  # SD 1.x/2.x in A1111-style UIs and sdkit
        ("input_blocks", "middle_block", "output_blocks"), ("Downsample",), ("Upsample",), ("SpatialTransformer",),
        ("input_blocks", "output_blocks", "middle_block"),
    )),
)

_MODEL_LAYOUTS: Dict[str, ModelLayout] = {name: layout for layout in MODEL_LAYOUTS for name in layout.classes}
_DEFAULT_LAYOUT = ModelLayout(())


def model_layout(cls: type) -> ModelLayout:
    """The :data:`MODEL_LAYOUTS` record of a model class (or of its nearest base named there), else the default."""
    return _nearest(_MODEL_LAYOUTS, cls) or _DEFAULT_LAYOUT


@dataclass(frozen=True)
class IdsMaker:
    """A pipeline method that makes packed image tokens' ids on a ``rows x cols`` raster grid (its arguments of
    those names): ``patch`` wraps it (:func:`~tome_core.hooks.call_hooks.tell_grids`) so the ids carry their grid and
    the reader need not read them on the host, a graph break ``torch.compile(fullgraph=True)`` refuses."""

    method: str
    rows: str = "height"
    cols: str = "width"


# Flux's pipelines and their kin (Chroma, Bria, Ovis-Image; ppdiffusers' Flux): a static method of the pipeline
IDS_MAKERS: Tuple[IdsMaker, ...] = (IdsMaker("_prepare_latent_image_ids"),)

# Containers whose 4-D input ``(batch [* frames], C, H, W)`` is the token grid of the (spatial) blocks inside.
GRID_CONTAINERS: Tuple[str, ...] = ("Transformer2DModel", "TransformerSpatioTemporalModel", "DreamLiteTransformer2DModel")
# 2-D containers whose 4-D input is channels-last ``(batch, H, W, C)``: diffusers' Flax Transformer2DModel.
CHANNELS_LAST_GRID_CONTAINERS: Tuple[str, ...] = ("FlaxTransformer2DModel",)


@dataclass(frozen=True)
class OwnAttention:
    """An attention class with no processor whose own ``forward`` computes the attention (the ``ldm``
    ``CrossAttention``), its keys and values from its sub-layer's ``kv_input``, where ``kv`` hands it merged tokens.

    classes: its classes (library-qualified, as ``"ldm:CrossAttention"``).
    through: what it computes attention through, named in messages.
    softmax: it normalises its scores with torch's softmax over the last axis, where size-aware attention adds the
        merged keys' log sizes; False: a kernel that takes no bias, and size-aware attention is refused at ``patch``.
    """

    classes: Tuple[str, ...]
    through: str
    softmax: bool


OWN_ATTENTIONS: Tuple[OwnAttention, ...] = (
    OwnAttention(("ldm:CrossAttention",), "einsum and Tensor.softmax", softmax=True),
    # ldm picks it for every block when xformers imports
    OwnAttention(("ldm:MemoryEfficientCrossAttention",), "xformers.ops.memory_efficient_attention", softmax=False),
)
_OWN_ATTENTIONS: Dict[str, OwnAttention] = {name: entry for entry in OWN_ATTENTIONS for name in entry.classes}


def own_attention(cls: type) -> Optional[OwnAttention]:
    """The :data:`OWN_ATTENTIONS` entry of an attention class (or of its nearest base class named there), or None;
    read at every merged attention call, so kept per class (in a plain dict: dynamo warns of ``lru_cache``)."""
    if cls not in _OWN_BY_CLASS:
        _OWN_BY_CLASS[cls] = _nearest(_OWN_ATTENTIONS, cls)
    return _OWN_BY_CLASS[cls]


_OWN_BY_CLASS: Dict[type, Optional[OwnAttention]] = {}


def named(cls: type, names: Tuple[str, ...]) -> bool:
    """Whether ``cls`` is one of ``names`` (a bare name, or one qualified by its library: ``"ldm:UNetModel"``)."""
    return cls.__name__ in names or _qualified(cls) in names


def _qualified(cls: type) -> str:
    """``cls``'s name qualified by its top-level package: ``"ldm:BasicTransformerBlock"``."""
    return f"{cls.__module__.split('.')[0]}:{cls.__name__}"


def child_at(module: Any, path: str) -> Any:
    """The submodule at a dotted attribute ``path`` of ``module`` (``""``: ``module`` itself), or None."""
    for name in path.split(".") if path else ():
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def _nearest(table: Dict[str, Any], cls: type) -> Any:
    """The entry of ``table`` for ``cls`` or for the nearest of its base classes named there, or None."""
    for base in cls.__mro__:
        entry = table.get(_qualified(base), table.get(base.__name__))
        if entry is not None:
            return entry
    return None


def block_family(cls: type, model: Optional[type] = None) -> Optional[BlockFamily]:
    """The family of a block class (or of its nearest base named in the table), or None; with ``model`` (the class
    it sits in), also the families found only inside such models (:attr:`BlockFamily.models`)."""
    found = _nearest(_BY_CLASS, cls)
    if found is None and model is not None:
        scoped = _nearest(_SCOPED, model)
        found = _nearest(scoped, cls) if scoped else None
    return found


def temporal(cls: type) -> Optional[Temporal]:
    """The :data:`TEMPORAL` entry of a module class (or of the nearest base class named there), or None."""
    return _nearest(_TEMPORAL, cls)
