"""``python -m tome_tools.bench``: how much faster, and how different, ToMe makes a UNet call.

Diffusion transformers too (``--preset sd3|sd3-small|flux-small|pixart|tiny-*``, random weights, torch):
their inputs follow the released pipelines (flow matching for SD3 and Flux, Flux's packed tokens, the
prompt lengths), the loop runs the model's own scheduler, and the oracle slices image tokens only.
Video models too (UNets: ``--preset animatediff|svd|tiny-animatediff|tiny-svd``; Wan's video transformer:
``--preset wan|tiny-wan``; ``--frames``, torch): panning videos, fidelity per frame and temporal consistency,
:mod:`tome_tools.bench_video`.
Training steps too (``--train [full|lora]``, torch, UNets): forward + backward per method, the gradient's
distance to the unpatched step's in place of fidelity, :mod:`tome_tools.bench_train`.

For each ratio it times one UNet call per method, alternating the methods (A B C A B C ...) after a warm-up,
and reports medians:

* ``unpatched``: the model as it is;
* ``ours``: tome_core with the options given;
* ``peer``: the other implementation in the same framework (tomesd for torch, ppdiffusers' built-in ToMe for
  paddle), when installed;
* ``oracle``: the same token counts removed and restored with free slicing instead of matching; its time is
  the limit of what token reduction can save, and ``oracle share`` is the part of that saving a method gets.
  It is the library's own patch with a match that keeps the first tokens (``tome_tools.oracle.attach_oracle``;
  Flax: ``tome_tools.flax_bench.OraclePlan``), so it follows the configuration of 'ours' at the same blocks,
  levels and sizes: the counts of each level's ratio or cell (``level_cells``), and the arrangement: with
  ``mode=kv`` self-attention gets every query and
  the first ``kept`` tokens as keys/values, with ``mode=queries`` the first ``kept`` as queries and every token
  as keys/values (output restored by index). ``--variant-oracles NAME`` adds the oracle of a variant.

Every arrangement is reachable: ``--option mode=kv``, ``--variant "todo:mode=kv,matching=cell,level_cells={1:4,
2:2},max_downsample=2"``. With ``matching='cell'`` the cell fixes the reduction, so 'ours' does not get
``--ratio``; its rows show the finest level's reduction (``1 - 1/(sx*sy)``) and name the cells in the note.
``--resolution 512 1024 1536`` runs each size in turn, one table (and one JSON block) each.

Fidelity is the relative L2 distance of a method's output to the unpatched output, on image-like latents
(smooth structure plus noise, fixed seed) at a mid timestep, and after a short sampling loop. On the small
trained models (``--preset trained-unet|trained-dit|trained-mmdit``, :mod:`tome_tools.trained`) it is also measured on
samples: every class ``--samples-per-class`` times from fixed seeds through a full ``--sample-steps`` DDIM
loop with guidance, unpatched and with each method; PSNR and SSIM against the unpatched samples, and the
accuracy of the shipped classifier (trained on real crops) on each method's samples. Peak memory is
the extra resident memory of one call, measured in a fresh process per method (``--memory``).

This module is framework-free, and so is :class:`tome_tools.bench_runner.BenchRunner`, which holds what every
framework's runner shares (inputs, methods, sampling loop); ``tome_core.adapters.<framework>_bench`` adds the
framework.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import math
import platform
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from tome_tools.bench_core import (
    RUNNERS, METHODS, model_kind, relative_l2, Row, measure, bench_methods, timing_columns, spread, _importable, variant_options, split_top_level, parse_options,
)

DEFAULT_STEPS = 4  # --steps: the fid@loop DDIM loop
DEFAULT_STACK_STEPS = 10  # --steps with --stack: the timed pipeline loop


@dataclass(frozen=True)
class Stack:
    """A speed-up that ``--stack`` times beside ToMe, in whole sampling loops of a diffusers pipeline.

    models: the models it serves, ``unet`` or ``transformer`` (diffusion transformers).
    module, attribute: what must import for it (``attribute`` of ``module`` when given).
    install: the command that installs it.
    options: its settings and their defaults (``--stack NAME:OPT=VAL,...`` overrides them); ``None`` is
        resolved from the run (T-GATE's ``gate_step``: 40% of the steps, as its SD 1.5 example gates at step 10
        of 25).
    fixed: settings ToMe needs beside it (T-GATE's self-attention reuse hands back merged outputs: refused).
    label: how the README and the rows' notes name it.
    """

    models: str
    module: str
    install: str
    options: Dict[str, Any]
    label: str
    attribute: Optional[str] = None
    fixed: Dict[str, Any] = field(default_factory=dict)


STACKS: Dict[str, Stack] = {
    "deepcache": Stack(
        "unet", "DeepCache", "pip install DeepCache==0.1.1", dict(cache_interval=3, cache_branch_id=0),
        "DeepCache (DeepCacheSDHelper)",
    ),
    "tgate": Stack(
        "unet", "tgate", "pip install tgate==1.0.0", dict(gate_step=None, sp_interval=1, fi_interval=1, warm_up=2),
        "T-GATE (TgateSDLoader)", fixed=dict(sp_interval=1, fi_interval=1),
    ),
    "first-block-cache": Stack(
        "transformer", "diffusers", 'pip install "diffusers>=0.35"', dict(threshold=0.2),
        "FirstBlockCache (transformer.enable_cache)", attribute="FirstBlockCacheConfig",
    ),
    "pab": Stack(
        "transformer", "diffusers", 'pip install "diffusers>=0.35"',
        dict(spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(100, 800)),
        "Pyramid Attention Broadcast (transformer.enable_cache)", attribute="PyramidAttentionBroadcastConfig",
    ),
}


def allowed_stacks() -> str:
    """``deepcache, tgate (UNets); first-block-cache, pab (diffusion transformers)``."""
    kinds = {"unet": "UNets", "transformer": "diffusion transformers"}
    return "; ".join(
        f"{', '.join(n for n, s in STACKS.items() if s.models == kind)} ({label})" for kind, label in kinds.items()
    )


def parse_stacks(items: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """``["deepcache", "tgate:gate_step=5"]`` -> each stack's settings, defaults filled in (``None`` left for
    :func:`resolve_stacks`). Raises ``SystemExit`` naming ``--stack``, the value and what is allowed."""
    stacks: Dict[str, Dict[str, Any]] = {}
    for item in items:
        name, _, options = item.partition(":")
        if name not in STACKS:
            raise SystemExit(f"--stack {item}: unknown speed-up {name!r}; allowed: {allowed_stacks()}")
        if name in stacks:
            raise SystemExit(f"--stack {item}: {name} is named twice")
        stack = STACKS[name]
        try:
            given = parse_options([o for o in split_top_level(options) if o])
        except ValueError as error:
            raise SystemExit(f"--stack {item}: {error} (NAME:OPT=VAL[,OPT=VAL])") from None
        unknown = sorted(set(given) - set(stack.options))
        if unknown:
            raise SystemExit(
                f"--stack {item}: {name} has no setting {', '.join(unknown)}; allowed: {', '.join(stack.options)}"
            )
        wrong = {k: v for k, v in given.items() if k in stack.fixed and v != stack.fixed[k]}
        if wrong:
            need = ", ".join(f"{k}={v}" for k, v in stack.fixed.items())
            raise SystemExit(
                f"--stack {item}: beside ToMe {name} must run with {need} (its self-attention reuse hands back "
                "outputs merged at another step, which ToMe refuses); docs/works-with.md"
            )
        stacks[name] = {**stack.options, **given}
    return stacks


def resolve_stacks(stacks: Dict[str, Dict[str, Any]], steps: int) -> None:
    """Settings left ``None`` from the run's ``steps`` (T-GATE's gate step: 40% of them, at least 1)."""
    tgate = stacks.get("tgate")
    if tgate is not None and tgate.get("gate_step") is None:
        tgate["gate_step"] = max(1, round(0.4 * steps))


def check_stacks(args: argparse.Namespace, explicit_methods: bool) -> None:
    """Fail before anything is built when ``--stack`` cannot run: on another backend, with ``--micro``,
    ``--methods`` or ``--memory`` (its rows are fixed and timed as whole loops), on a model the speed-up does not
    serve, or when its package is missing (with the command that installs it)."""
    names = " ".join(args.stack)
    if args.backend != "torch":
        raise SystemExit(f"--stack {names}: stacked speed-ups run on the torch backend only, not --backend {args.backend}")
    for flag, given in (("--micro", args.micro), ("--memory", args.memory), ("--methods", explicit_methods)):
        if given:
            raise SystemExit(
                f"--stack {names} with {flag}: a stacked run times whole sampling loops, its rows fixed (unpatched, "
                "ours, each variant, then per speed-up S: S, S+ours, S+ours:VARIANT); leave out " + flag
            )
    kind = model_kind(args)
    from tome_tools.trained import TRAINED_PRESETS

    what = f"--model {args.model}" if args.model and args.preset not in TRAINED_PRESETS else f"--preset {args.preset}"
    for name in args.stacks:
        stack = STACKS[name]
        if kind == "unet-xl":
            raise SystemExit(
                f"--stack {name}: {what} is an SDXL UNet; the stacked loop is a StableDiffusionPipeline, which serves "
                "SD 1.x/2.x UNets (sd15, sd15-small, sd21, tiny, trained-unet) and the transformer presets"
            )
        if kind == "trained-dit":
            raise SystemExit(
                f"--stack {name}: {what} is a trained diffusion transformer, which the stacked loop does not run; "
                "allowed with --stack: trained-unet, the UNet presets, the transformer presets"
            )
        if stack.models != kind:
            fits = ", ".join(n for n, s in STACKS.items() if s.models == kind)
            raise SystemExit(
                f"--stack {name}: {name} serves {'UNets' if stack.models == 'unet' else 'diffusion transformers'}, "
                f"and {what} is {'a UNet' if kind == 'unet' else 'a diffusion transformer'}; allowed here: {fits}"
            )
        try:
            module = importlib.import_module(stack.module)
            if stack.attribute and not hasattr(module, stack.attribute):
                raise ImportError(f"{stack.module} has no {stack.attribute}")
        except ImportError as error:
            raise SystemExit(
                f"--stack {name} needs {stack.module + ('.' + stack.attribute if stack.attribute else '')} "
                f"({error}), not installed: {stack.install}"
            ) from None
        try:
            adapter = importlib.import_module(f"tome_tools.{RUNNERS[args.backend]}")
        except ImportError:  # check_dependencies names the framework to install
            continue
        refusal = adapter.stack_refusal(args, name)
        if refusal:
            raise SystemExit(refusal)


def stack_methods(args: argparse.Namespace) -> List[str]:
    """The rows of a ``--stack`` run in timing order: ``unpatched``, ``ours``, each ``ours:VARIANT``, then per
    speed-up S: ``S``, ``S+ours``, ``S+ours:VARIANT``."""
    ours = ["ours"] + [f"ours:{name}" for name in args.variants]
    methods = ["unpatched"] + ours
    for name in args.stacks:
        methods += [name] + [f"{name}+{m}" for m in ours]
    return methods


def runner_module(args: argparse.Namespace) -> Any:
    """The adapter module whose ``Runner`` serves the run (the video presets have their own)."""
    from tome_tools import bench_video

    table = bench_video.VIDEO_RUNNERS if bench_video.is_video(args) else RUNNERS
    return importlib.import_module(f"tome_tools.{table[args.backend]}")


def run(args: argparse.Namespace) -> List[Row]:
    """One run per ``--resolution``; the rows of all, each with its resolution."""
    rows: List[Row] = []
    resolutions = args.resolution if isinstance(args.resolution, (list, tuple)) else [args.resolution]
    for resolution in resolutions:
        one = argparse.Namespace(**{**vars(args), "resolution": resolution})
        if getattr(one, "train", None):
            from tome_tools.bench_train import run_train

            rows.extend(run_train(one, runner_module(one).Runner(one)))
        else:
            rows.extend(run_stacked(one) if getattr(one, "stack", None) else run_one(one))
    return rows


def run_stacked(args: argparse.Namespace) -> List[Row]:
    """``--stack``: whole sampling loops of a diffusers pipeline around the model (``runner.loop``), timed in
    alternating rounds like single calls; each row's speedup is against the unpatched loop and its fidelity is
    the relative L2 of its final latents (a trained model's final samples, with PSNR, SSIM and classifier
    accuracy) to the unpatched loop's (``fidelity_sampled``; ``fidelity_step`` and the oracle share are NaN)."""
    from tqdm import tqdm

    runner = runner_module(args).Runner(args)
    methods = stack_methods(args)
    rows: List[Row] = []
    total = len(args.ratio) * len(methods) * (args.warmup + args.repeats) if args.repeats else 0
    with tqdm(total=total, desc=f"{args.backend} {runner.description} loops of {args.steps} steps", unit="loop") as progress:
        for ratio in args.ratio:
            outputs: Dict[str, Any] = {}
            times = (
                measure(runner, ratio, methods, args.repeats, args.warmup, progress, outputs, call=runner.loop)
                if args.repeats else {}
            )
            for method in methods:
                if method not in outputs:
                    outputs[method] = runner.loop_output(method, ratio)
            reference = outputs["unpatched"]
            medians = {m: statistics.median(t) for m, t in times.items()}
            samples = SampleFidelity(runner, reference) if runner.trained is not None else None
            for method in methods:
                shown_ratio, note = runner.effective(method, ratio)
                scores = samples.compare(outputs[method]) if samples is not None else {}
                rows.append(
                    Row(
                        ratio=shown_ratio,
                        method=method,
                        **{**timing_columns(medians, method), "oracle_share": float("nan")},
                        fidelity_step=float("nan"),
                        fidelity_sampled=0.0 if method == "unpatched" else relative_l2(outputs[method], reference),
                        note=note,
                        times_s=times.get(method, []),
                        resolution=args.resolution,
                        stacked=True,
                        **scores,
                    )
                )
    return rows


def run_one(args: argparse.Namespace) -> List[Row]:
    from tqdm import tqdm

    runner = runner_module(args).Runner(args)
    methods = bench_methods(args, runner.has_peer)
    rows: List[Row] = []
    total = len(args.ratio) * len(methods) * (args.warmup + args.repeats) if args.repeats else 0
    with tqdm(total=total, desc=f"{args.backend} {runner.description}", unit="call") as progress:
        reference_step = None
        reference_sampled = runner.sample("unpatched", 0.0, args.steps) if args.steps else None
        samples = SampleFidelity(runner) if runner.trained is not None and args.sample_steps else None
        for ratio in args.ratio:
            outputs: Dict[str, Any] = {}
            times = measure(runner, ratio, methods, args.repeats, args.warmup, progress, outputs) if args.repeats else {}
            if reference_step is None:
                reference_step = outputs["unpatched"] if "unpatched" in outputs else runner.output("unpatched", 0.0)
            step_output = lambda method: outputs[method] if method in outputs else runner.output(method, ratio)
            medians = {m: statistics.median(t) for m, t in times.items()}
            for method in methods:
                fidelity_sampled, sampled = float("nan"), reference_sampled if method == "unpatched" else None
                looped = getattr(args, "sample_methods", None) is None or method in args.sample_methods
                if args.steps and method != "unpatched" and looped:
                    sampled = runner.sample(method, ratio, args.steps)
                    fidelity_sampled = relative_l2(sampled, reference_sampled)
                row_metrics = getattr(runner, "row_metrics", None)
                shown_ratio, note = runner.effective(method, ratio)
                scores = samples.scores(method, ratio) if samples is not None and looped else {}
                rows.append(
                    Row(
                        ratio=shown_ratio,
                        method=method,
                        **timing_columns(medians, method),
                        fidelity_step=0.0
                        if method == "unpatched"
                        else relative_l2(step_output(method), reference_step),
                        fidelity_sampled=0.0 if method == "unpatched" and args.steps else fidelity_sampled,
                        peak_mb=runner.peak_memory_mb(method, ratio) if args.memory else None,
                        note=note,
                        times_s=times.get(method, []),
                        resolution=args.resolution,
                        metrics=row_metrics(step_output(method), reference_step, sampled, reference_sampled) if row_metrics else {},
                        **scores,
                    )
                )
    if "peer" in args.methods and not runner.has_peer:
        print(f"peer skipped: {runner.note('peer')}")
    return rows


class SampleFidelity:
    """A trained model's sample-level fidelity (:mod:`tome_tools.trained`): every class's samples from fixed
    seeds through the full sampling loop, unpatched once and with each method, compared by PSNR and SSIM,
    and recognised by the shipped classifier trained on real crops."""

    def __init__(self, runner: Any, reference: Any = None):
        """``reference``: the unpatched samples when the caller has them (a ``--stack`` loop's), else sampled."""
        from tome_tools.trained import sample_labels

        self.runner = runner
        self.labels = sample_labels(runner.args.samples_per_class)
        self.reference = runner.class_samples("unpatched", 0.0) if reference is None else reference

    def scores(self, method: str, ratio: float) -> Dict[str, float]:
        """PSNR (dB; inf when identical), SSIM and classifier accuracy of ``method``'s samples."""
        return self.compare(self.reference if method == "unpatched" else self.runner.class_samples(method, ratio))

    def compare(self, images: Any) -> Dict[str, float]:
        """PSNR, SSIM and classifier accuracy of ``images`` (one sample per label) against the reference."""
        import numpy as np

        from tome_tools.trained import accuracy, psnr, ssim

        with np.errstate(divide="ignore"):  # identical samples: PSNR inf
            quality = dict(psnr=psnr(self.reference, images), ssim=ssim(self.reference, images))
        return dict(quality, accuracy=accuracy(self.runner.classify(images), self.labels))


def format_table(rows: Sequence[Row]) -> str:
    """One table per resolution; ``spread`` is ``(max - min) / median`` of a method's timed calls, ``note`` what
    the ratio column means for it (a cell's reduction, the arrangement)."""
    blocks = []
    sampled = any(r.psnr is not None for r in rows)
    extra = list(dict.fromkeys(name for r in rows for name in r.metrics))  # a runner's own columns
    if any(r.stacked for r in rows):
        return format_stacked_table(rows, sampled)
    if any(r.train for r in rows):
        from tome_tools import bench_train

        return bench_train.format_table(rows)
    for resolution in dict.fromkeys(r.resolution for r in rows):
        header = (
            f"{'ratio':>5}  {'method':<14} {'median':>9} {'spread':>6} {'speedup':>8} {'oracle share':>12} "
            f"{'fid@t':>8} {'fid@loop':>9} {'peak MB':>8}"
            + (f" {'PSNR':>6} {'SSIM':>6} {'acc':>5}" if sampled else "")
            + "".join(f" {name:>{max(8, len(name))}}" for name in extra) + "  note"
        )
        lines = ([] if resolution is None else [f"{resolution}px"]) + [header, "-" * len(header)]
        for row in rows:
            if row.resolution != resolution:
                continue
            peak = "" if row.peak_mb is None else f"{row.peak_mb:8.0f}"
            lines.append(
                f"{row.ratio:>5.2f}  {row.method:<14} {row.median_s * 1000:7.0f}ms {spread(row.times_s):6.0%} "
                f"{row.speedup:7.2f}x {row.oracle_share:12.2f} {row.fidelity_step:8.4f} {row.fidelity_sampled:9.4f} "
                f"{peak:>8}" + (_sample_columns(row) if sampled else "")
                + "".join(f" {row.metrics.get(name, math.nan):>{max(8, len(name))}.4f}" for name in extra)
                + f"  {row.note}".rstrip()
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def format_stacked_table(rows: Sequence[Row], sampled: bool) -> str:
    """A ``--stack`` run's table: one row per loop, its median, spread and speedup over the unpatched loop, and
    ``fid@out``, the relative L2 of its final output to the unpatched loop's (a trained model adds PSNR, SSIM
    and classifier accuracy of its samples)."""
    blocks = []
    for resolution in dict.fromkeys(r.resolution for r in rows):
        header = (
            f"{'ratio':>5}  {'loop':<22} {'median':>9} {'spread':>6} {'speedup':>8} {'fid@out':>8}"
            + (f" {'PSNR':>6} {'SSIM':>6} {'acc':>5}" if sampled else "") + "  note"
        )
        lines = ([] if resolution is None else [f"{resolution}px"]) + [header, "-" * len(header)]
        for row in rows:
            if row.resolution != resolution:
                continue
            lines.append(
                f"{row.ratio:>5.2f}  {row.method:<22} {row.median_s:8.3f}s {spread(row.times_s):6.0%} "
                f"{row.speedup:7.2f}x {row.fidelity_sampled:8.4f}"
                + (_sample_columns(row) if sampled else "") + f"  {row.note}".rstrip()
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _sample_columns(row: Row) -> str:
    if row.psnr is None:
        return " " * 20
    return f" {row.psnr:6.2f} {row.ssim:6.3f} {row.accuracy:5.2f}"


def plot(rows: Sequence[Row], path: str, title: str) -> None:
    """Speedup (when timed), fidelity at the mid timestep and after the loop (when run) against ratio, one
    line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (attribute, label, heading)
        for attribute, label, heading in (
            ("speedup", "speedup vs unpatched (x)", "speed"),
            ("fidelity_step", "relative L2 vs unpatched", "fidelity at t=500 (lower is better)"),
            ("fidelity_sampled", "relative L2 vs unpatched", "fidelity after the loop (lower is better)"),
        )
        if any(math.isfinite(getattr(r, attribute)) for r in rows if r.method != "unpatched")
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, (attribute, label, heading) in zip(axes[0], panels):
        for method in dict.fromkeys(r.method for r in rows):
            mine = [r for r in rows if r.method == method]
            axis.plot([r.ratio for r in mine], [getattr(r, attribute) for r in mine], marker="o", label=method)
        axis.set(xlabel="ratio", ylabel=label, title=heading)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def preset_names() -> Dict[str, List[str]]:
    """Every ``--preset`` name by kind: ``unet``, ``transformer`` (released shapes), ``tiny`` (test-sized
    transformers), ``video`` and ``trained``."""
    from tome_tools.presets import TRANSFORMERS, UNETS, VIDEO_PRESETS
    from tome_tools.trained import TRAINED_PRESETS

    return {
        "unet": list(UNETS),
        "transformer": [name for name in TRANSFORMERS if not name.startswith("tiny")],
        "tiny": [name for name in TRANSFORMERS if name.startswith("tiny")],
        "video": list(VIDEO_PRESETS),
        "trained": list(TRAINED_PRESETS),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tome_tools.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=sorted(RUNNERS), default="torch")
    names = preset_names()
    p.add_argument("--preset", default="sd15-small", metavar="NAME",
                   help="an architecture with random weights, or a small trained model. UNets: "
                   f"{', '.join(names['unet'])}. Diffusion transformers (real widths, 1-2 blocks of each kind; the video "
                   f"ones at TRANSFORMER_VIDEOS' frames and size, --resolution their frame height): "
                   f"{', '.join(names['transformer'])}, and {len(names['tiny'])} test-sized tiny-* ones (tome_tools.presets). "
                   f"Video models (see --frames): {', '.join(names['video'])}. Trained pixel-space models shipped in "
                   f"the repository's models/ (torch; sample fidelity, PSNR, SSIM and classifier accuracy, is reported "
                   f"too): {', '.join(names['trained'])}")
    p.add_argument("--model", help="local diffusers/ppdiffusers pipeline or UNet folder (from_pretrained), or a "
                   "trained model's folder (python -m tome_tools.train)")
    p.add_argument("--resolution", type=int, nargs="+", default=None,
                   help="image size in pixels (latent = resolution / 8; default 512, a trained model's own size); "
                   "several values run one after another, one table (and one JSON block) each, e.g. "
                   "--resolution 512 1024 1536")
    p.add_argument("--batch", type=int, default=2, help="model batch (2 = one image with classifier-free guidance)")
    p.add_argument("--text-tokens", type=int, default=None,
                   help="transformers: text tokens per prompt (default: the released pipeline's, SD3 333, Flux 512, "
                   "PixArt 120, Wan 512)")
    p.add_argument("--ratio", type=float, nargs="+", default=[0.5],
                   help="ratios to run; 'ours' (and its oracle) get it unless their options set matching='cell', "
                   "where the cell fixes the reduction (1 - 1/(sx*sy) per level): their rows show the finest "
                   "level's reduction as the ratio and the cells in the note; the peer always runs at --ratio")
    p.add_argument("--latents", choices=("image", "noise"), default="image",
                   help="input latents at the mid timestep: image-like structure, or pure Gaussian noise")
    p.add_argument("--steps", type=int, default=None,
                   help=f"sampling-loop steps for the fidelity after a loop (0: skip; default {DEFAULT_STEPS}); with "
                   f"--stack, the steps of each timed pipeline loop (default {DEFAULT_STACK_STEPS})")
    p.add_argument("--samples-per-class", type=int, default=4,
                   help="trained models (--preset trained-unet|trained-dit|trained-mmdit): samples per class for PSNR, SSIM and "
                   "classifier accuracy")
    p.add_argument("--sample-steps", type=int, default=25,
                   help="trained models: DDIM steps of the full sampling loop behind PSNR/SSIM/accuracy (0: skip)")
    p.add_argument("--sample-methods", nargs="+", default=None, metavar="METHOD",
                   help="run the sampling loop for these methods only (e.g. ours ours:rs2 oracle; default: all)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per method (0: fidelity only)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--methods", nargs="+", default=None, choices=METHODS,
                   help=f"methods to run (default: {' '.join(METHODS)}; the peer is skipped when it is not "
                   "installed, but named here it must be: the bench then fails before the run, saying how to "
                   "install it)")
    p.add_argument("--variant-oracles", nargs="+", default=[], metavar="NAME",
                   help="also time the oracle of these variants (method oracle:NAME: free removal of the token "
                   "counts ours:NAME keeps, in its arrangement: kv slices keys/values, queries slices queries)")
    p.add_argument("--memory", action="store_true", help="measure peak memory (one fresh process per method)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: the framework's)")
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--plot", help="write speedup and fidelity against ratio to this PNG file (one per resolution, "
                   "NAME_<res>px.png, with several); needs matplotlib: pip install \".[bench]\" (from the clone)")
    p.add_argument("--micro", action="store_true",
                   help="instead: one block's match+merge+unmerge (B=2, N=4096, C=320), ours vs the peer: time and ops; "
                   "with a transformer preset (torch): the first block of each kind at --resolution/--batch, its "
                   "time unpatched, with ours (fresh and reused match), with the oracle, and the share of "
                   "match + merge + unmerge in it, without and with reuse. The UNet block also times "
                   "matching='cell' (2x2 pooling: its merge alone, as mode='kv' pays, and merge + unmerge)")
    p.add_argument("--micro-methods", nargs="+", default=None, metavar="ROW",
                   choices=("unpatched", "ours", "ours_reused_match", "ours_plain_softmax", "oracle"),
                   help="--micro with a transformer preset: the block rows to time (default all: unpatched ours "
                   "ours_reused_match ours_plain_softmax oracle); fewer rows for wide models on a slow machine")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a ToMe option for 'ours' (repeatable; values are Python literals, other text is a "
                   "string), e.g. --option use_rand=False --option mode=kv --option 'level_cells={1:4,2:2}'")
    p.add_argument("--stack", nargs="+", default=None, metavar="NAME[:OPT=VAL,...]",
                   help="instead of single model calls, time whole sampling loops of a diffusers pipeline around the "
                   "model (StableDiffusionPipeline, SD3/Flux/PixArt pipelines; text embeddings passed directly, "
                   "output_type='latent', one image with guidance when --batch is 2) with each speed-up NAME alone "
                   "and with ToMe: rows unpatched, ours, ours:VARIANT, then per NAME: NAME, NAME+ours, "
                   "NAME+ours:VARIANT; speedups against the unpatched loop, fidelity (fid@out) of the final output "
                   "against the unpatched loop's (a trained model's samples: PSNR, SSIM, accuracy too). NAME: "
                   "deepcache (DeepCacheSDHelper, cache_interval=3, cache_branch_id=0), tgate (TgateSDLoader, "
                   "gate_step=40%% of --steps, sp_interval=1, fi_interval=1, warm_up=2: the configuration ToMe "
                   "accepts) on UNets; first-block-cache (threshold=0.2), pab (Pyramid Attention Broadcast, "
                   "spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(100, 800)) on "
                   "the transformer presets; settings as NAME:OPT=VAL,OPT=VAL (e.g. deepcache:cache_interval=2); "
                   "torch only")
    from tome_tools import bench_train, bench_video

    bench_video.add_arguments(p)
    bench_train.add_arguments(p)
    p.add_argument("--variant", action="append", default=[], metavar="NAME:OPT=VAL[,OPT=VAL]",
                   help="also measure 'ours' with these extra options, as method ours:NAME (repeatable; commas "
                   "inside braces, brackets, parentheses or quotes belong to the value), e.g. --variant "
                   "plain:proportional_attn=False --variant \"todo:mode=kv,matching=cell,level_cells={1:4,2:2},"
                   "max_downsample=2\"")
    return p


INSTALL_BENCH = 'pip install ".[bench]" (from the clone)'
FRAMEWORK_EXTRAS = {"torch": "torch", "paddle": "paddle", "jax": "jax"}
PEER_INSTALL = {"torch": "pip install tomesd==0.1.3", "paddle": 'pip install ".[paddle]" (ppdiffusers\' built-in ToMe)'}


def check_dependencies(args: argparse.Namespace, explicit_methods: bool) -> None:
    """Fail before anything is built or timed when something the run needs is missing, with the command that
    installs it: the bench extra (numpy, tqdm; matplotlib for ``--plot``), the framework, and the peer when
    ``--methods`` names it (by default a missing peer is skipped and said so)."""
    needed = ["numpy"] + ([] if args.micro else ["tqdm"]) + (["matplotlib"] if args.plot and not args.micro else [])
    missing = [name for name in needed if not _importable(name)]
    if missing:
        raise SystemExit(f"python -m tome_tools.bench needs {', '.join(missing)}, not installed: {INSTALL_BENCH}")
    from tome_tools.trained import model_info

    if args.model and model_info(args.model) is not None and not _importable("skimage"):
        raise SystemExit(
            "a trained model's sample fidelity needs scikit-image, not installed: pip install \".[trained]\" (from the clone)"
        )
    try:
        module = importlib.import_module(f"tome_tools.{RUNNERS[args.backend]}")
    except ImportError as error:
        extra = FRAMEWORK_EXTRAS[args.backend]
        raise SystemExit(
            f"--backend {args.backend} needs its framework ({error}): pip install \".[{extra},bench]\" (from the clone)"
        ) from None
    if explicit_methods and "peer" in args.methods and not args.micro:
        from tome_tools.presets import TRANSFORMERS

        if args.preset in TRANSFORMERS and not args.model:
            raise SystemExit("--methods peer: no other ToMe implementation exists for diffusion transformers")
        if not module.Runner.has_peer:
            install = PEER_INSTALL.get(args.backend)
            raise SystemExit(
                f"--methods peer: the {args.backend} peer is not installed"
                + (f": {install}" if install else f" (none exists for {args.backend})")
            )


def resolve_trained(args: argparse.Namespace) -> None:
    """``--preset trained-unet|trained-dit|trained-mmdit``: the shipped folder as ``--model``; the default resolution (512, or
    a trained model's image size)."""
    from tome_tools import trained

    if args.preset in trained.TRAINED_PRESETS and not args.model:
        if args.backend != "torch":
            raise SystemExit(f"--preset {args.preset}: the trained models run on the torch backend, not {args.backend}")
        try:
            args.model = trained.shipped(args.preset)
        except FileNotFoundError as error:
            raise SystemExit(str(error)) from None
    if args.resolution is None:
        info = trained.model_info(args.model) if args.model else None
        args.resolution = [info["image_size"] if info else 512]


def transformer_size_label(args: argparse.Namespace, resolution: int) -> str:
    """How a run's title names its size (:func:`tome_tools.bench_video.size_label`); a video transformer preset of
    :data:`~tome_tools.presets.TRANSFORMER_VIDEOS`: ``5 frames of 544x960px``."""
    from tome_tools import bench_video
    from tome_tools.presets import TRANSFORMER_VIDEOS

    entry = None if args.model else TRANSFORMER_VIDEOS.get(args.preset)
    if entry is None:
        return bench_video.size_label(args, resolution)
    height, width = entry["size"]
    width = round(resolution * width / height / entry["space"]) * entry["space"]
    return f"{entry['frames']} frames of {resolution}x{width}px"


def main(argv: Optional[Sequence[str]] = None) -> List[Row]:
    from tome_tools.console import quiet_known_notices

    quiet_known_notices()
    arguments = parser()
    args = arguments.parse_args(argv)
    known = [name for names in preset_names().values() for name in names]
    if args.preset not in known:
        close = difflib.get_close_matches(args.preset, known, n=1)
        arguments.error(
            f"--preset {args.preset!r} is none of the presets{f' (did you mean {close[0]!r}?)' if close else ''}; "
            f"choose one of {', '.join(known)}"
        )
    args.options = parse_options(args.option)
    args.variants = variant_options(args.variant)
    explicit_methods = args.methods is not None
    if not explicit_methods:
        args.methods = list(METHODS)
    unknown = [name for name in args.variant_oracles if name not in args.variants]
    if unknown:
        raise SystemExit(f"--variant-oracles {' '.join(unknown)}: no such --variant")
    from tome_tools import bench_train, bench_video

    bench_train.refuse(args)
    bench_video.resolve(args, explicit_methods)
    resolve_trained(args)
    args.stacks = parse_stacks(args.stack) if args.stack else {}
    if args.steps is None:
        args.steps = DEFAULT_STACK_STEPS if args.stack else DEFAULT_STEPS
    if args.stack:
        check_stacks(args, explicit_methods)
        if args.steps < 1:
            raise SystemExit(f"--steps {args.steps}: a --stack run times sampling loops of at least 1 step")
        resolve_stacks(args.stacks, args.steps)
    check_dependencies(args, explicit_methods)
    if args.micro:
        module = importlib.import_module(f"tome_tools.{RUNNERS[args.backend]}")
        from tome_tools.presets import TRANSFORMERS

        args.resolution = args.resolution[0]
        if args.preset in TRANSFORMERS:
            if not hasattr(module, "micro_transformer"):
                raise SystemExit(f"--micro with a transformer preset runs on the torch backend only, not {args.backend}")
            result = module.micro_transformer(args)
        else:
            result = module.micro()
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": "python -m tome_tools.bench " + " ".join(argv if argv is not None else sys.argv[1:]), **result}, f, indent=1)
        return result
    rows = run(args)
    runs = []
    for resolution in args.resolution:
        mine = [r for r in rows if r.resolution == resolution]
        title = (
            f"{args.backend} {args.model or args.preset} {transformer_size_label(args, resolution)} batch {args.batch} "
            + (f"{args.steps}-step pipeline loops " if args.stack else "")
            + (f"training steps ({args.train}) " if args.train else "")
            + f"on {platform.processor() or platform.machine()}"
        )
        print(title)
        print(format_table(mine))
        runs.append({"title": title, "args": {**vars(args), "resolution": resolution}, "rows": [asdict(r) for r in mine]})
        if args.plot:
            path = args.plot
            if len(args.resolution) > 1:
                stem, dot, suffix = args.plot.rpartition(".")
                path = f"{stem}_{resolution}px.{suffix}" if dot else f"{args.plot}_{resolution}px"
            plot(mine, path, title)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs[0] if len(runs) == 1 else {"runs": runs}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
