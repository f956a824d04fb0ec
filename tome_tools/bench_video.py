"""Video presets of ``python -m tome_tools.bench``: AnimateDiff and Stable Video Diffusion UNets and Wan's video
transformer, random weights.

``--preset animatediff`` (SD 1.5's UNet with the MotionAdapter of animatediff-motion-adapter-v1-5-2, 16 frames,
512x512), ``--preset svd`` (Stable Video Diffusion's UNetSpatioTemporalConditionModel, 14 frames; by default at
256x448, see :data:`tome_tools.presets.VIDEO_PRESETS`), ``--preset wan`` (Wan 2.1 T2V 1.3B's
WanTransformer3DModel, 17 frames at 480x832) and their test-sized ``tiny-animatediff`` / ``tiny-svd`` /
``tiny-wan`` run through the bench's own machinery (:func:`tome_tools.bench.run_one`: alternating calls, medians,
the oracle, ``--variant``): only the inputs, the model call and the metrics below are video's.

* Inputs: one video per batch entry (``--batch 2``: one video with classifier-free guidance), ``--frames``
  frames (default the preset's) of image-like latents panning one latent pixel per frame (consecutive frames
  nearly identical, as in real videos), noised to the mid timestep with independent noise per frame.
  AnimateDiff gets seeded text embeddings repeated per frame (as ``AnimateDiffPipeline`` does); SVD a seeded
  image embedding, the first clean frame's latents as its conditioning image (concatenated to every frame's
  channels), the released pipeline's added time ids (fps 7, motion bucket 127, noise augmentation 0.02) and
  its EDM timestep ``0.25 log sigma``, with the DDIM loop in v-prediction (SVD's parameterisation, the same
  arithmetic). ``--resolution`` is the frame height; the width keeps the preset's aspect ratio (multiples of
  64 px; Wan: 16 px).
* Wan is a diffusion transformer, so everything but the latents is the transformer presets'
  (:data:`tome_tools.bench_runner.TRANSFORMER_SPECS`): flow-matching noising at sigma 0.5 (timestep 500, given
  per batch entry as ``WanPipeline`` gives it), seeded text embeddings of umT5's 512 tokens (``--text-tokens``),
  the transformer oracle. ``--frames`` counts video frames, which Wan's VAE compresses 8x in space and 4x in
  time (the first frame alone, then every 4 into one latent frame), so it takes 4k + 1 frames, (frames - 1) / 4
  + 1 latent frames, at least 2. The loop runs the release's 480p scheduler, UniPC on flow-matching sigmas with
  ``flow_shift`` 3 (what a released Wan is sampled with, rather than the flow-matching Euler of the SD3 preset).
* Metrics, for any method or variant (per-frame merging, cross-frame merging, the oracle), on the model's
  output at the mid timestep (and ``tdiff@loop ratio`` on the final latents of the ``--steps``-step loop):
  ``fid@t/frame`` and ``fid@t worst``, the relative L2 distance to the unpatched output per frame (mean over
  frames, worst frame); ``tdiff@t``, temporal consistency: the mean absolute difference between consecutive
  frames of the output, and ``tdiff@t ratio``, that over the unpatched output's (1: as steady as unpatched;
  above 1: more flicker); ``motion err``, the relative L2 distance of the consecutive-frame differences to the
  unpatched output's (how much of the frame-to-frame change merging alters, whatever its size).
* The peer (tomesd 0.1.3) is skipped: it takes the latent size from dimensions 2 and 3 of the UNet's first
  argument (a 4-D image batch) and hooks every ``BasicTransformerBlock``. On AnimateDiff (``[B, C, F, H, W]``,
  motion modules made of such blocks) a call raises ZeroDivisionError; on SVD (``[B, F, C, H, W]``) it takes
  channels x height for the grid, right only when the latent is 8 high. No ToMe for diffusion transformers
  (Wan) exists besides ours.
* The oracle removes the token counts of per-frame merging from every frame (spatial blocks see
  ``batch * frames`` sequences); it cannot follow cross-frame merging (``frames_per_chunk > 1``), whose
  oracle the bench refuses. On Wan, whose one self-attention already spans the clip, it keeps the first tokens of
  that sequence (as many as 'ours' keeps, rotary positions alike), and ``frames_per_chunk`` is refused.

Framework-free (numpy only); ``tome_tools.diffusers_video_bench`` adds torch.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np

from tome_core.algorithm.backend import get_ops
from tome_tools.bench_core import noised, relative_l2, video_latents
from tome_tools.bench_runner import DDIM_CONFIG, MID_TIMESTEP, NO_TRANSFORMER_PEER, draw_latents
from tome_tools.presets import VIDEO_PRESETS, VIDEO_TRANSFORMERS, VIDEO_UNETS

VIDEO_RUNNERS = {"torch": "diffusers_video_bench"}
# Options of cross-frame merging; the oracle follows per-frame merging only.
CROSS_FRAME_OPTIONS = ("frames_per_chunk", "frame_ratio")


@dataclass(frozen=True)
class VideoSpec:
    """How the bench feeds one video model family, by diffusers' class name (ppdiffusers keeps it).

    frame_axis: where the frames sit in the model's sample and output (``[B, C, F, H, W]``: 2; ``[B, F, C, H,
        W]``: 1).
    text_per_frame: the text embeddings are repeated per frame (``UNetMotionModel``).
    image_conditioned: SVD: an image embedding instead of text, the conditioning image's latents concatenated
        to every frame's channels, added time ids, and EDM's ``0.25 log sigma`` as the timestep.
    stacked: one sequence holds every frame's tokens, which ToMe reads as the frames' grids stacked in rows
        (Wan); else the blocks see each frame's grid on its own.
    """

    frame_axis: int
    text_per_frame: bool = False
    image_conditioned: bool = False
    stacked: bool = False


VIDEO_SPECS: Dict[str, VideoSpec] = {
    "UNetMotionModel": VideoSpec(frame_axis=2, text_per_frame=True),
    "UNetSpatioTemporalConditionModel": VideoSpec(frame_axis=1, image_conditioned=True),
    "WanTransformer3DModel": VideoSpec(frame_axis=2, stacked=True),
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
                   help="video presets (animatediff, svd, wan, tiny-animatediff, tiny-svd, tiny-wan): frames per "
                   "video (default the preset's: 16, 14, 17, 4, 4, 9; Wan's VAE takes 4k + 1 frames, (frames - 1) "
                   "/ 4 + 1 latent frames; its release makes 81); their --resolution is the frame height, the "
                   "width keeps the preset's aspect ratio (svd: 16:9, wan: 480x832)")


def frame_size(preset: str, resolution: int) -> Tuple[int, int]:
    """``(height, width)`` in pixels of a video preset's frames at height ``resolution``: the preset's own size
    at its own height, else its aspect ratio with the width rounded to a multiple of the preset's
    ``size_multiple`` (64 px; Wan: 16)."""
    height, width = VIDEO_PRESETS[preset]["size"]
    if resolution == height:
        return height, width
    multiple = VIDEO_PRESETS[preset].get("size_multiple", 64)
    return resolution, max(multiple, round(resolution * width / height / multiple) * multiple)


def latent_frames(preset: str, frames: int) -> int:
    """The latent frames of ``frames`` video frames: ``(frames - 1) / c + 1`` with the preset's VAE compressing
    time ``c`` times (``time_compression``; Wan: 4, its first frame alone), else ``frames``."""
    return (frames - 1) // VIDEO_PRESETS[preset].get("time_compression", 1) + 1


def max_frames(preset: str) -> Optional[int]:
    """The most frames a preset's model takes (AnimateDiff: its motion modules' positions; Wan: its rotary
    positions, one per latent frame), or None."""
    entry = VIDEO_PRESETS[preset]
    if "adapter" in entry:
        return VIDEO_UNETS[entry["adapter"]][1].get("motion_max_seq_length", 32)
    if "transformer" in entry:
        positions = VIDEO_TRANSFORMERS[entry["transformer"]][1]["rope_max_seq_len"]
        return (positions - 1) * entry.get("time_compression", 1) + 1
    return None


def check_frames(preset: str, frames: int) -> None:
    """Refuse ``--frames`` a preset cannot run, naming the value and what is allowed: fewer than 2 latent frames
    (the temporal metrics compare consecutive frames), more than its model takes, or a count its VAE does not
    produce (Wan: 4k + 1)."""
    compression = VIDEO_PRESETS[preset].get("time_compression", 1)
    least, most = compression + 1, max_frames(preset)
    if compression == 1:
        if frames < least or (most is not None and frames > most):
            bound = f" and at most {most} (the frame positions its model has)" if most else ""
            raise SystemExit(f"--frames {frames}: --preset {preset} takes at least 2 frames{bound}")
        return
    if frames < least or (frames - 1) % compression or (most is not None and frames > most):
        examples = ", ".join(str(least + k * compression) for k in range(3))
        raise SystemExit(
            f"--frames {frames}: --preset {preset} takes {compression}k + 1 frames (its VAE encodes the first frame "
            f"alone and every {compression} after it into one latent frame), from {least} (2 latent frames) to "
            f"{most}: {examples}, ..."
        )


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
    anything is built: another backend, ``--model``, ``--stack``, ``--micro``, the peer, frames the model cannot
    take (:func:`check_frames`), frame heights off the preset's multiple, the oracle of cross-frame merging, and on
    Wan cross-frame merging itself. ``--frames`` elsewhere is refused."""
    if not is_video(args):
        if getattr(args, "frames", None) is not None:
            raise SystemExit(f"--frames: only the video presets ({', '.join(VIDEO_PRESETS)}) have frames")
        return
    preset = args.preset
    if args.backend not in VIDEO_RUNNERS:
        raise SystemExit(f"--preset {preset}: the video presets run on {', '.join(VIDEO_RUNNERS)}, not --backend {args.backend}")
    for flag, given in (("--stack", args.stack), ("--micro", args.micro)):
        if given:
            raise SystemExit(f"--preset {preset} with {flag}: the video presets time single model calls; leave out {flag}")
    entry = VIDEO_PRESETS[preset]
    if explicit_methods and "peer" in args.methods:
        raise SystemExit(
            f"--methods peer: {NO_TRANSFORMER_PEER if 'transformer' in entry else PEER_NOTE} (--preset {preset})"
        )
    if args.frames is None:
        args.frames = entry["frames"]
    check_frames(preset, args.frames)
    if args.resolution is None:
        args.resolution = [entry["size"][0]]
    multiple = entry.get("size_multiple", 64)
    for resolution in args.resolution:
        if resolution % multiple:
            raise SystemExit(f"--resolution {resolution}: --preset {preset}'s frame heights are multiples of {multiple} px")
    if "transformer" in entry:
        chunked = [f"--variant {name}" for name, options in args.variants.items() if _cross_frame(options)]
        if _cross_frame(args.options):
            chunked.insert(0, "--option")
        if chunked:
            raise SystemExit(
                f"frames_per_chunk > 1 in {', '.join(chunked)}: --preset {preset} runs one self-attention over every "
                "frame's tokens, where a token already merges with any frame's; chunks of frames are for video "
                "UNets (animatediff, svd): leave frames_per_chunk out"
            )
    crossing = [name for name in args.variant_oracles if _cross_frame(args.variants[name])]
    if _cross_frame(args.options) and "oracle" in args.methods:
        crossing.insert(0, "ours (--option)")
    if crossing:
        raise SystemExit(
            f"the oracle slices per frame and cannot follow cross-frame merging (frames_per_chunk > 1) of "
            f"{', '.join(crossing)}: leave it out of --variant-oracles, or run --methods unpatched ours"
        )


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
    """What a framework's bench runner adds for a video model (mix in before it): video latents in the model's
    layout (:meth:`clean_latents`), a video UNet's conditioning, call and DDIM schedule (a video transformer's are
    the transformer presets', :data:`tome_tools.bench_runner.TRANSFORMER_SPECS`), the video metrics of each row
    and the cross-frame options in its note. The framework side supplies ``to_tensor``, ``normal_draws``,
    ``scheduler_class`` and the model call (as :class:`tome_tools.bench_runner.BenchRunner`'s subclasses do)."""

    has_peer = False

    @property
    def video(self) -> VideoSpec:
        """The :class:`VideoSpec` of the model."""
        return video_spec(self.unet)

    def own_scheduler(self) -> Any:
        """A video UNet's: DDIM with SD's betas and the preset's changes (AnimateDiff's linear schedule, SVD's
        v-prediction). None for a video transformer: it runs its
        :class:`~tome_tools.bench_runner.TransformerSpec`'s."""
        if self.spec is not None:
            return None
        return self.scheduler_class(**{**DDIM_CONFIG, **VIDEO_PRESETS[self.args.preset].get("scheduler", {})})

    def clean_latents(self, channels: int) -> Tuple[np.ndarray, np.ndarray]:
        """Panning videos (:func:`video_latents`; ``--latents noise``: Gaussian) of the preset's latent frames
        (:func:`latent_frames`) and the noise drawn for them, independent per frame, seeded, numpy in the model's
        layout. Sets ``latent_hw``, the grid ToMe sees: a frame's latent, or for a stacked model (Wan) the frames'
        latents stacked in rows."""
        args = self.args
        height, width = frame_size(args.preset, args.resolution)
        frames = latent_frames(args.preset, args.frames)
        latent = (height // self.latent_scale, width // self.latent_scale)
        self.latent_hw = (frames * latent[0], latent[1]) if self.video.stacked else latent
        self.description = f"{args.preset} {size_label(args, args.resolution)} batch {args.batch}"
        clean, noise = draw_latents(args, (args.batch, frames, channels) + latent, video_latents)
        layout = lambda x: np.ascontiguousarray(np.moveaxis(x, 1, self.video.frame_axis))
        return layout(clean), layout(noise)

    def _build_inputs(self, config: Any) -> None:
        """A video UNet's inputs: the mid-timestep video (:meth:`clean_latents`, noised per frame), the loop's
        starting noise and the conditioning of :class:`VideoSpec`, seeded like the image presets' inputs."""
        args, video = self.args, self.video
        clean, noise = self.clean_latents(config.out_channels if video.image_conditioned else config.in_channels)
        self.sample_in = self.to_tensor(noised(clean, noise, self.alpha_bar(MID_TIMESTEP)))
        self.noise = self.to_tensor(noise)
        self.timestep = self.as_timestep(MID_TIMESTEP)
        self.added = None
        draw = self.normal_draws(seed=2)
        if video.image_conditioned:  # the first clean frame, repeated, conditions every frame
            self.text = draw((args.batch, 1, config.cross_attention_dim))
            first = np.take(clean, [0], axis=video.frame_axis)
            self.image_latents = self.to_tensor(np.repeat(first, args.frames, axis=video.frame_axis))
            self.time_ids = self.to_tensor(np.array([SVD_TIME_IDS] * args.batch, dtype="float32"))
        else:
            text = draw((args.batch, 77, config.cross_attention_dim))
            ops = get_ops(text)
            self.text = ops.take(text, ops.arange(args.batch * args.frames, text) // args.frames, axis=0) if video.text_per_frame else text

    def video_kwargs(self, sample: Any, timestep: Any) -> Dict[str, Any]:
        """Keyword arguments of one model call on ``sample`` (model layout) at scheduler timestep ``timestep``."""
        kwargs = dict(sample=sample, timestep=timestep, encoder_hidden_states=self.text)
        if self.video.image_conditioned:  # EDM: sigma of the DDIM step, timestep 0.25 log sigma
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
