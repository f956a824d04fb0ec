"""Which model classes of diffusers ToMe refuses, and why (framework-free; classes are named, not imported).

A model class merges when it holds blocks of a family in :mod:`tome_core.models.families`; every other model class
diffusers exports is listed here with the reason ``patch`` gives. The zoo test (``tests/torch/test_zoo.py``) fails on
a diffusers class that is neither merged-and-tested nor listed, so a new model is classified before it is claimed.
"""

from __future__ import annotations

from typing import Dict, Optional

_AUDIO = "generates audio, a 1-D sequence of tokens with no image grid to merge on"
_NOT_A_GRID = "its tokens are not an image's: there is no spatial grid whose neighbours ToMe for SD merges"

# Classes that generate neither images nor video (or cannot run alone): outside the zoo's coverage count.
_NOT_GENERATION: Dict[str, str] = {
    "AceStepTransformer1DModel": _AUDIO,
    "StableAudioDiTModel": _AUDIO,
    "StableAudio3DiTModel": _AUDIO,
    "LongCatAudioDiTTransformer": _AUDIO,
    "MiniMaxMusic3Transformer1DModel": _AUDIO,
    "MiniMaxMusic3RVQDepthDecoder": _AUDIO,
    "T5FilmDecoder": _AUDIO + " (spectrogram frames conditioned on notes)",
    "UNet1DModel": "runs on 1-D signals (audio, trajectories), not on an image grid",
    "RFD4ProteinaTransformer": "generates protein structures: " + _NOT_A_GRID,
    "PriorTransformer": "maps a text embedding to a CLIP image embedding (a few tokens): " + _NOT_A_GRID,
    "MotionAdapter": (
        "holds only AnimateDiff's motion modules, whose tokens are frames; patch the UNetMotionModel built from "
        "it (UNetMotionModel.from_unet2d(unet, adapter)) or the AnimateDiff pipeline"
    ),
    "TransformerTemporalModel": (
        "attends across frames (its tokens are one pixel's frames, not an image grid); the video UNets that hold it "
        "merge their spatial blocks and leave it alone"
    ),
    "ControlNetXSAdapter": (
        "cannot run by itself (diffusers runs it only inside a UNetControlNetXSModel); patch the "
        "UNetControlNetXSModel built from it (UNetControlNetXSModel.from_unet(unet, adapter)), whose blocks merge"
    ),
}
NOT_GENERATION = frozenset(_NOT_GENERATION)

REFUSED: Dict[str, str] = {
    **_NOT_GENERATION,
    # merging cannot pay, or cannot be right
    "SanaTransformer2DModel": (
        "its self-attention is linear attention (no attention matrix to shrink) and its feed-forward a 3x3 "
        "convolution over the grid (GLUMBConv), which needs every token: merging would shrink a fifth of a block at "
        "ratio 0.5 and cost more than that"
    ),
    "SanaControlNetModel": "its blocks are Sana's (see SanaTransformer2DModel): linear attention and a convolutional feed-forward over the grid",
    "SanaVideoTransformer3DModel": (
        "its self-attention is linear attention and its feed-forward convolves over space and time (GLUMBTempConv), "
        "which needs every token of every frame: merging could shrink only the attention's projections"
    ),
    "SanaWMTransformer3DModel": (
        "its token mixer is a gated delta-net linear attention along time (a recurrence per pixel) with temporal "
        "convolutions, and its feed-forward convolves over the grid: every token is needed"
    ),
    "SanaWMLTX2RefinerTransformer3DModel": (
        "a chunk-causal autoregressive refiner with a per-layer cache of keys and values per token (sink and history "
        "windows): merged tokens would put the cache out of step"
    ),
    "AnyFlowFARTransformer3DModel": (
        "frame-autoregressive: causal attention through a flex-attention block mask over frames and a key-value "
        "cache filled frame by frame, which merged tokens would break"
    ),
    "Kandinsky6SRTransformer3DModel": (
        "its self-attention is always NABLA block-sparse flex attention over 8x8-token tiles: there is no dense "
        "attention over the grid to shrink, and merged tokens would leave the tiles"
    ),
    "WanAnimate2Transformer3DModel": (
        "its self-attention packs each frame's tokens into 128-aligned buffers for a flex-attention block mask, "
        "caches the reference frames' keys and recomputes rotary positions from the grid inside the processor: "
        "merged tokens fit none of these"
    ),
    "Cosmos3OmniTransformer": (
        "a mixture-of-transformers decoder whose layers take two batchless streams (text first, then vision, sound "
        "and action), each with its own projections: ToMe's blocks take their image stream as their first, batched "
        "input (not supported)"
    ),
}


# Listed classes that a pipeline holds beside a model that merges (AnimateDiff's motion adapter): they do not stop
# the pipeline's patch; every other listed class does.
AUXILIARY = frozenset({"MotionAdapter", "ControlNetXSAdapter", "TransformerTemporalModel"})


def refusal(cls: type) -> Optional[str]:
    """Why ``patch`` refuses a model of class ``cls`` (or of its nearest base listed in :data:`REFUSED`), or None."""
    return next((REFUSED[base.__name__] for base in cls.__mro__ if base.__name__ in REFUSED), None)
