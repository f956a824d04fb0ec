"""LoRA fine-tuning of the shipped trained UNet with and without token reduction: loss curves, step times, and
what training with reduction does to the fine-tuned model itself (issue #19).

Runs offline on a CPU: the defaults (4 runs of 100 steps) take about 12 minutes on one thread of a 2-core
machine, the quick look below about 3. Every configuration fine-tunes its own copy of ``models/trained-unet``
(the tiny class-conditional pixel-space UNet of docs/fidelity.md) with a peft
LoRA added through diffusers (``unet.add_adapter(LoraConfig(...))``; only the adapter weights train). The
copies train side by side: every step draws one batch and each configuration takes its step on it in turn
(the order alternating from step to step), so the loss curves compare point by point and the step times share
the machine's ups and downs.

    python -m examples.finetune_lora                                   # the defaults below
    python -m examples.finetune_lora --steps 30 --samples-per-class 1 --sample-steps 10     # a quick look
    python -m examples.finetune_lora --methods unpatched tokens-0.5+stop --stop-tome-at 20

Choices (each is an argument):

* Data: the crops the trained models learned from (``tome_tools.trained.crops``: random crops of the
  scikit-image photos, 32x32 px), fresh ones (``--data-seed 1``; the shipped model saw seed 0's), of one class,
  ``--subject hubble_deep_field``: the class the shipped UNet gets wrong (its samples have the dots but not
  the black sky, and the classifier recognises none of them), so the fine-tune adapts the model to a subject,
  as a DreamBooth-style LoRA would (no prior preservation: the other classes may drift, which the accuracy
  shows). The recipe is the one the model was trained with (``diffusers_trained.train_diffusion``): epsilon
  prediction under its own cosine schedule, the class dropped to the null class with probability 0.1 (so
  classifier-free guidance keeps working), left-right flips, AdamW (``--lr 3e-3``, constant) with gradients
  clipped to norm 1, no EMA; ``--steps 100`` of ``--batch 16``. Batches, noise and timesteps are drawn from
  ``--seed``.
* LoRA: rank 8 (``lora_alpha`` = rank) on the attention projections, the feed-forward, ``proj_in``/``proj_out``
  and the ResNet convolutions (``conv1``, ``conv2``; LoCon-style: the colours this model gets wrong live in the
  convolutions more than in attention). Every run seeds its adapter with ``--seed``; ``lora_B`` starts at
  zero, so every run starts from the shipped model exactly.
* Token reduction: ``tome.patch(unet, ...)`` after ``add_adapter``; ``--methods`` from ``unpatched``,
  ``tokens-0.5`` (``ratio=0.5``: ToMe for SD, similarity matching, size-aware attention), ``kv-cell``
  (``mode="kv", matching="cell"``: ToDo-like, keys/values pooled in 2x2 cells, every query kept), ``kv-42``
  (docs/training.md's speed set for fine-tuning: keys/values pooled in 4x4 cells at the finest level, 32x32 here,
  and 2x2 at the next), ``kv-sample`` and ``kv-42-sample`` (the same cells with ``cell_pool="sample"``: each
  cell's keys and values are one of its tokens, drawn per call, instead of their mean; docs/training.md's advice),
  ``tokens-0.75``, ``kv-0.5`` (``mode="kv", ratio=0.5``), ``ratio-0`` (``ratio=0.0`` merges
  nothing: equals ``unpatched`` exactly, a check) and ``unpatched-reseeded`` (no reduction, but its own
  batches and adapter init from ``--seed`` + 1: how far two plain fine-tunes land apart by chance). ToMe's
  random partition is a seeded hash (``seed=0``), so every run repeats exactly.
* Schedules, added to a patched method's name, each at most once (``kv-42+after10+stop50``):
  ``+afterN`` is an unmerged warm-up: the first N steps run unpatched, then the loop calls ``tome.patch``
  and merging goes on from step N + 1 (docs/training.md's advice: Adam's first steps weigh their gradients most, so
  a gradient changed by merging there leaves a lasting mark on the adapter). ``+stop`` is the kohya-ss PR's
  ``stop_tome``: merging off after step ``--stop-tome-at`` (default: half the steps), when the loop calls
  ``tome.remove(unet)`` and the remaining steps run unpatched; ``+stopN`` stops after step N instead, so one
  run compares several stops. ``+noisy`` is the schedule by timestep: ``timestep_range=(T/2, T)`` merges
  only the calls at the noisier half of the schedule (T: the scheduler's training timesteps), the others run
  unmerged. A call merges only when its whole batch is in the range, so when any run is ``+noisy`` every
  batch (of every run alike) draws its timesteps from one half of the schedule, chosen per batch: each
  timestep is still uniform over the schedule.
* Two loss curves per run: the training loss (its own batches, with reduction as it trains; mean over
  ``--log-every`` steps) and the held-out loss WITHOUT reduction (a fixed batch of unseen crops of the subject,
  fixed noise and timesteps spread over the schedule; the patch comes off for the evaluation and goes back
  on). At the end the held-out loss is also taken with each run's own reduction on.
* Quality, measured on the fine-tuned models WITHOUT token reduction (every patch removed): samples of every
  class (``--samples-per-class 2``, fixed seeds, the full 25-step DDIM loop with guidance,
  ``diffusers_trained.generate``) compared with the unpatched fine-tune's samples by PSNR and SSIM and judged
  by the shipped classifier (the benchmark's ``tome_tools.bench.SampleFidelity``), with the accuracy on the
  subject's samples alone. Reference rows: the shipped model before fine-tuning, and the unpatched fine-tune
  sampled with ToMe at inference (``ratio=0.5``; the issue's bar: training with reduction should move the
  samples no more than merging at inference does).

Step times are medians over each run's steps (forward + backward + clipping + AdamW). The machine may be shared:
read them as medians of interleaved steps within one run, not as a benchmark.
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import statistics
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

from tome_tools.console import quiet_known_notices

quiet_known_notices()  # before diffusers is imported

import numpy as np
import torch
from diffusers import DDPMScheduler
from peft import LoraConfig

import tome_core.torch as tome
from tome_tools import trained
from tome_tools import diffusers_trained
from tome_tools.bench import SampleFidelity

OPTIONS: Dict[str, Optional[Dict[str, Any]]] = {
    "unpatched": None,
    "tokens-0.5": {"ratio": 0.5},
    "tokens-0.75": {"ratio": 0.75},
    "kv-cell": {"mode": "kv", "matching": "cell"},
    "kv-42": {"mode": "kv", "matching": "cell", "level_cells": {1: 4, 2: 2}, "max_downsample": 2},  # docs/training.md's speed set
    "kv-sample": {"mode": "kv", "matching": "cell", "cell_pool": "sample"},
    "kv-42-sample": {"mode": "kv", "matching": "cell", "level_cells": {1: 4, 2: 2}, "max_downsample": 2, "cell_pool": "sample"},
    "kv-0.5": {"mode": "kv", "ratio": 0.5},
    "ratio-0": {"ratio": 0.0},
    "unpatched-reseeded": None,  # its own batches and adapter init (seed + 1): how far a fine-tune moves by chance
}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out", "conv1", "conv2"]
DROP_CLASS = 0.1  # as diffusers_trained.train_diffusion
INFERENCE_TOME = {"ratio": 0.5}  # the inference-time reference row
DEFAULT_METHODS = ["unpatched", "kv-cell", "kv-sample+after10", "kv-42-sample+after10+stop30"]  # mean cells to the end; the advice


class Run:
    """One configuration's fine-tune: its model copy, optimizer and record."""

    def __init__(self, name: str, args: argparse.Namespace, base: diffusers_trained.TrainedModel, stop_at: int, half: int):
        options, self.start_at, self.stop_at = method(name, half, stop_at)  # merging on for steps start_at..stop_at
        self.name, self.options = name, options
        seed = args.seed + 1 if name == "unpatched-reseeded" else args.seed
        self.generator = torch.Generator().manual_seed(seed) if seed != args.seed else None  # None: shared batches
        self.model = copy.deepcopy(base)
        torch.manual_seed(seed)  # the adapter's initialisation (lora_B starts at zero, lora_A gaussian)
        config = LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian", target_modules=args.lora_targets)
        self.model.model.add_adapter(config)  # freezes the base weights: only the adapter trains
        self.parameters = [p for p in self.model.model.parameters() if p.requires_grad]
        self.model.model.train()
        self.optimizer = torch.optim.AdamW(self.parameters, lr=args.lr, weight_decay=0.0)
        self.losses: List[float] = []
        self.times: List[float] = []
        self.merged: List[bool] = []  # whether each step merged (patched, and its timesteps in any timestep_range)
        self.held_out: List[List[float]] = []  # [step, loss of the model without reduction on the held-out batch]
        self.timesteps: List[List[int]] = []  # of each step's batch

    @property
    def unet(self) -> torch.nn.Module:
        return self.model.model

    def patched(self) -> bool:
        return bool(tome.patched_models(self.unet))

    def merging(self) -> bool:
        """Whether the last model call merged."""
        return any(state.call.merging for _, state in tome.patched_models(self.unet))

    def step(self, batch) -> None:
        """One optimizer step (timed: forward, backward, clipping, AdamW)."""
        noisy, timesteps, labels, noise = batch
        start = time.perf_counter()
        loss = loss_of(self.model, noisy, timesteps, labels, noise)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.parameters, 1.0)
        self.optimizer.step()
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.item())
        self.merged.append(self.merging())
        self.timesteps.append(timesteps.tolist())

    def evaluate(self, step: int, batch) -> None:
        """The held-out loss of the model as it is now, without token reduction (a patch comes off and back)."""
        patched = self.patched()
        tome.remove(self.unet)
        with torch.no_grad():
            self.held_out.append([step, loss_of(self.model, *batch).item()])
        if patched:
            tome.patch(self.unet, **self.options)

    def loss_with_reduction(self, batch) -> float:
        """The held-out loss of the model with its own token reduction on (an unpatched run's: nan)."""
        if self.options is None:
            return math.nan
        tome.patch(self.unet, **self.options)
        with torch.no_grad():
            loss = loss_of(self.model, *batch).item()
        tome.remove(self.unet)
        return loss

    def median_time(self, merged: Optional[bool] = None) -> float:
        times = [t for t, m in zip(self.times, self.merged) if merged is None or m == merged]
        return statistics.median(times) if times else math.nan


def method(name: str, half: int, stop_at: int) -> Tuple[Optional[Dict[str, Any]], int, Optional[int]]:
    """``(options, start, stop)`` of a ``--methods`` entry: merging on for steps ``start`` to ``stop`` (None: to
    the end). The name is one of OPTIONS, and a patched one may add schedules, each at most once: ``+afterN``
    (an unmerged warm-up: merging from step N + 1), ``+stop`` (off after step ``stop_at``), ``+stopN`` (off after
    step N) and ``+noisy`` (``timestep_range`` of the noisier half; ``half``: T/2)."""
    base, *parts = name.split("+")
    start, stop, options = 1, None, OPTIONS.get(base)
    schedules = [re.fullmatch(r"(after|stop|noisy)(\d*)", part) for part in parts]
    kinds = [schedule[1] for schedule in schedules if schedule]
    known = base in OPTIONS and (options is not None or not parts) and all(schedules) and len(set(kinds)) == len(parts)
    for kind, number in (schedule.groups() for schedule in schedules) if known else ():
        if kind == "noisy" and not number:
            options = {**options, "timestep_range": (half, 2 * half)}
        elif kind == "stop" and (not number or int(number) > 0):
            stop = int(number) if number else stop_at
        elif kind == "after" and number:
            start = int(number) + 1
        else:
            known = False
    if not known or (stop is not None and stop < start):
        raise SystemExit(
            f"unknown method {name!r}: choose from {', '.join(OPTIONS)}, and for a patched one add any of +afterN "
            "(merging from step N + 1), +stop or +stopN (merging off after step --stop-tome-at or N, at least 1 and "
            "not before the first merged step) and +noisy, each at most once; e.g. kv-42+after10, kv-cell+stop25"
        )
    return options, start, stop


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a trained model's folder (default: the shipped trained-unet)")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, help=f"default: {' '.join(DEFAULT_METHODS)}")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of every run")
    p.add_argument("--stop-tome-at", type=int, default=None, metavar="STEP",
                   help="NAME+stop runs merge in steps 1..STEP, then call tome.remove (default: half of --steps)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (lora_alpha = rank)")
    p.add_argument("--lora-targets", nargs="+", default=LORA_TARGETS, help="module names peft adapts")
    p.add_argument("--subject", default="hubble_deep_field", choices=trained.CLASSES, help="the class fine-tuned on")
    p.add_argument("--per-class", type=int, default=64, help="crops drawn per class (the subject's are used)")
    p.add_argument("--held-out", type=int, default=16, help="unseen crops of the subject in the held-out batch")
    p.add_argument("--data-seed", type=int, default=1, help="seed of the crops (the shipped models saw seed 0's)")
    p.add_argument("--seed", type=int, default=0, help="seeds the batches, noise, timesteps and LoRA init")
    p.add_argument("--log-every", type=int, default=10, help="loss curves: a point every this many steps")
    p.add_argument("--samples-per-class", type=int, default=2, help="samples of every class for PSNR/SSIM/accuracy")
    p.add_argument("--sample-steps", type=int, default=25, help="DDIM steps of the sampling loop (0: no samples)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    return p


def draw_batch(
    images: torch.Tensor, batch: int, label: int, null: int, generator: torch.Generator, scheduler: Any, halves: bool = False
):
    """``(noisy, timesteps, labels, noise)`` as ``train_diffusion`` draws a batch: crops, left-right flips,
    the class dropped to the null class with probability DROP_CLASS, noise and timesteps (``halves``: all from
    the lower or all from the upper half of the schedule, one chosen per batch)."""
    index = torch.randint(0, len(images), (batch,), generator=generator)
    clean = images[index]
    flip = torch.rand(batch, generator=generator) < 0.5
    clean = torch.where(flip[:, None, None, None], clean.flip(-1), clean)
    labels = torch.where(torch.rand(batch, generator=generator) < DROP_CLASS, null, label)
    noise = torch.randn(clean.shape, generator=generator)
    total = scheduler.config.num_train_timesteps
    if halves:
        upper = int(torch.randint(0, 2, (), generator=generator))
        timesteps = torch.randint(0, total // 2, (batch,), generator=generator) + upper * (total // 2)
    else:
        timesteps = torch.randint(0, total, (batch,), generator=generator)
    return scheduler.add_noise(clean, noise, timesteps), timesteps, labels, noise


def held_out_batch(images: torch.Tensor, label: int, scheduler: Any, draws: int = 2):
    """Every held-out crop under ``draws`` fixed noises, at timesteps spread evenly over the schedule."""
    clean = images.repeat(draws, 1, 1, 1)
    noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(10_000))
    timesteps = torch.linspace(0, scheduler.config.num_train_timesteps - 1, len(clean)).long()
    labels = torch.full((len(clean),), label, dtype=torch.long)
    return scheduler.add_noise(clean, noise, timesteps), timesteps, labels, noise


def loss_of(model: diffusers_trained.TrainedModel, noisy, timesteps, labels, noise) -> torch.Tensor:
    """The training objective: MSE of the predicted noise (epsilon prediction)."""
    prediction = diffusers_trained.call_model(model.model, noisy, timesteps, model.condition(labels))
    return torch.nn.functional.mse_loss(prediction, noise)


def curve(losses: List[float], every: int) -> List[List[float]]:
    """``[last step, mean loss]`` of each window of ``every`` steps (the last window may be shorter)."""
    windows = [losses[start : start + every] for start in range(0, len(losses), every)]
    return [[min(i * every + every, len(losses)), float(np.mean(w))] for i, w in enumerate(windows)]


def print_table(title: str, runs: List[Run], columns: Dict[str, List[List[float]]]) -> None:
    width = max(19, *(len(run.name) + 2 for run in runs))
    print(f"\n{title}")
    print("  step  " + "".join(f"{run.name:>{width}}" for run in runs))
    for i, (step, _) in enumerate(columns[runs[0].name]):
        print(f"{step:6d}  " + "".join(f"{columns[run.name][i][1]:{width}.4f}" for run in runs))


def main(argv=None) -> Dict[str, Any]:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.model or trained.shipped("trained-unet")
    stop_at = args.stop_tome_at if args.stop_tome_at is not None else args.steps // 2
    subject = trained.CLASSES.index(args.subject)
    start = time.perf_counter()

    images, labels = trained.crops(args.per_class, seed=args.data_seed)
    images = torch.from_numpy(images[labels == subject])
    held_images, held_labels = trained.crops(args.held_out, seed=args.data_seed + 1000)
    held_images = torch.from_numpy(held_images[held_labels == subject])
    base = diffusers_trained.load(folder)
    base.model.requires_grad_(False)
    null = len(base.info["classes"])
    scheduler = DDPMScheduler.from_config(base.scheduler_config)
    held = held_out_batch(held_images, subject, scheduler)
    half = scheduler.config.num_train_timesteps // 2
    runs = [Run(name, args, base, stop_at, half) for name in args.methods]
    halves = any("noisy" in name.split("+")[1:] for name in args.methods)
    draw = lambda generator: draw_batch(images, args.batch, subject, null, generator, scheduler, halves)

    print(f"LoRA fine-tune of {folder} on {len(images)} fresh crops of {args.subject!r}")
    print(f"rank {args.rank} on {', '.join(args.lora_targets)}: {sum(p.numel() for p in runs[0].parameters):,} trainable "
          f"parameters (the UNet has {sum(p.numel() for p in base.model.parameters()):,}); {args.steps} steps of "
          f"{args.batch}, AdamW lr {args.lr:g}, seed {args.seed}, {torch.get_num_threads()} threads; the runs take "
          "their steps in turn on the same batches (unpatched-reseeded on its own)"
          + (f"; each batch's timesteps all below or all from {half} (for +noisy)" if halves else ""))
    generator = torch.Generator().manual_seed(args.seed)
    for run in runs:
        run.evaluate(0, held)
    for step in range(1, args.steps + 1):
        batch = draw(generator)
        for run in runs if step % 2 else reversed(runs):  # alternate the order: drift hits every run alike
            if run.options is not None and step == run.start_at:
                tome.patch(run.unet, **run.options)
                if step > 1:  # after an unmerged warm-up
                    print(f"step {step}: tome.patch(unet) in {run.name}; it merges from here on")
            if run.stop_at is not None and step == run.stop_at + 1:
                tome.remove(run.unet)  # the schedule: merging off from here on
                print(f"step {step}: tome.remove(unet) in {run.name}; its remaining steps run unpatched")
            if run.generator is not None:  # a reseeded run draws its own
                run.step(draw(run.generator))
            else:
                run.step(batch)
        if step % args.log_every == 0 or step == args.steps:
            for run in runs:
                run.evaluate(step, held)
    train_seconds = sum(sum(run.times) for run in runs)

    curves = {run.name: curve(run.losses, args.log_every) for run in runs}
    print_table(f"training loss (each run's own batches, reduction as it trains; mean over {args.log_every} steps)",
                runs, curves)
    print_table(f"held-out loss WITHOUT token reduction ({len(held[0])} unseen crops of {args.subject}, fixed noise "
                "and timesteps; a run's patch is taken off to evaluate)", runs, {r.name: r.held_out for r in runs})

    reference = next((run for run in runs if run.name == "unpatched"), runs[0])
    base_time = reference.median_time()
    print(f"\ntime per training step (forward + backward + AdamW; median over the steps; the machine may be shared, "
          f"so compare within this run only; {train_seconds:.0f} s of training in all)")
    for run in runs:
        line = f"  {run.name:<21} {run.median_time() * 1000:7.1f} ms  {base_time / run.median_time():5.2f}x"
        scheduled = run.start_at > 1 or run.stop_at is not None
        if scheduled or any(run.merged) and not all(run.merged):
            first = f"steps {run.start_at}-{run.stop_at or args.steps}" if scheduled else f"{sum(run.merged)} steps"
            line += (f"   ({first} merged: {run.median_time(True) * 1000:.1f} ms, "
                     f"{base_time / run.median_time(True):.2f}x; unmerged: {run.median_time(False) * 1000:.1f} ms)")
        print(line + f"   total {sum(run.times):.1f} s")

    # Quality of the fine-tuned models themselves: every patch removed.
    for run in runs:
        tome.remove(run.unet)
        run.unet.eval()
    quality: Dict[str, Dict[str, float]] = {}
    if args.sample_steps and args.samples_per_class:
        classifier = diffusers_trained.load_classifier(trained.shipped("classifier"))
        sample_labels = trained.sample_labels(args.samples_per_class)
        sample = lambda model: diffusers_trained.generate(model, sample_labels, args.sample_steps)
        samples = {"base": sample(base)}
        samples.update({run.name: sample(run.model) for run in runs})
        inference_row = f"{reference.name} + ToMe ratio 0.5 at inference"
        tome.patch(reference.unet, **INFERENCE_TOME)
        samples[inference_row] = sample(reference.model)
        tome.remove(reference.unet)
        # SampleFidelity judges against the reference samples with the shipped classifier (the benchmark's)
        judge = SimpleNamespace(args=SimpleNamespace(samples_per_class=args.samples_per_class),
                                classify=lambda x: diffusers_trained.predict(classifier, x))
        fidelity = SampleFidelity(judge, reference=samples[reference.name])
        of_subject = sample_labels == subject
        for name, images_ in samples.items():
            quality[name] = fidelity.compare(images_)
            quality[name]["subject_accuracy"] = trained.accuracy(judge.classify(images_[of_subject]), sample_labels[of_subject])

    held_loss = {"base": runs[0].held_out[0][1], **{run.name: run.held_out[-1][1] for run in runs}}
    reduced_loss = {run.name: run.loss_with_reduction(held) for run in runs}
    print("\nthe fine-tuned models WITHOUT token reduction: held-out loss (in brackets: with the run's own reduction "
          "on)" + (
        f"; samples of every class ({args.samples_per_class} each, fixed seeds, {args.sample_steps} DDIM steps, "
        f"guidance) against the {reference.name} fine-tune's: PSNR dB, SSIM, the classifier's accuracy on all of "
        f"them and on the {args.subject} ones" if quality else ""))
    names = [run.name for run in runs]
    for name in ["base"] + names + [name for name in quality if name not in held_loss]:
        label = "shipped model, not fine-tuned" if name == "base" else f"{name} fine-tune" if name in names else name
        line = f"  {label:<42}" + (f" held-out loss {held_loss[name]:.4f}" if name in held_loss else " " * 20)
        reduced = reduced_loss.get(name, math.nan)
        line += f" ({reduced:.4f})" if not math.isnan(reduced) else " " * 9
        if name in quality:
            q = quality[name]
            line += (f"   PSNR {q['psnr']:5.1f}  SSIM {q['ssim']:.3f}  acc {q['accuracy']:.2f}  "
                     f"{args.subject} {q['subject_accuracy']:.2f}")
        print(line)
    print(f"\n{time.perf_counter() - start:.0f} s in all")

    return dict(
        curves=curves,
        losses={run.name: run.losses for run in runs},
        held_out={run.name: run.held_out for run in runs},
        times={run.name: run.times for run in runs},
        merged={run.name: run.merged for run in runs},
        timesteps={run.name: run.timesteps for run in runs},
        held_loss=held_loss,
        reduced_loss=reduced_loss,
        quality=quality,
        lora={run.name: {k: v.detach().clone() for k, v in run.unet.named_parameters() if "lora_" in k} for run in runs},
        seconds=train_seconds,
    )


if __name__ == "__main__":
    main()
