"""``python -m tome_tools.bench --train``: how much faster ToMe makes one training step of a UNet.

A training step is one forward and one backward of the UNet, as a diffusers fine-tune runs it: clean latents
(image-like, or noise with ``--latents noise``; seed 0) noised with fixed noise (seed 1) at a timestep drawn per
sample (seed 3, uniform over the 1000 training timesteps, SD's schedule), the seeded text embeddings of the
inference bench (SDXL's added conditions too), and the loss ``mse(model output, noise)`` (epsilon prediction).
``--train`` or ``--train full`` trains every weight (a full fine-tune: every parameter gets its gradient);
``--train lora`` adds a rank-4 peft LoRA to the attention projections (``to_q``, ``to_k``, ``to_v``,
``to_out.0``) and trains only it, as a LoRA fine-tune does (backward still runs through every layer for the
activations' gradients; it skips the weights' gradients). Nothing is updated: every step starts from the same
weights, and the gradients are dropped after it (as ``zero_grad(set_to_none=True)`` does).

The methods are the inference bench's (:func:`tome_tools.bench_core.bench_methods`): ``unpatched``, ``ours`` (and
each ``--variant``), the peer when installed, and ``oracle``, the same token counts removed by free slicing
(differentiable like any indexing: its backward scatters the gradients back). They alternate (A B C A B C ...)
after ``--warmup`` rounds on one model, patched and removed in turn (two SD 1.5 copies in training do not fit in
24 GiB), and each row reports the median step.

The fidelity columns of the inference bench do not apply to a step. ``grad L2`` is in their place: the relative
L2 distance of the gradient of the loss with respect to the noisy input latent to the unpatched step's (0: the
same training signal reaches the input; it gathers every layer's backward). The step computes that gradient
besides the weights' (one more convolution backward, a negligible part of the step).

``--gradient-checkpointing`` turns on the UNet's own gradient checkpointing (diffusers'
``enable_gradient_checkpointing``) for every method: each block's forward runs again in backward instead of
keeping its activations, the memory a trainer trades for time to fit SDXL at 1024 px. ToMe's match is a seeded,
deterministic function of the block's input, so the recomputed forward merges the same tokens.

``--memory``: the extra peak memory of one step, per method. On a CPU: the extra peak resident memory of a fresh
process that builds the model, patches it and runs one step (:func:`tome_tools.bench_core.peak_memory_in_fresh_process`;
the high-water mark restarts once the method is in place, so it counts the gradients and the activations kept for
backward, not the model). On a GPU (a model on CUDA): ``torch.cuda.max_memory_allocated`` over the step.

What ``--train`` refuses, before anything is built: another backend than torch, ``--stack``, ``--micro``, the
sampling options (``--steps``, ``--samples-per-class``, ``--sample-steps``, ``--sample-methods``: a step samples
nothing), and models other than UNets (diffusion transformers, video presets). Framework-free (numpy only);
``tome_tools.diffusers_bench.Runner.train_step`` is the torch step.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

import numpy as np

TRAIN_MODES = ("full", "lora")
TRAIN_BACKENDS = ("torch",)
TIMESTEP_SEED = 3  # the per-sample training timesteps (0: clean latents, 1: noise, 2: text, as the inference bench)
TRAIN_TIMESTEPS = 1000
LORA_RANK = 4
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
# Sampling options a training step cannot honour, with their parser defaults (given otherwise: refused).
SAMPLING_OPTIONS = (("--steps", "steps", None), ("--samples-per-class", "samples_per_class", 4),
                    ("--sample-steps", "sample_steps", 25), ("--sample-methods", "sample_methods", None))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train", nargs="?", const="full", default=None, choices=TRAIN_MODES,
                   help="instead of inference calls, time training steps (forward + backward, mse to a fixed noise "
                   "target at a seeded timestep per sample): 'full' (the default) trains every weight, 'lora' a "
                   "rank-4 peft LoRA on the attention projections; rows: unpatched, ours (each --variant), peer, "
                   "oracle (free removal of the same tokens), the speedup, and 'grad L2' (relative L2 of the "
                   "input latent's gradient to the unpatched step's) in place of fidelity; --memory: a step's "
                   "peak memory (torch, UNets)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="--train: enable the UNet's gradient checkpointing (diffusers' enable_gradient_checkpointing:"
                   " each block's activations are recomputed in backward instead of kept), as trainers do to fit "
                   "SDXL at 1024 px")


def refuse(args: argparse.Namespace) -> None:
    """Fail before anything is built when ``--train`` meets what a training step cannot honour (or
    ``--gradient-checkpointing`` comes without ``--train``), naming the argument, its value and what is allowed."""
    from tome_tools import bench_core, bench_video

    if not args.train:
        if args.gradient_checkpointing:
            raise SystemExit("--gradient-checkpointing without --train: it changes training steps only (an "
                             "inference call keeps no activations for backward); add --train or leave it out")
        return
    train = f"--train {args.train}"
    if args.backend not in TRAIN_BACKENDS:
        raise SystemExit(
            f"{train} with --backend {args.backend}: training steps run on {', '.join(TRAIN_BACKENDS)} only; "
            "allowed: --backend torch"
        )
    for flag, given in (("--stack", args.stack), ("--micro", args.micro)):
        if given:
            value = f" {' '.join(args.stack)}" if flag == "--stack" else ""
            raise SystemExit(
                f"{train} with {flag}{value}: a training run times single forward + backward steps; leave out {flag}"
            )
    for flag, name, default in SAMPLING_OPTIONS:
        value = getattr(args, name, default)
        if value != default:
            shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            raise SystemExit(
                f"{train} with {flag} {shown}: a training step samples nothing, so there is no loop or sample "
                f"fidelity to measure (its 'grad L2' column compares gradients instead); leave out {flag}"
            )
    if bench_video.is_video(args) or getattr(args, "frames", None) is not None:
        raise SystemExit(
            f"{train} with --preset {args.preset}: training steps run on image UNets; allowed: --preset sd15, "
            "sd15-small, sd21, sdxl, tiny, tiny-xl, trained-unet, or --model with a UNet"
        )
    trained_transformer = args.preset in ("trained-dit", "trained-mmdit")
    kind = "trained-dit" if trained_transformer and not args.model else bench_core.model_kind(args)
    if kind in ("transformer", "trained-dit"):
        what = f"--model {args.model}" if args.model and not trained_transformer else f"--preset {args.preset}"
        raise SystemExit(
            f"{train} with {what}: a diffusion transformer; training steps run on UNets only; allowed: --preset "
            "sd15, sd15-small, sd21, sdxl, tiny, tiny-xl, trained-unet, or --model with a UNet"
        )
    if args.train == "lora" and not bench_core._importable("peft"):
        raise SystemExit(f"{train} needs peft, not installed: pip install peft")


@dataclass
class TrainBatch:
    """The fixed inputs of every training step (numpy): ``sample`` the noisy latents, ``target`` the noise the
    loss compares the output with, ``timesteps`` one per sample."""

    sample: np.ndarray
    target: np.ndarray
    timesteps: np.ndarray


def train_timesteps(batch: int) -> np.ndarray:
    """The training timesteps, one per sample: uniform over ``[0, 1000)`` from seed :data:`TIMESTEP_SEED`."""
    return np.random.default_rng(TIMESTEP_SEED).integers(0, TRAIN_TIMESTEPS, size=batch).astype("int64")


def train_batch(runner: Any) -> TrainBatch:
    """The runner's training inputs: its clean latents (the inference bench's, ``--latents``) noised with its
    noise at each sample's timestep, ``x_t = sqrt(a_t) x_0 + sqrt(1 - a_t) noise`` with the runner scheduler's
    cumulative alphas (SD's schedule, or a trained model's own)."""
    from tome_tools.bench_core import image_like_latents
    from tome_tools.bench_runner import draw_latents

    args = runner.args
    shape = (args.batch, runner.unet.config.in_channels) + tuple(runner.latent_hw)
    clean, noise = draw_latents(args, shape, image_like_latents)
    timesteps = train_timesteps(args.batch)
    alphas = np.array([runner.alpha_bar(int(t)) for t in timesteps], dtype="float64").reshape(-1, 1, 1, 1)
    sample = (np.sqrt(alphas) * clean + np.sqrt(1 - alphas) * noise).astype("float32")
    return TrainBatch(sample=sample, target=noise, timesteps=timesteps)


def run_train(args: argparse.Namespace, runner: Any) -> List[Any]:
    """One ``--train`` run at one resolution: each method's training step timed in alternating rounds, its
    median, speedup, oracle share, ``grad L2`` and (``--memory``) peak memory."""
    from tqdm import tqdm

    from tome_tools import bench_core

    methods = bench_core.bench_methods(args, runner.has_peer)
    rows: List[Any] = []
    total = len(args.ratio) * len(methods) * (args.warmup + args.repeats) if args.repeats else 0
    with tqdm(total=total, desc=f"{args.backend} {runner.description} training steps ({args.train})", unit="step") as progress:
        for ratio in args.ratio:
            grads: Dict[str, Any] = {}
            times = (
                bench_core.measure(runner, ratio, methods, args.repeats, args.warmup, progress, grads, call=runner.train_step)
                if args.repeats else {}
            )
            for method in methods:
                if method not in grads:
                    with runner.method(method, ratio):
                        grads[method] = np.asarray(runner.train_step())
            medians = {m: statistics.median(t) for m, t in times.items()}
            for method in methods:
                shown_ratio, note = runner.effective(method, ratio)
                rows.append(
                    bench_core.Row(
                        ratio=shown_ratio,
                        method=method,
                        **bench_core.timing_columns(medians, method),
                        fidelity_step=float("nan"),
                        fidelity_sampled=float("nan"),
                        peak_mb=runner.peak_memory_mb(method, ratio) if args.memory else None,
                        note=note,
                        times_s=times.get(method, []),
                        resolution=args.resolution,
                        train=args.train,
                        grad_l2=bench_core.relative_l2(grads[method], grads["unpatched"]) if "unpatched" in grads else float("nan"),
                    )
                )
    if "peer" in args.methods and not runner.has_peer:
        print(f"peer skipped: {runner.note('peer')}")
    return rows


def format_table(rows: Sequence[Any]) -> str:
    """A ``--train`` run's table, one per resolution: each method's median step, spread, speedup over the
    unpatched step, oracle share, ``grad L2`` and peak memory."""
    from tome_tools.bench_core import spread

    blocks = []
    for resolution in dict.fromkeys(r.resolution for r in rows):
        header = (
            f"{'ratio':>5}  {'method':<14} {'step':>9} {'spread':>6} {'speedup':>8} {'oracle share':>12} "
            f"{'grad L2':>8} {'peak MB':>8}  note"
        )
        lines = ([] if resolution is None else [f"{resolution}px, training steps ({rows[0].train})"]) + [header, "-" * len(header)]
        for row in rows:
            if row.resolution != resolution:
                continue
            peak = "" if row.peak_mb is None else f"{row.peak_mb:8.0f}"
            lines.append(
                f"{row.ratio:>5.2f}  {row.method:<14} {row.median_s:8.2f}s {spread(row.times_s):6.0%} "
                f"{row.speedup:7.2f}x {row.oracle_share:12.2f} {row.grad_l2:8.4f} {peak:>8}  {row.note}".rstrip()
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
