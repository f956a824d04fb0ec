"""What ToMe needs to know about each transformer block family, as data (framework-free).

A block family says which of a block's sub-layers are wrapped in merge/unmerge, where the image tokens are in
each one's input and output, and where text tokens sit beside them in its attention. The driver
(:mod:`tome_core.driver`) reads these descriptions; adding a model family is adding an entry here. Classes are
named, not imported, so the same table serves diffusers (torch), ppdiffusers (paddle) and any library that
keeps diffusers' class names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

# Where a sub-layer's attention finds text tokens beside the (merged) image tokens.
TEXT_NONE = "none"  # none: self-attention over the image tokens (or cross-attention to a separate context)
TEXT_AFTER = "after"  # joint attention over [image; text], text from ``encoder_hidden_states`` (SD3)
TEXT_BEFORE = "before"  # joint attention over [text; image], text from ``encoder_hidden_states`` (Flux)
TEXT_PREFIX = "prefix"  # the sub-layer's own input is [text; image] (Flux's single-stream block)


@dataclass(frozen=True)
class Sublayer:
    """One sub-layer of a block that runs on merged image tokens.

    child: the block's attribute holding the sub-layer module.
    kind: which option selects it and which ratio it uses: "attn", "crossattn" or "mlp".
    text: where text tokens sit in its input or attention (``TEXT_*``).
    output: index of the image stream when the sub-layer returns a tuple (joint attention), else None.
    attention: its keys are its own merged tokens, so size-aware attention applies.
    kv_input: the keyword argument through which the attention takes keys and values apart from its queries
        (diffusers' ``encoder_hidden_states``); the ``kv`` and ``queries`` arrangements need one.
    text_if: a flag of the block that, when true, makes this attention attend to the text instead of its own
        tokens (``BasicTransformerBlock.only_cross_attention``): it has no self-attention keys to arrange.
    """

    child: str
    kind: str
    text: str = TEXT_NONE
    output: Optional[int] = None
    attention: bool = False
    kv_input: Optional[str] = None
    text_if: Optional[str] = None


@dataclass(frozen=True)
class BlockFamily:
    """A transformer block class (by name) and the sub-layers ToMe wraps.

    The block's first input (``hidden_states``) is its image stream: the match is computed from it.
    rotary: argument of the sub-layers carrying rotary position embeddings ``(cos, sin)`` of ``[text; image]``
        tokens (by keyword or at its place in the sub-layer's ``forward``); merged tokens then take their
        destination's position, and the match is shared by the batch so that every merged token has one
        position.
    rotary_axis: the token axis of those tables (Flux: ``[tokens, dim]``; Wan: ``[1, tokens, 1, dim]``).
    timesteps: the largest timestep a model of this family receives from its pipeline (1000 for DDPM-style
        and most flow-matching models; 1 where the pipeline passes sigmas, as Flux's do): ``timestep_range``
        outside ``[0, timesteps]`` is refused.
    """

    name: str
    classes: Tuple[str, ...]
    sublayers: Tuple[Sublayer, ...]
    rotary: Optional[str] = None
    rotary_axis: int = 0
    timesteps: float = 1000.0


BLOCK_FAMILIES: Tuple[BlockFamily, ...] = (
    BlockFamily(
        "basic",  # SD 1.x/2.x/XL UNets, ControlNets, PixArt, DiT; DreamLite's variant (attn1 may be absent)
        ("BasicTransformerBlock", "BasicTransformerBlockDreamLite"),
        (
            Sublayer("attn1", "attn", attention=True, kv_input="encoder_hidden_states", text_if="only_cross_attention"),
            Sublayer("attn2", "crossattn"),
            Sublayer("ff", "mlp"),
        ),
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
        "flux-double",
        ("FluxTransformerBlock",),
        (
            Sublayer("attn", "attn", text=TEXT_BEFORE, output=0, attention=True),
            Sublayer("ff", "mlp"),
        ),
        rotary="image_rotary_emb",
        timesteps=1.0,
    ),
    BlockFamily(
        "flux-single",  # attention and MLP side by side on one normalised [text; image] sequence
        ("FluxSingleTransformerBlock",),
        (
            Sublayer("attn", "attn", text=TEXT_PREFIX, attention=True),
            Sublayer("proj_mlp", "mlp", text=TEXT_PREFIX),
        ),
        rotary="image_rotary_emb",
        timesteps=1.0,
    ),
    BlockFamily(
        "wan",  # Wan 2.1/2.2: one sequence of frames x height x width tokens with 3-D rotary positions
        ("WanTransformerBlock",),
        (
            Sublayer("attn1", "attn", attention=True),
            Sublayer("attn2", "crossattn"),
            Sublayer("ffn", "mlp"),
        ),
        rotary="rotary_emb",
        rotary_axis=1,
    ),
)

_BY_CLASS: Dict[str, BlockFamily] = {name: family for family in BLOCK_FAMILIES for name in family.classes}


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

# Containers whose 4-D input ``(batch [* frames], C, H, W)`` is the token grid of the (spatial) blocks inside.
GRID_CONTAINERS: Tuple[str, ...] = ("Transformer2DModel", "TransformerSpatioTemporalModel", "DreamLiteTransformer2DModel")

_TEMPORAL: Dict[str, Temporal] = {entry.name: entry for entry in TEMPORAL}


def _nearest(table: Dict[str, Any], cls: type) -> Any:
    """The entry of ``table`` for ``cls`` or for the nearest of its base classes named there, or None."""
    for base in cls.__mro__:
        entry = table.get(base.__name__)
        if entry is not None:
            return entry
    return None


def block_family(cls: type) -> Optional[BlockFamily]:
    """The family of a block class (or of the nearest base class named in the table), or None."""
    return _nearest(_BY_CLASS, cls)


def temporal(cls: type) -> Optional[Temporal]:
    """The :data:`TEMPORAL` entry of a module class (or of the nearest base class named there), or None."""
    return _nearest(_TEMPORAL, cls)
