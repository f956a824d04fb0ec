"""Video presets of ``python -m tome_core.bench``: AnimateDiff and Stable Video Diffusion UNets, random weights.

``--preset animatediff`` (SD 1.5's UNet with the MotionAdapter of animatediff-motion-adapter-v1-5-2, 16 frames,
512x512), ``--preset svd`` (Stable Video Diffusion's UNetSpatioTemporalConditionModel, 14 frames; by default at
256x448, see :data:`tome_core.presets.VIDEO_PRESETS`) and their test-sized ``tiny-animatediff`` / ``tiny-svd``
run through the bench's own machinery (:func:`tome_core.bench.run_one`: alternating calls, medians, the oracle,
``--variant``): only the inputs, the model call and the metrics below are video's.

* Inputs: one video per batch entry (``--batch 2``: one video with classifier-free guidance), ``--frames``
  frames (default the preset's) of image-like latents panning one latent pixel per frame (consecutive frames
  nearly identical, as in real videos), noised to the mid timestep with independent noise per frame.
  AnimateDiff gets seeded text embeddings repeated per frame (as ``AnimateDiffPipeline`` does); SVD a seeded
  image embedding, the first clean frame's latents as its conditioning image (concatenated to every frame's
  channels), the released pipeline's added time ids (fps 7, motion bucket 127, noise augmentation 0.02) and
  its EDM timestep ``0.25 log sigma``, with the DDIM loop in v-prediction (SVD's parameterisation, the same
  arithmetic). ``--resolution`` is the frame height; the width keeps the preset's aspect ratio (multiples of
  64 px).
* Metrics, for any method or variant (per-frame merging, cross-frame merging, the oracle), on the model's
  output at the mid timestep (and ``tdiff@loop ratio`` on the final latents of ``--steps`` DDIM steps):
  ``fid@t/frame`` and ``fid@t worst``, the relative L2 distance to the unpatched output per frame (mean over
  frames, worst frame); ``tdiff@t``, temporal consistency: the mean absolute difference between consecutive
  frames of the output, and ``tdiff@t ratio``, that over the unpatched output's (1: as steady as unpatched;
  above 1: more flicker); ``motion err``, the relative L2 distance of the consecutive-frame differences to the
  unpatched output's (how much of the frame-to-frame change merging alters, whatever its size).
* The peer (tomesd 0.1.3) is skipped: it takes the latent size from dimensions 2 and 3 of the UNet's first
  argument (a 4-D image batch) and hooks every ``BasicTransformerBlock``. On AnimateDiff (``[B, C, F, H, W]``,
  motion modules made of such blocks) a call raises ZeroDivisionError; on SVD (``[B, F, C, H, W]``) it takes
  channels x height for the grid, right only when the latent is 8 high.
* The oracle removes the token counts of per-frame merging from every frame (spatial blocks see
  ``batch * frames`` sequences); it cannot follow cross-frame merging (``frames_per_chunk > 1``), whose
  oracle the bench refuses.

Framework-free (numpy only); ``tome_core.adapters.diffusers_video_bench`` adds torch.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np

from tome_core.bench import image_like_latents, noised, relative_l2
from tome_core.presets import VIDEO_PRESETS, VIDEO_UNETS

VIDEO_RUNNERS = {"torch": "diffusers_video_bench"}
# Options of cross-frame merging; the oracle follows per-frame merging only.
CROSS_FRAME_OPTIONS = ("frames_per_chunk", "frame_ratio")


@dataclass(frozen=True)
class VideoSpec:
    """How the bench feeds one video UNet family, by diffusers' class name (ppdiffusers keeps it).

    frame_axis: where the frames sit in the model's sample and output (``[B, C, F, H, W]``: 2; ``[B, F, C, H,
        W]``: 1).
    text_per_frame: the text embeddings are repeated per frame (``UNetMotionModel``).
    image_conditioned: SVD: an image embedding instead of text, the conditioning image's latents concatenated
        to every frame's channels, added time ids, and EDM's ``0.25 log sigma`` as the timestep.
    """

    frame_axis: int
    text_per_frame: bool = False
    image_conditioned: bool = False


VIDEO_SPECS: Dict[str, VideoSpec] = {
    "UNetMotionModel": VideoSpec(frame_axis=2, text_per_frame=True),
    "UNetSpatioTemporalConditionModel": VideoSpec(frame_axis=1, image_conditioned=True),
}
PEER_NOTE = (
    "tomesd does not apply to video UNets: it reads the latent size from dims 2-3 of a 4-D first argument "
    "(AnimateDiff: ZeroDivisionError; SVD: channels x height taken for the grid)"
)
SVD_TIME_IDS = (6.0, 127.0, 0.02)  # fps - 1 (fps 7), motion bucket id, noise augmentation strength


def video_spec(model: Any) -> VideoSpec:
    for cls in type(model).__mro__:
        if cls.__name__ in VIDEO_SPECS:
            return VIDEO_SPECS[cls.__name__]
    raise ValueError(f"no video inputs known for {type(model).__name__}; known: {', '.join(VIDEO_SPECS)}")


def is_video(args: argparse.Namespace) -> bool:
    """The run is of a video preset."""
    return not getattr(args, "model", None) and getattr(args, "preset", None) in VIDEO_PRESETS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frames", type=int, default=None,
                   help="video presets (animatediff, svd, tiny-animatediff, tiny-svd): frames per video (default "
                   "the preset's: 16, 14, 4, 4); their --resolution is the frame height, the width keeps the "
                   "preset's aspect ratio (svd: 16:9)")


def frame_size(preset: str, resolution: int) -> Tuple[int, int]:
    """``(height, width)`` in pixels of a video preset's frames at height ``resolution``: the preset's own size
    at its own height, else its aspect ratio with the width rounded to a multiple of 64 px."""
    height, width = VIDEO_PRESETS[preset]["size"]
    if resolution == height:
        return height, width
    return resolution, max(64, round(resolution * width / height / 64) * 64)


def max_frames(preset: str) -> Optional[int]:
    """The most frames a preset's model takes (AnimateDiff: its motion modules' positions), or None."""
    adapter = VIDEO_PRESETS[preset].get("adapter")
    return VIDEO_UNETS[adapter][1].get("motion_max_seq_length", 32) if adapter else None


def size_label(args: argparse.Namespace, resolution: int) -> str:
    """How a run's title names its size: ``512px``, or ``16 frames of 512x512px`` for a video preset."""
    if not is_video(args):
        return f"{resolution}px"
    height, width = frame_size(args.preset, resolution)
    return f"{args.frames} frames of {height}x{width}px"


def _cross_frame(options: Dict[str, Any]) -> bool:
    return (options.get("frames_per_chunk") or 1) > 1


def resolve(args: argparse.Namespace, explicit_methods: bool) -> None:
    """A video preset's defaults (``--resolution``: its frame height; ``--frames``) and what it refuses, before
    anything is built: another backend, ``--model``, ``--stack``, ``--micro``, the peer, fewer than 2 frames or
    more than the model takes, and the oracle of cross-frame merging. ``--frames`` elsewhere is refused."""
    if not is_video(args):
        if getattr(args, "frames", None) is not None:
            raise SystemExit(f"--frames: only the video presets ({', '.join(VIDEO_PRESETS)}) have frames")
        return
    preset = args.preset
    if args.backend not in VIDEO_RUNNERS:
        raise SystemExit(f"--preset {preset}: the video presets run on {', '.join(VIDEO_RUNNERS)}, not --backend {args.backend}")
    for flag, given in (("--stack", args.stack), ("--micro", args.micro)):
        if given:
            raise SystemExit(f"--preset {preset} with {flag}: the video presets time single UNet calls; leave out {flag}")
    if explicit_methods and "peer" in args.methods:
        raise SystemExit(
            f"--methods peer: {PEER_NOTE} (--preset {preset})"
        )
    if args.frames is None:
        args.frames = VIDEO_PRESETS[preset]["frames"]
    limit = max_frames(preset)
    if args.frames < 2 or (limit is not None and args.frames > limit):
        most = f" and at most {limit} (its motion modules' positions)" if limit else ""
        raise SystemExit(f"--frames {args.frames}: --preset {preset} takes at least 2 frames{most}")
    if args.resolution is None:
        args.resolution = [VIDEO_PRESETS[preset]["size"][0]]
    for resolution in args.resolution:
        if resolution % 64:
            raise SystemExit(f"--resolution {resolution}: video frame heights are multiples of 64 px")
    crossing = [name for name in args.variant_oracles if _cross_frame(args.variants[name])]
    if _cross_frame(args.options) and "oracle" in args.methods:
        crossing.insert(0, "ours (--option)")
    if crossing:
        raise SystemExit(
            f"the oracle slices per frame and cannot follow cross-frame merging (frames_per_chunk > 1) of "
            f"{', '.join(crossing)}: leave it out of --variant-oracles, or run --methods unpatched ours"
        )


def video_latents(batch: int, frames: int, channels: int, height: int, width: int, seed: int = 0, pan: int = 1) -> np.ndarray:
    """Image-like latents (:func:`tome_core.bench.image_like_latents`) of a camera panning ``pan`` latent
    pixels per frame: frame ``f`` is columns ``f * pan ... f * pan + width`` of one wider image. numpy,
    ``[batch, frames, channels, height, width]``, unit variance."""
    wide = image_like_latents(batch, channels, height, width + pan * (frames - 1), seed=seed)
    video = np.stack([wide[..., f * pan : f * pan + width] for f in range(frames)], axis=1)
    return ((video - video.mean()) / video.std()).astype("float32")


def frame_difference(video: Any) -> float:
    """Temporal consistency of ``[batch, frames, ...]``: the mean absolute difference between consecutive
    frames, in float64 (lower is steadier)."""
    x = np.asarray(video, dtype=np.float64)
    return float(np.abs(x[:, 1:] - x[:, :-1]).mean())


def frame_fidelity(video: Any, reference: Any) -> np.ndarray:
    """Per frame of ``[batch, frames, ...]``: the relative L2 distance to the reference's same frame, over the
    batch, channels and pixels, in float64."""
    a, b = np.asarray(video, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    axes = (0,) + tuple(range(2, a.ndim))
    return np.sqrt(((a - b) ** 2).sum(axis=axes) / (b**2).sum(axis=axes))


def video_metrics(output: Any, reference: Any, frame_axis: int, sampled: Any = None, reference_sampled: Any = None) -> Dict[str, float]:
    """The video columns of one method's row: ``fid@t/frame`` and ``fid@t worst`` (per-frame relative L2 to
    the unpatched output, mean and worst frame), ``tdiff@t`` (mean absolute difference of consecutive output
    frames), ``tdiff@t ratio`` (over the unpatched output's) and ``motion err`` (relative L2 of the
    consecutive-frame differences to the unpatched output's); with a loop's final latents,
    ``tdiff@loop ratio`` likewise. Outputs are in the model's layout, frames on ``frame_axis``."""
    frames = lambda x: np.moveaxis(np.asarray(x, dtype=np.float64), frame_axis, 1)
    out, ref = frames(output), frames(reference)
    per_frame = frame_fidelity(out, ref)
    temporal = frame_difference(out)
    metrics = {
        "fid@t/frame": float(per_frame.mean()),
        "fid@t worst": float(per_frame.max()),
        "tdiff@t": temporal,
        "tdiff@t ratio": temporal / frame_difference(ref),
        "motion err": relative_l2(np.diff(out, axis=1), np.diff(ref, axis=1)),
    }
    if sampled is not None and reference_sampled is not None:
        metrics["tdiff@loop ratio"] = frame_difference(frames(sampled)) / frame_difference(frames(reference_sampled))
    return metrics


class VideoBench:
    """What a framework's bench runner adds for a video UNet (mix in before it): video inputs in the model's
    layout, the call's keyword arguments, the preset's DDIM schedule, the video metrics of each row and the
    cross-frame options in its note. The framework side supplies ``to_tensor``, ``normal_draws``,
    ``scheduler_class`` and the model call (as :class:`tome_core.bench_runner.BenchRunner`'s subclasses do)."""

    has_peer = False
    video: VideoSpec

    def own_scheduler(self) -> Any:
        """DDIM with SD's betas and the preset's changes (AnimateDiff's linear schedule, SVD's v-prediction)."""
        from tome_core.bench_runner import DDIM_CONFIG

        return self.scheduler_class(**{**DDIM_CONFIG, **VIDEO_PRESETS[self.args.preset].get("scheduler", {})})

    def _build_inputs(self, config: Any) -> None:
        """The mid-timestep video (:func:`video_latents`, noised per frame), the loop's starting noise and the
        conditioning of :class:`VideoSpec`, seeded like the image presets' inputs."""
        from tome_core.backend import get_ops
        from tome_core.bench_runner import MID_TIMESTEP

        args = self.args
        self.video = video_spec(self.unet)
        self.frames = args.frames
        height, width = frame_size(args.preset, args.resolution)
        self.latent_hw = (height // self.latent_scale, width // self.latent_scale)
        self.description = f"{args.preset} {size_label(args, args.resolution)} batch {args.batch}"
        channels = config.out_channels if self.video.image_conditioned else config.in_channels
        shape = (args.batch, args.frames, channels) + self.latent_hw
        if getattr(args, "latents", "image") == "image":
            clean = video_latents(*shape, seed=0)
        else:
            clean = np.random.default_rng(0).standard_normal(shape).astype("float32")
        noise = np.random.default_rng(1).standard_normal(shape).astype("float32")
        layout = lambda x: self.to_tensor(np.ascontiguousarray(np.moveaxis(x, 1, self.video.frame_axis)))
        self.sample_in = layout(noised(clean, noise, self.alpha_bar(MID_TIMESTEP)))
        self.noise = layout(noise)
        self.timestep = self.as_timestep(MID_TIMESTEP)
        self.added = None
        draw = self.normal_draws(seed=2)
        if self.video.image_conditioned:
            self.text = draw((args.batch, 1, config.cross_attention_dim))
            self.image_latents = layout(np.repeat(clean[:, :1], args.frames, axis=1))
            self.time_ids = self.to_tensor(np.array([SVD_TIME_IDS] * args.batch, dtype="float32"))
        else:
            text = draw((args.batch, 77, config.cross_attention_dim))
            ops = get_ops(text)
            self.text = ops.take(text, ops.arange(args.batch * args.frames, text) // args.frames, axis=0) if self.video.text_per_frame else text

    def video_kwargs(self, sample: Any, timestep: Any) -> Dict[str, Any]:
        """Keyword arguments of one model call on ``sample`` (model layout) at scheduler timestep ``timestep``."""
        kwargs = dict(sample=sample, timestep=timestep, encoder_hidden_states=self.text)
        if self.video.image_conditioned:  # EDM: sigma of the DDIM step, timestep 0.25 log sigma
            from tome_core.backend import get_ops

            alpha = self.alpha_bar(int(timestep))
            kwargs["timestep"] = 0.25 * math.log(math.sqrt((1 - alpha) / alpha))
            kwargs["sample"] = get_ops(sample).concat([sample, self.image_latents], axis=2)
            kwargs["added_time_ids"] = self.time_ids
        return kwargs

    def row_metrics(self, output: Any, reference: Any, sampled: Any = None, reference_sampled: Any = None) -> Dict[str, float]:
        """The video columns of a row (:func:`video_metrics`)."""
        return video_metrics(output, reference, self.video.frame_axis, sampled, reference_sampled)

    def effective(self, name: str, ratio: float) -> Tuple[float, str]:
        """The bench's ratio and note, with the cross-frame options 'ours' or a variant sets."""
        shown, note = super().effective(name, ratio)
        if name.startswith("ours"):
            options = self.options_for(name, ratio)
            crossing = ", ".join(f"{k}={options[k]}" for k in CROSS_FRAME_OPTIONS if k in options)
            note = "; ".join(part for part in (note, crossing) if part)
        return shown, note

    def peer_note(self) -> str:
        return PEER_NOTE
