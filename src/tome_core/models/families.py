"""What ToMe needs to know about each transformer block family and model class, as data (framework-free).

A block family (:class:`BlockFamily`) says which of a block's sub-layers are wrapped in merge/unmerge, where the
image tokens are in each one's input and output, and where text tokens sit beside them in its attention. A model
layout (:class:`ModelLayout`) says what a model class's call and children tell beyond that: how its call places
its tokens on a grid, which of its children never merge. The driver (:mod:`tome_core.driver`) reads both through
:func:`block_family` and :func:`model_layout`. Classes are named, not imported, so the same tables serve diffusers
(torch), ppdiffusers (paddle) and any library that keeps diffusers' class names. A name written
``"library:Class"`` (``"ldm:BasicTransformerBlock"``) means that class of the package ``library`` alone, where
another library uses diffusers' name for something else; it wins over the bare name.

Adding a model family, honestly:

1. A block class laid out as an existing family's: its name in that family's ``classes`` (one line).
2. A new block layout: one :class:`BlockFamily` in :data:`BLOCK_FAMILIES` (sub-layers that another family
   has too: the named tuple they share, such as ``_SELF_CROSS_MLP``).
3. A model class whose call places its tokens otherwise than its latent's shape over its config's
   ``patch_size`` or its packed tokens' ids: one :class:`ModelLayout` in :data:`MODEL_LAYOUTS`; a placement that
   no reader of :mod:`tome_core.models.grid_readers` knows yet: one reader there, and its line in ``grid_reader``.
4. A module class whose blocks attend across frames: a :class:`Temporal` entry; a 2-D container whose input is
   its blocks' grid: :data:`GRID_CONTAINERS`. A class ToMe must refuse: its reason in
   :data:`tome_core.models.model_zoo.REFUSED`.
5. A mechanism no family has yet (a new way text sits beside the image, a new kind of mask) is code in
   :mod:`tome_core.hooks.block_hooks`, built once for every family that names it.
6. Tests: a tiny config in ``tests/torch/test_zoo.py`` (``MERGED``, checked against the unpatched model and by
   counting the tokens attention sees) and a row in ``docs/models.md`` (the zoo test reads both).
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

    child: the block's attribute holding the sub-layer module; a dotted path where the block holds it in a nested
        block whose own ``forward`` it never calls (Kandinsky 6's ``video_dec_block.self_attention``).
    kind: which option selects it and which ratio it uses: "attn", "crossattn" or "mlp".
    text: where text tokens sit in its input or attention (``TEXT_*``).
    output: index of the image stream when the sub-layer returns a tuple (joint attention), else None.
    extra_outputs: indices of further image-token outputs of such a tuple, where present (an IP-Adapter processor's
        attention to the image prompt, computed from the merged queries): unmerged like ``output``, with no text.
    attention: its keys are its own merged tokens, so size-aware attention applies.
    kv_input: the keyword argument through which the attention takes keys and values apart from its queries
        (diffusers' ``encoder_hidden_states``); the ``kv`` and ``queries`` arrangements need one.
    text_if: a flag of the block that, when true, makes this attention attend to the text instead of its own
        tokens (``BasicTransformerBlock.only_cross_attention``): it has no self-attention keys to arrange.
    text_unless: a flag of the block that, when false, makes this attention attend to the text alone (Stable
        Cascade's ``SDCascadeAttnBlock.self_attn``: without it the keys are the condition's tokens only, not
        [image; condition]): as with ``text_if``, a cross-attention then, merged as ``crossattn``.
    masks: ``(argument, token axes)`` of masks over the sub-layer's ``[text; image; tail]`` tokens (Chroma's
        ``attention_mask`` ``[B, 1, L, L]``: axes -2 and -1): gathered like the rotary positions, each merged token
        taking its destination's entry (image entries are all true, so the gather is exact). No axes: a mask
        over the text only, which the processor extends over the image tokens itself.
        A self-attention given an ``attention_mask`` not listed here runs unmerged in that call.
    once: the block runs it on its image tokens and then again on other tokens (CogView4's ``ff`` on the text):
        only the block's first call merges.
    aligned: arguments that carry the same tokens as its input (Lumina 2's self-attention gets its input again as
        ``encoder_hidden_states``; Nucleus-MoE's router the unmodulated tokens): merged alike.
    counts: arguments that give how many of its input's tokens are the grid's (Helios' ``original_context_length``,
        from which its attention tells the history before them): given the merged count.
    log_bases: arguments that give the base ``b`` of a logarithm of its query count by which its attention scales
        the softmax (Lumina-Next's ``base_sequence_length``: ``sqrt(log_b(queries))``): given the base under which
        the merged count's logarithm is the whole count's, so that the scale stays the unmerged model's.
    projections: ``(query, key, value, output)``: the children (dotted paths) of an attention that keeps its own
        norm and residual inside itself (diffusers' ``Attention`` over a feature map, with a group norm and a
        residual connection: UNet2DModel's). Its own input and output are left as they are; ToMe merges inside it,
        at the inputs of its projections, and unmerges the output projection's output, so the norm's statistics
        and the residual see every token. ``kv`` merges the key and value projections' inputs alone, ``tokens``
        the query's too. Keys and values count as its own tokens where they are the very tensor its queries get
        (or, with ``text`` set, its image part); else the call is a cross-attention, merged as ``crossattn``.
        ``child`` "" names the block itself (such an attention is a block of its own).
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
    """A transformer block class (by name) and the sub-layers ToMe wraps.

    The block's first input (``hidden_states``) is its image stream: the match is computed from it.
    rotary: argument of the sub-layers carrying rotary position embeddings ``(cos, sin)`` of ``[text; image]``
        tokens (by keyword or at its place in the sub-layer's ``forward``); merged tokens then take their
        destination's position, and the match is shared by the batch so that every merged token has one
        position.
    key_rotary: argument of the sub-layers carrying the keys' rotary table apart from the queries' (``rotary``),
        laid out alike (Lumina-Next's ``key_rotary_emb``); moved as ``rotary``'s where given.
    rotary_axis: the token axis of those tables (Flux: ``[tokens, dim]``; Wan: ``[1, tokens, 1, dim]``).
    rotary_items: which items of the rotary tuple hold token positions (None: all). A table's leading rows
        beyond the image's and the tail's are text (none in Qwen-Image's image table, whose text table is the
        second item and stays as it is).
    timesteps_rise: its model's timestep rises while sampling (Z-Image's and Lumina 2's 0 is pure noise), so a
        falling one starts a new generation (``reuse_steps``).
    unmerged_with: ``(argument, why)``: a block argument whose presence means the image tokens cannot be placed
        (Lumina 2 passes its attention mask when the captions before the image differ in length): such calls of
        the block run unmerged, said once.
    stream: where text sits in the block's own input: ``TEXT_NONE`` (image tokens, then a tail),
        ``TEXT_PREFIX`` (``[text; image; tail]`` in one tensor, as Flux.2's and Chroma's single blocks get it) or
        ``TEXT_SUFFIX`` (``[image; text]``, Z-Image's); the match is computed from the image part.
    timesteps: the largest timestep a model of this family receives from its pipeline (1000 for DDPM-style
        and most flow-matching models; 1 where the pipeline passes sigmas, as Flux's do): ``timestep_range``
        outside ``[0, timesteps]`` is refused.
    sequence_first: the block's own input is ``[S, B, C]`` (ERNIE-Image's); its sub-layers get theirs batch-first.
    text_after_with: a block argument whose presence (not None) puts the text after the image in that call
        (:func:`with_text_after`): Bria-FIBO 2 moves its gist tokens behind the image, under a key mask, when the
        batch pads them.
    feature_map: the block's own input is a channels-first feature map ``(B, C, H, W)`` (the ResNet-style blocks of
        UNet2DModel, Kandinsky 3 and Stable Cascade): it gives the block's grid, and its pixels are the tokens the
        match is computed from.
    models: the family's classes are blocks only inside models of these classes (a class it shares with the
        sub-layers of other families, such as diffusers' ``Attention``); empty: everywhere.
    metric: the block argument whose tokens the match is computed from, where its first input is not the stream
        of the grid (Z-Image's ControlNet blocks get a stack of the earlier hints first and the main stream ``x``
        second: they merge their control tokens on the main stream's match); None: the first input.
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


# diffusers' BasicTransformerBlock: self-attention (keys and values apart from encoder_hidden_states), cross-attention, MLP.
_BASIC = (
    Sublayer("attn1", "attn", attention=True, kv_input="encoder_hidden_states", text_if="only_cross_attention"),
    Sublayer("attn2", "crossattn"),
    Sublayer("ff", "mlp"),
)
# Self-attention, cross-attention to the text, an MLP (LTX-Video, Hunyuan-DiT, Cosmos, Allegro): diffusers' names.
_SELF_CROSS_MLP = (Sublayer("attn1", "attn", attention=True), Sublayer("attn2", "crossattn"), Sublayer("ff", "mlp"))
# Wan's block (and AnyFlow's copy): the same sub-layers, its MLP named ffn.
_WAN = (*_SELF_CROSS_MLP[:2], Sublayer("ffn", "mlp"))
# FLUX.1's double-stream block: joint attention over [text; image] (image output first), an image MLP.
_FLUX_DOUBLE = (
    Sublayer("attn", "attn", text=TEXT_BEFORE, output=0, extra_outputs=(2,), attention=True), Sublayer("ff", "mlp"),
)
# FLUX.1's single-stream block: attention and MLP side by side on one normalised [text; image] sequence.
_FLUX_SINGLE = (Sublayer("attn", "attn", text=TEXT_PREFIX, attention=True), Sublayer("proj_mlp", "mlp", text=TEXT_PREFIX))


def _masked(sublayers: Tuple[Sublayer, ...], mask: Tuple[str, Tuple[int, ...]]) -> Tuple[Sublayer, ...]:
    """``sublayers`` with ``mask`` gathered at each attention."""
    return tuple(replace(s, masks=(mask,)) if s.kind == "attn" else s for s in sublayers)


BLOCK_FAMILIES: Tuple[BlockFamily, ...] = (
    BlockFamily(
        "basic",  # SD 1.x/2.x/XL UNets, ControlNets, PixArt, DiT; DreamLite's variant (attn1 may be absent)
        ("BasicTransformerBlock", "BasicTransformerBlockDreamLite"),
        _BASIC,
    ),
    BlockFamily(
        "flax-basic",  # diffusers' Flax SD UNets and ControlNets: FlaxAttention takes its keys and values from context
        ("FlaxBasicTransformerBlock",),
        (replace(_BASIC[0], kv_input="context"), *_BASIC[1:]),
    ),
    BlockFamily(
        "ldm-basic",  # the ldm UNetModel's (A1111-style UIs, sdkit): CrossAttention takes keys and values from context;
        ("ldm:BasicTransformerBlock",),  # disable_self_attn makes attn1 attend to the context (SD 2.x's option)
        (replace(_BASIC[0], kv_input="context", text_if="disable_self_attn"), *_BASIC[1:]),
    ),
    BlockFamily(
        "mmdit",  # SD3 / SD3.5 (attn2: SD3.5's second, image-only self-attention)
        ("JointTransformerBlock",),
        (
            Sublayer("attn", "attn", text=TEXT_AFTER, output=0, attention=True),
            Sublayer("attn2", "attn", attention=True),
            Sublayer("ff", "mlp"),
        ),
    ),
    BlockFamily(
        "flux-double",  # FLUX.1 and the models that copy its blocks: LongCat-Image, Ovis-Image
        ("FluxTransformerBlock", "LongCatImageTransformerBlock", "OvisImageTransformerBlock"),
        _FLUX_DOUBLE,
        rotary="image_rotary_emb",
        timesteps=1.0,
    ),
    BlockFamily(
        "flux-single",  # attention and MLP side by side on one normalised [text; image] sequence
        ("FluxSingleTransformerBlock", "LongCatImageSingleTransformerBlock", "OvisImageSingleTransformerBlock"),
        _FLUX_SINGLE,
        rotary="image_rotary_emb",
        timesteps=1.0,
    ),
    # Bria: FLUX.1's blocks; its pipelines pass the scheduler's timesteps (0-1000)
    BlockFamily("bria-double", ("BriaTransformerBlock",), _FLUX_DOUBLE, rotary="image_rotary_emb"),
    BlockFamily("bria-single", ("BriaSingleTransformerBlock",), _FLUX_SINGLE, rotary="image_rotary_emb"),
    # Bria-FIBO: a key-padding mask over [text; image] at every attention (a padded prompt); its model hands its
    # single blocks [text; image]
    BlockFamily(
        "bria-fibo-double",
        ("BriaFiboTransformerBlock",),
        _masked(_FLUX_DOUBLE, ("attention_mask", (-1,))),
        rotary="image_rotary_emb",
    ),
    BlockFamily(
        "bria-fibo-single",
        ("BriaFiboSingleTransformerBlock",),
        _masked(_FLUX_SINGLE, ("attention_mask", (-1,))),
        rotary="image_rotary_emb",
        stream=TEXT_PREFIX,
    ),
    BlockFamily(
        "flux2-double",  # Flux.2 (dev, Klein)
        ("Flux2TransformerBlock",),
        _FLUX_DOUBLE,
        rotary="image_rotary_emb",
        timesteps=1.0,
    ),
    BlockFamily(
        "flux2-single",  # its model hands it [text; image]; one fused attention + MLP sub-layer
        ("Flux2SingleTransformerBlock",),
        (Sublayer("attn", "attn", text=TEXT_PREFIX, attention=True),),
        rotary="image_rotary_emb",
        stream=TEXT_PREFIX,
        timesteps=1.0,
    ),
    BlockFamily(  # Chroma: FLUX.1's blocks with an attention mask over [text; image] on both token axes
        "chroma-double",
        ("ChromaTransformerBlock",),
        _masked(_FLUX_DOUBLE, ("attention_mask", (-2, -1))),
        rotary="image_rotary_emb",
        timesteps=1.0,
    ),
    BlockFamily(
        "chroma-single",
        ("ChromaSingleTransformerBlock",),
        _masked(_FLUX_SINGLE, ("attention_mask", (-2, -1))),
        rotary="image_rotary_emb",
        stream=TEXT_PREFIX,
        timesteps=1.0,
    ),
    BlockFamily(  # Qwen-Image (+ Edit, Layered, ControlNet): rotary (image table, text table), complex
        "qwen-image",
        ("QwenImageTransformerBlock",),
        (
            Sublayer("attn", "attn", text=TEXT_BEFORE, output=0, attention=True),
            Sublayer("img_mlp", "mlp"),
        ),
        rotary="image_rotary_emb",
        rotary_items=(0,),
        timesteps=1.0,
    ),
    BlockFamily(
        # Wan 2.1/2.2 (and its copies: Animate, ChronoEdit, SkyReels-V2): frames x height x width tokens. VACE's
        # control blocks run on control tokens of the same grid, matched on the main stream's (their first input)
        "wan",
        ("WanTransformerBlock", "SkyReelsV2TransformerBlock", "WanVACETransformerBlock"),
        _WAN,
        rotary="rotary_emb",
        rotary_axis=1,
    ),
)

_HUNYUAN_DOUBLE = (  # joint attention over [image; text] with a key mask over both; an image MLP
    Sublayer("attn", "attn", text=TEXT_AFTER, output=0, attention=True, masks=(("attention_mask", (-1,)),)),
    Sublayer("ff", "mlp"),
)
BLOCK_FAMILIES += (
    BlockFamily(  # HunyuanVideo (and FramePack's, which reuses its blocks); rotary over the image tokens only
        "hunyuan-video-double",
        ("HunyuanVideoTransformerBlock", "HunyuanVideoTokenReplaceTransformerBlock"),
        _HUNYUAN_DOUBLE,
        rotary="image_rotary_emb",
    ),
    BlockFamily(  # attention as the double block's; the MLP runs on [image; text] in one tensor
        "hunyuan-video-single",
        ("HunyuanVideoSingleTransformerBlock", "HunyuanVideoTokenReplaceSingleTransformerBlock"),
        (_HUNYUAN_DOUBLE[0], Sublayer("proj_mlp", "mlp", text=TEXT_SUFFIX)),
        rotary="image_rotary_emb",
    ),
    BlockFamily(  # HunyuanVideo 1.5: its processor extends the text-only mask over the (merged) image tokens
        "hunyuan-video-15",
        ("HunyuanVideo15TransformerBlock",),
        (
            Sublayer("attn", "attn", text=TEXT_AFTER, output=0, attention=True, masks=(("attention_mask", ()),)),
            Sublayer("ff", "mlp"),
        ),
        rotary="image_rotary_emb",
    ),
    BlockFamily(  # CogVideoX (1.0, 1.5), ConsisID: joint attention over [text; image], the MLP on [text; image]
        "cogvideox",
        ("CogVideoXBlock", "ConsisIDBlock"),
        (
            Sublayer("attn1", "attn", text=TEXT_BEFORE, output=0, attention=True),
            Sublayer("ff", "mlp", text=TEXT_PREFIX),
        ),
        rotary="image_rotary_emb",
    ),
    BlockFamily(  # LTX-2: video tokens (audio in a second stream, never merged); rotary tables [B, (heads,) tokens, d]
        "ltx2",
        ("LTX2VideoTransformerBlock",),
        (
            Sublayer("attn1", "attn", attention=True),
            Sublayer("attn2", "crossattn"),
            Sublayer("audio_to_video_attn", "crossattn"),  # video queries, audio keys
            Sublayer("ff", "mlp"),
        ),
        rotary="query_rotary_emb",
        rotary_axis=-2,
    ),
    BlockFamily(  # LTX-Video: rotary tables [B, tokens, dim]
        "ltx",
        ("LTXVideoTransformerBlock",),
        _SELF_CROSS_MLP,
        rotary="image_rotary_emb",
        rotary_axis=1,
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # CogView3-Plus: joint attention over [text; image]; the MLP on [text; image]
        "cogview3plus",
        ("CogView3PlusTransformerBlock",),
        (
            Sublayer("attn1", "attn", text=TEXT_BEFORE, output=0, attention=True),
            Sublayer("ff", "mlp", text=TEXT_PREFIX),
        ),
    ),
    BlockFamily(  # CogView4 (and GLM-Image's blocks): the MLP runs on the image, then on the text
        "cogview4",
        ("CogView4TransformerBlock", "GlmImageTransformerBlock"),
        (
            Sublayer("attn1", "attn", text=TEXT_BEFORE, output=0, attention=True),
            Sublayer("ff", "mlp", once=True),
        ),
        rotary="image_rotary_emb",
    ),
    BlockFamily(  # Hunyuan-DiT: rotary positions reach the cross-attention's queries too
        "hunyuan-dit",
        ("HunyuanDiTBlock",),
        _SELF_CROSS_MLP,
        rotary="image_rotary_emb",
    ),
    BlockFamily(
        "auraflow-joint",
        ("AuraFlowJointTransformerBlock",),
        (Sublayer("attn", "attn", text=TEXT_BEFORE, output=0, attention=True), Sublayer("ff", "mlp")),
        timesteps=1.0,
    ),
    BlockFamily(  # its model hands it [registers; text; image]
        "auraflow-single",
        ("AuraFlowSingleTransformerBlock",),
        (Sublayer("attn", "attn", text=TEXT_PREFIX, attention=True), Sublayer("ff", "mlp", text=TEXT_PREFIX)),
        stream=TEXT_PREFIX,
        timesteps=1.0,
    ),
    BlockFamily(  # HunyuanImage 2.1: HunyuanVideo's blocks on one frame
        "hunyuan-image-double",
        ("HunyuanImageTransformerBlock",),
        _HUNYUAN_DOUBLE,
        rotary="image_rotary_emb",
    ),
    BlockFamily(
        "hunyuan-image-single",
        ("HunyuanImageSingleTransformerBlock",),
        (_HUNYUAN_DOUBLE[0], Sublayer("proj_mlp", "mlp", text=TEXT_SUFFIX)),
        rotary="image_rotary_emb",
    ),
    BlockFamily(  # Cosmos (Predict 2 / 2.5): rotary over the image tokens; pipelines pass sigmas
        "cosmos",
        ("CosmosTransformerBlock",),
        _SELF_CROSS_MLP,
        rotary="image_rotary_emb",
        timesteps=1.0,
    ),
)

_Z_IMAGE = BlockFamily(  # Z-Image: one stream [image; padding; caption; padding]
    "z-image",
    ("ZImageTransformerBlock",),
    (
        Sublayer("attention", "attn", text=TEXT_SUFFIX, attention=True, masks=(("attention_mask", (-1,)),)),
        Sublayer("feed_forward", "mlp", text=TEXT_SUFFIX),
    ),
    rotary="freqs_cis", rotary_axis=1,  # complex, one per token [B, L, d/2]
    stream=TEXT_SUFFIX,
    timesteps=1.0,
    timesteps_rise=True,
)
BLOCK_FAMILIES += (
    _Z_IMAGE,
    # Z-Image's ControlNet: its block's sub-layers run on the last of a stack of control streams [k, B, L, C], laid
    # out as the main stream x (its second input), on whose grid and match they merge; its hints stay whole
    replace(_Z_IMAGE, name="z-image-control", classes=("ZImageControlTransformerBlock",), metric="x"),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Lumina-Image 2.0: one stream [caption; image] (its image refiner: image only)
        "lumina2",
        ("Lumina2TransformerBlock",),
        (
            Sublayer("attn", "attn", text=TEXT_PREFIX, attention=True, aligned=("encoder_hidden_states",)),
            Sublayer("feed_forward", "mlp", text=TEXT_PREFIX),
        ),
        rotary="image_rotary_emb",
        rotary_axis=1,
        stream=TEXT_PREFIX,
        timesteps=1.0,
        timesteps_rise=True,
        unmerged_with=("attention_mask", "captions of different lengths put the image at a different offset per item"),
    ),
)

BLOCK_FAMILIES += (
    # HiDream-I1: rotary 2x2 rotation matrices per token [B, L, 1, d/2, 2, 2] over [image; text]; a non-square latent
    # is padded to its largest size, with a key mask over the padding (such calls run unmerged)
    BlockFamily(
        "hidream-double",
        ("HiDreamImageTransformerBlock",),
        (Sublayer("attn1", "attn", text=TEXT_AFTER, output=0, attention=True), Sublayer("ff_i", "mlp")),
        rotary="image_rotary_emb",
        rotary_axis=1,
        unmerged_with=("hidden_states_masks", "a non-square latent padded to the largest size, the padding masked"),
    ),
    BlockFamily(  # its model hands it [image; text] in one tensor
        "hidream-single",
        ("HiDreamImageSingleTransformerBlock",),
        (
            Sublayer("attn1", "attn", text=TEXT_SUFFIX, attention=True),
            Sublayer("ff_i", "mlp", text=TEXT_SUFFIX),
        ),
        rotary="image_rotary_emb",
        rotary_axis=1,
        stream=TEXT_SUFFIX,
        unmerged_with=("hidden_states_masks", "a non-square latent padded to the largest size, the padding masked"),
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Mochi: joint attention over [image; text], the text mask extended by its processor
        "mochi",
        ("MochiTransformerBlock",),
        (
            Sublayer("attn1", "attn", text=TEXT_AFTER, output=0, attention=True, masks=(("attention_mask", ()),)),
            Sublayer("ff", "mlp"),
        ),
        rotary="image_rotary_emb",
        timesteps_rise=True,  # its scheduler inverts the sigmas: 1000 * (1 - sigma)
    ),
    BlockFamily(  # Allegro: rotary as coordinate tables and per-token positions [1, N] (item 1, which moves)
        "allegro",
        ("AllegroTransformerBlock",),
        _SELF_CROSS_MLP,
        rotary="image_rotary_emb",
        rotary_axis=1,
        rotary_items=(1,),
    ),
    BlockFamily(  # EasyAnimate: joint attention over [text; image]; blocks past its MMDiT ones run ff on the text too
        "easyanimate",
        ("EasyAnimateTransformerBlock",),
        (
            Sublayer("attn1", "attn", text=TEXT_BEFORE, output=0, attention=True),
            Sublayer("ff", "mlp", once=True),
        ),
        rotary="image_rotary_emb",
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Nucleus-MoE-Image: image queries over [image; text] keys; its MoE routes on unmodulated tokens
        "nucleus-moe",
        ("NucleusMoEImageTransformerBlock",),
        (
            Sublayer("attn", "attn", text=TEXT_AFTER, attention=True, masks=(("attention_mask", (-1,)),)),
            Sublayer("img_mlp", "mlp", aligned=("hidden_states_unmodulated",)),
        ),
        rotary="image_rotary_emb",
        rotary_items=(0,),
        timesteps=1.0,
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Kandinsky 5: its visual blocks (its text blocks run on the text alone and are never hooked)
        "kandinsky5",
        ("Kandinsky5TransformerDecoderBlock",),
        (
            Sublayer("self_attention", "attn", attention=True),
            Sublayer("cross_attention", "crossattn"),
            Sublayer("feed_forward", "mlp"),
        ),
        rotary="rotary_emb",
        rotary_axis=1,
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
)

BLOCK_FAMILIES += (
    BlockFamily(  # PRX: image queries over [text; image] keys, a text-only mask; its MLP is inline (never merged)
        "prx",
        ("PRXBlock",),
        (Sublayer("attention", "attn", text=TEXT_BEFORE, attention=True, masks=(("attention_mask", ()),)),),
        rotary="image_rotary_emb",
        rotary_axis=2,
        timesteps=1.0,
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Krea 2: its model hands it [text; image] (a key-padding mask over both); ids tell the grid
        "krea2",
        ("Krea2TransformerBlock",),
        (
            Sublayer("attn", "attn", text=TEXT_PREFIX, attention=True, masks=(("attention_mask", (-1,)),)),
            Sublayer("ff", "mlp", text=TEXT_PREFIX),
        ),
        rotary="image_rotary_emb",
        stream=TEXT_PREFIX,
        timesteps=1.0,
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # AnyFlow: Wan's blocks; rotary tables by name ({"query": ..., "key": ...}) [1, 1, tokens, d/2]
        "anyflow",
        ("AnyFlowTransformerBlock",),
        _WAN,
        rotary="rotary_emb",
        rotary_axis=2,
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Motif-Video: HunyuanVideo's double block, with an optional text cross-attention
        "motif-video-double",
        ("MotifVideoTransformerBlock",),
        (*_HUNYUAN_DOUBLE, Sublayer("cross_attn", "crossattn")),
        rotary="image_rotary_emb",
    ),
    BlockFamily(  # its decoder layers take the image tokens of the main stack as their "text"
        "motif-video-single",
        ("MotifVideoSingleTransformerBlock",),
        (_HUNYUAN_DOUBLE[0], Sublayer("cross_attn", "crossattn"), Sublayer("proj_mlp", "mlp", text=TEXT_SUFFIX)),
        rotary="image_rotary_emb",
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # FLUX.3's per-mode blocks (the image mode's; attention and MLP side by side on the image)
        "flux3-mode",
        ("Flux3ModeTransformerBlock",),
        (Sublayer("attn", "attn", attention=True), Sublayer("ff", "mlp")),
        rotary="image_rotary_emb",
        timesteps=1.0,
    ),
    BlockFamily(  # its joint blocks: the block gets [image; references], its sub-layers [text; image; references]
        "flux3-single",
        ("Flux3SingleTransformerBlock",),
        (Sublayer("attn", "attn", text=TEXT_PREFIX, attention=True), Sublayer("ff", "mlp", text=TEXT_PREFIX)),
        rotary="image_rotary_emb",
        timesteps=1.0,
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Helios: Wan's blocks on [history at three resolutions; current frames], rotary [B, tokens, d]
        "helios",
        ("HeliosTransformerBlock",),
        (
            Sublayer("attn1", "attn", attention=True, counts=("original_context_length",)),
            Sublayer("attn2", "crossattn", counts=("original_context_length",)),  # on the current frames alone
            Sublayer("ffn", "mlp"),
        ),
        rotary="rotary_emb",
        rotary_axis=1,
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # OmniGen: one stream [prompt with input images; time token; output image], its attention mask
        "omnigen",  # over all of it (both axes); the attention gets its input again as encoder_hidden_states
        ("OmniGenBlock",),
        (
            Sublayer(
                "self_attn", "attn", attention=True, masks=(("attention_mask", (-2, -1)),), aligned=("encoder_hidden_states",),
            ),
            Sublayer("mlp", "mlp"),
        ),
        rotary="image_rotary_emb",
        timesteps=1.0,
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # ERNIE-Image: one [image; text] stream, sequence-first in the block; its attention gets it
        "ernie-image",  # batch-first with a key mask and one rotary table over both; its MLP runs sequence-first
        ("ErnieImageSharedAdaLNBlock",),
        (Sublayer("self_attention", "attn", text=TEXT_SUFFIX, attention=True, masks=(("attention_mask", (-1,)),)),),
        rotary="image_rotary_emb",
        rotary_axis=1,
        stream=TEXT_SUFFIX,
        sequence_first=True,
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # JoyImage-Edit: image and text streams apart, joint attention over [image; text], an image MLP;
        "joyimage",  # rotary (cos, sin) per stream, the image's first; its edit items follow the target as a tail
        ("JoyImageTransformerBlock",),
        (Sublayer("attn", "attn", text=TEXT_AFTER, output=0, attention=True), Sublayer("img_mlp", "mlp")),
        rotary="image_rotary_emb",
        rotary_items=(0,),
    ),
    BlockFamily(  # JoyImage-Edit-Plus: as JoyImage-Edit, with a key mask over [image patches; text] and one rotary
        "joyimage-edit-plus",  # table (cos, sin) [B, patches, d] per batch item, over the image patches only
        ("JoyImageEditPlusTransformerBlock",),
        (
            Sublayer("attn", "attn", text=TEXT_AFTER, output=0, attention=True, masks=(("attention_mask", (-1,)),)),
            Sublayer("img_mlp", "mlp"),
        ),
        rotary="image_rotary_emb",
        rotary_axis=1,
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Lumina-Next: attention and cross-attention side by side on the image, their outputs
        "lumina-next",  # [B, N, heads, d] summed before one projection; queries' and keys' rotary tables apart
        ("LuminaNextDiTBlock",),
        (
            Sublayer(
                "attn1", "attn", attention=True, masks=(("attention_mask", (-1,)),), aligned=("encoder_hidden_states",),
                log_bases=("base_sequence_length",),
            ),
            Sublayer("attn2", "crossattn"),
            Sublayer("feed_forward", "mlp"),
        ),
        rotary="query_rotary_emb",
        key_rotary="key_rotary_emb",
        rotary_axis=1,
        timesteps=1.0,
        timesteps_rise=True,  # its pipeline passes 1 - t / 1000
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Bria-FIBO 2: Z-Image's block on one stream [gist; image; context images], the gist a Perceiver's
        "bria-fibo2",  # summary of the text; [image; context; gist] under a key mask when the batch pads the gist
        ("BriaFibo2TransformerBlock",),
        (
            Sublayer("attention", "attn", text=TEXT_PREFIX, attention=True, masks=(("attention_mask", (-1,)),)),
            Sublayer("cross_attention", "crossattn", text=TEXT_PREFIX),  # its injection blocks' (to the text)
            Sublayer("feed_forward", "mlp", text=TEXT_PREFIX),
        ),
        rotary="freqs_cis",  # one complex table [1, tokens, d/2] over the stream
        rotary_axis=1,
        stream=TEXT_PREFIX,
        timesteps=1.0,
        text_after_with="attn_mask",
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Qwen-Image 2.1: one stream [text with condition images; target image] (the target last: ModelLayout.grid_last),
        "qwen-image-21",  # its attention block-causal (the prefix never sees the target), prefilled segment by segment;
        ("QwenImage21TransformerBlock",),  # its cached steps run on the target alone, the prefix's keys cached before it
        (
            Sublayer(
                "attn", "attn", text=TEXT_BEFORE, attention=True, masks=(("key_valid", (-1,)), ("attention_mask", (-1,))),
            ),
            Sublayer("img_mlp", "mlp"),
        ),
        rotary="rotary_emb",  # one complex table [tokens, d/2] over the stream
        timesteps=1.0,
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # UNet2DModel (DDPM, LDM): each Attention of its ResNet-style blocks, on the 4-D feature map, with
        "unet2d-attention",  # its group norm and residual inside
        ("Attention",),
        (Sublayer("", "attn", attention=True, projections=("to_q", "to_k", "to_v", "to_out.0")),),
        feature_map=True,
        models=("UNet2DModel",),
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Stable Cascade (Würstchen v3) stages B and C: an attention block on the 4-D feature map, its
        "cascade-attention",  # norm and residual in the block, the attention's own group norm absent
        ("SDCascadeAttnBlock",),
        (
            Sublayer(
                "attention", "attn", text=TEXT_AFTER, attention=True, text_unless="self_attn",
                projections=("to_q", "to_k", "to_v", "to_out.0"),
            ),
        ),
        feature_map=True,
        timesteps=1.0,  # its timestep_ratio, from 1 to 0 while sampling
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Kandinsky 3's attention block on the 4-D feature map: conditional group norm, attention (self, or
        "kandinsky3-attention",  # cross to the text) and residual, then a 1x1-convolution MLP, all in the block
        ("Kandinsky3AttentionBlock",),
        (Sublayer("attention", "attn", attention=True, projections=("to_q", "to_k", "to_v", "to_out.0")),),
        feature_map=True,
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # Ideogram 4: one packed stream [left padding; text; image] per row (ModelLayout.roles place the image),
        "ideogram4",  # a segment mask over it on both axes and an MRoPE table (cos, sin) [B, tokens, d] per token
        ("Ideogram4TransformerBlock",),
        (
            Sublayer("attention", "attn", text=TEXT_PREFIX, attention=True, masks=(("attention_mask", (-2, -1)),)),
            Sublayer("feed_forward", "mlp", text=TEXT_PREFIX),
        ),
        rotary="image_rotary_emb",
        rotary_axis=1,
        stream=TEXT_PREFIX,
        timesteps=1.0,
        timesteps_rise=True,  # its time runs from 0 (noise) to 1 (clean)
    ),
)

BLOCK_FAMILIES += (
    BlockFamily(  # MiniMax-H3: one packed stream [text; condition frames; audio; video] (ModelLayout.roles place the video),
        "minimax-h3",  # modulated per row outside its sub-layers; one rotary table (cos, sin) [tokens, d] for the batch
        ("MiniMaxH3TransformerBlock",),
        (Sublayer("attn", "attn", text=TEXT_PREFIX, attention=True), Sublayer("ff", "mlp", text=TEXT_PREFIX)),
        rotary="rotary_emb",
        stream=TEXT_PREFIX,
        timesteps=1.0,
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
    """A module class whose transformer blocks attend across frames (tokens = frames, one sequence per pixel).

    ToMe never hooks a block inside one (nor one of these classes itself): its tokens are not a 2-D grid.
    children: the attributes that hold its temporal blocks when the module also holds spatial ones (SVD's
    ``TransformerSpatioTemporalModel``); empty: everything inside it is temporal.
    """

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
    """How the call of a video transformer gives its token grid, where the shape of its input and a config
    ``patch_size`` cannot tell: its tokens are one frame-major sequence of ``frames x rows x cols`` tokens, read
    as the frames' grids stacked in rows (as Wan's).

    frames_axis: the frames' axis of its 5-D latent: 2 for ``(B, C, F, H, W)``, 1 for ``(B, F, C, H, W)``
        (CogVideoX); None for packed tokens ``[B, N, C]``, whose sizes come from ``sizes``. A list of
        ``[C, F, H, W]`` latents (Z-Image) reads as their batch.
    temporal_patch: the config key of its temporal patch size (absent, None or naming None: 1).
    sizes: the call's arguments that give ``(frames, height, width)`` of packed tokens (latent units).
    patch_arguments: the call's arguments that give ``(temporal, spatial)`` patch sizes (Z-Image), their
        defaults those of the model's ``forward``; else the config's (a 3-D ``patch_size`` gives both).
    channels_last: its latent is ``(B, F, H, W, C)`` (Kandinsky 5 and 6), frames on ``frames_axis`` 1.
    coords: the call's argument of per-token ``(t, h, w)`` coordinates ``[B, 3, N]``, read where ``sizes`` are not
        given: the video's frames last, after conditioning tokens (LTX-Video's condition pipeline).
    frame_types: the call's argument of per-frame token types ``[B, F]``: the frames after the last one of type 0
        are conditions that pass through as a tail (Kandinsky 6's image to video appends its clean reference frame,
        of type 1, to the noisy ones).
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
    """How the call of a model on packed sequences tells which of its tokens are the image's: a per-token role
    indicator rather than the tokens' order (Ideogram 4 packs ``[left padding; text; image]`` per row, the
    padding's length the prompt's; MiniMax-H3 one layout ``[text; condition frames; audio; video]`` that its batch
    shares, placed by index tables). Where every row ends its tokens of the image's role with one run at the same
    place, in one segment, under the same ids, that run is the grid (a video's frames, read from ``ids``); every
    token before and after it (text, audio, other samples, earlier runs of that role such as condition frames)
    passes through unmerged. Other packings (the runs at other places per row) run unmerged, said once.

    indicator: the call's argument of per-token roles ``[B, L]`` (or ``[L]``, one layout for the batch).
    image: the role value of the image's tokens.
    ids: the call's argument of per-token ids ``[B, L, 3]`` (or ``[L, 3]``): ``(t, row, col)``, which place the run
        on its grid.
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
    """What a model class's call and children tell beyond its blocks' families, in one record (the model's
    :mod:`~tome_core.models.grid_readers` reader is chosen from it). A model class named nowhere here has the default:
    its grid is its latent's shape over its config's ``patch_size``, or its packed tokens' ids.

    video: its tokens are a frame-major video sequence (:class:`GridLayout`).
    roles: a per-token role tells which packed tokens are the image's (:class:`TokenRoles`).
    context_latents: its call takes further images' latents as a list argument of this name (each ``(B, C, h,
        w)``), whose tokens follow the output's in its blocks' image stream: a tail (Bria-FIBO 2's images to edit).
    grid_last: its blocks' image stream ends with the latent's tokens, after tokens that pass through unmerged:
        other grids (FramePack's clean and history latents, Helios' history) or the prompt (OmniGen's text, input
        images and time token, all in one stream; Qwen-Image 2.1's text and condition images, its target the last
        of its ``img_shapes``).
    text_only: children (dotted paths) holding blocks of a known family that run on the text alone (Z-Image's and
        Lumina 2's caption refiners), on other tokens than the output image's (FLUX.3's reference-image blocks),
        or that are another model's own modules (the Z-Image ControlNet's refiners are its transformer's, given
        by ``from_transformer``; that model's patch hooks them): never hooked through this model.
    lent: children that another model runs inside its own call (it borrowed them: a ZImageControlNetModel built
        ``from_transformer`` runs the transformer's noise refiner): their blocks merge only inside this model's call.
    grid_source: a child whose 4-D output ``(B, C, h, w)`` is the grid of the blocks after it, in a model that
        flattens a feature map into its blocks' tokens itself (aMUSEd's UVit runs its transformer layers on its
        down block's output, its VQ codes' grid downsampled).
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
    """How a UNet that is not laid out as diffusers' (``down_blocks``, ``mid_block``, ``up_blocks``) runs through its
    levels: the ``ldm`` ``UNetModel`` of A1111-style UIs and sdkit runs ``input_blocks``, ``middle_block`` and
    ``output_blocks``, each part a sequence of layers, and a part that holds a downsampler halves the grid of the
    parts after it (an upsampler doubles it). Its latent is its call's first input, ``(B, C, H, W)``.

    parts: its children in the order its call runs them, each a module or a list of modules (the parts).
    downsample, upsample: the class names of the layers that halve and double the grid after their part.
    containers: its 2-D containers, whose 4-D input ``(B, C, H, W)`` is the grid of the blocks inside
        (:data:`GRID_CONTAINERS` holds diffusers' own).
    counted: its children in the order its blocks are counted (their indices in ``blocks``, ``block_ratios``, and
        the partitions each block draws): as diffusers counts the same UNet's (its down blocks, up blocks, then
        its middle block), so that the same options on the same weights merge alike in both libraries.
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
    """The :data:`MODEL_LAYOUTS` record of a model class (or of its nearest base class named there), else the
    default layout."""
    return _nearest(_MODEL_LAYOUTS, cls) or _DEFAULT_LAYOUT


@dataclass(frozen=True)
class IdsMaker:
    """A pipeline method that makes the ids of packed image tokens, one raster grid of ``rows x cols`` tokens (its
    arguments of those names, in tokens): ``patch`` on a pipeline wraps it on that pipeline object
    (:func:`~tome_core.hooks.call_hooks.tell_grids`) so that the ids it returns carry their grid, and the model's reader
    places its tokens without reading the ids on the host, a graph break that ``torch.compile(fullgraph=True)``
    refuses (a pipeline makes new ids in every generation)."""

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
    """An attention class with no processor, whose own ``forward`` computes the attention (the ``ldm``
    ``CrossAttention`` of A1111-style UIs and sdkit). It computes its keys and values from its sub-layer's
    ``kv_input`` (:class:`Sublayer`), so the ``kv`` arrangement hands it the merged tokens there.

    classes: its classes (library-qualified, as ``"ldm:CrossAttention"``).
    through: what it computes attention through, named in messages.
    softmax: its own code normalises its scores with torch's softmax over the keys (the last axis), where
        size-aware attention adds the merged keys' log sizes to that call's input; False: a kernel that takes no
        bias computes it, and size-aware attention is refused there at ``patch``.
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
    """The submodule at a dotted attribute ``path`` of ``module`` (``"video_dec_block.self_attention"``: a
    sub-layer of a block nested in the block, Kandinsky 6's; ``""``: ``module`` itself, a block that is its own
    sub-layer), or None."""
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
    """The family of a block class (or of the nearest base class named in the table), or None; with ``model``,
    the class of the model it sits in, also the families found only inside such models
    (:attr:`BlockFamily.models`)."""
    found = _nearest(_BY_CLASS, cls)
    if found is None and model is not None:
        scoped = _nearest(_SCOPED, model)
        found = _nearest(scoped, cls) if scoped else None
    return found


def temporal(cls: type) -> Optional[Temporal]:
    """The :data:`TEMPORAL` entry of a module class (or of the nearest base class named there), or None."""
    return _nearest(_TEMPORAL, cls)
