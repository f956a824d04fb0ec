"""Which model classes of diffusers ToMe refuses, and why (framework-free; classes are named, not imported).

A model class merges when it holds transformer blocks of a family in :mod:`tome_core.families` (and the driver
can tell their token grid); every other image or video generation class diffusers exports is listed here with
the reason ``patch`` gives for refusing it. The zoo test (``tests/torch/test_zoo.py``) enumerates diffusers'
model classes and fails on one that is neither merged-and-tested nor listed here, so a diffusers release that
adds a model is classified before it is claimed.
"""

from __future__ import annotations

from typing import Dict, Optional

_AUDIO = "generates audio, a 1-D sequence of tokens with no image grid to merge on"
_NOT_A_GRID = "its tokens are not an image's: there is no spatial grid whose neighbours ToMe for SD merges"
_OWN_ATTENTION = (
    "its attention layers sit inside its own ResNet-style blocks rather than in transformer blocks with "
    "separate attention and feed-forward sub-layers; ToMe for SD merges transformer blocks only"
)

REFUSED: Dict[str, str] = {
    # not image or video generation
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
    "UVit2DModel": (
        "aMUSEd's UVit runs its transformer layers on tokens it flattens itself after a downsampling block, and "
        "predicts masked VQ codes rather than a denoised latent; no grid reaches its blocks"
    ),
    # image models whose attention is not in transformer blocks
    "UNet2DModel": _OWN_ATTENTION + " (an unconditional UNet's AttnDownBlock2D: one Attention module per ResNet)",
    "Kandinsky3UNet": _OWN_ATTENTION + " (Kandinsky3AttentionBlock)",
    "StableCascadeUNet": _OWN_ATTENTION + " (SDCascadeAttnBlock: self-attention over [image; condition] tokens)",
}


def refusal(cls: type) -> Optional[str]:
    """Why ``patch`` refuses a model of class ``cls`` (or of its nearest base class listed in :data:`REFUSED`),
    or None."""
    for base in cls.__mro__:
        reason = REFUSED.get(base.__name__)
        if reason is not None:
            return reason
    return None
