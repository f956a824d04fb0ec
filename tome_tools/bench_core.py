"""What every benchmark run shares, framework-free and below every other bench module (none of which it imports):
the inputs (image-like latents, noise), the fidelity measures, timing in alternating rounds and its columns,
peak memory in a fresh process, and the row of a result. ``tome_tools.bench`` is the command line on top."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence


RUNNERS = {"torch": "diffusers_bench", "paddle": "ppdiffusers_bench", "jax": "flax_bench"}
METHODS = ("unpatched", "ours", "peer", "oracle")


def model_kind(args: argparse.Namespace) -> str:
    """``unet``, ``transformer`` or ``trained-dit`` for the model the run would build, read from the preset or the
    folder (nothing is built). ``sdxl`` UNets (text_time conditions) are ``unet-xl``."""
    import os

    from tome_tools.presets import TRANSFORMERS, UNETS
    from tome_tools.trained import model_info

    if args.model:
        info = model_info(args.model)
        if info is not None:
            return "unet" if info["kind"] == "unet" else "trained-dit"  # trained PixArt or MM-DiT
        if os.path.isdir(os.path.join(args.model, "transformer")):
            return "transformer"
        for config in (os.path.join(args.model, "unet", "config.json"), os.path.join(args.model, "config.json")):
            if os.path.isfile(config):
                with open(config) as f:
                    return "unet-xl" if json.load(f).get("addition_embed_type") == "text_time" else "unet"
        return "unet"
    if args.preset in TRANSFORMERS:
        return "transformer"
    return "unet-xl" if UNETS.get(args.preset, {}).get("addition_embed_type") == "text_time" else "unet"


def image_like_latents(batch: int, channels: int, height: int, width: int, seed: int = 0):
    """Latents with image-like structure: a smooth random field (bilinear upsampling of a coarse grid) plus
    fine detail, scaled like SD latents (unit variance). numpy, shape ``[batch, channels, height, width]``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    coarse_h, coarse_w = max(2, height // 8), max(2, width // 8)
    coarse = rng.standard_normal((batch, channels, coarse_h, coarse_w))
    ys = np.linspace(0, coarse_h - 1, height)
    xs = np.linspace(0, coarse_w - 1, width)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, coarse_h - 1), np.minimum(x0 + 1, coarse_w - 1)
    wy, wx = (ys - y0)[:, None], (xs - x0)[None, :]
    smooth = (
        coarse[..., y0[:, None], x0[None, :]] * (1 - wy) * (1 - wx)
        + coarse[..., y1[:, None], x0[None, :]] * wy * (1 - wx)
        + coarse[..., y0[:, None], x1[None, :]] * (1 - wy) * wx
        + coarse[..., y1[:, None], x1[None, :]] * wy * wx
    )
    detail = 0.3 * rng.standard_normal((batch, channels, height, width))
    x = smooth + detail
    return ((x - x.mean()) / x.std()).astype("float32")


def video_latents(batch: int, frames: int, channels: int, height: int, width: int, seed: int = 0, pan: int = 1):
    """Image-like latents (:func:`image_like_latents`) of a camera panning ``pan`` latent
    pixels per frame: frame ``f`` is columns ``f * pan ... f * pan + width`` of one wider image. numpy,
    ``[batch, frames, channels, height, width]``, unit variance."""
    import numpy as np

    wide = image_like_latents(batch, channels, height, width + pan * (frames - 1), seed=seed)
    video = np.stack([wide[..., f * pan : f * pan + width] for f in range(frames)], axis=1)
    return ((video - video.mean()) / video.std()).astype("float32")


def noised(latents, noise, alpha_bar: float):
    """``x_t = sqrt(a) x_0 + sqrt(1 - a) noise``: the forward diffusion at cumulative alpha ``a``."""
    return (math.sqrt(alpha_bar) * latents + math.sqrt(1 - alpha_bar) * noise).astype("float32")


def relative_l2(a, b) -> float:
    """``||a - b|| / ||b||`` in float64."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def oracle_share(unpatched: float, method: float, oracle: float) -> float:
    """The fraction of the oracle's saving a method achieves (1 = as fast as free token reduction)."""
    saving = unpatched - oracle
    return float("nan") if saving <= 0 else (unpatched - method) / saving


def peak_memory_in_fresh_process(module: str, args: argparse.Namespace, method: str, ratio: float) -> float:
    """Extra peak resident memory (MB) of one call of ``method``, measured by ``python -m module`` in a fresh
    process (see :func:`serve_peak_request`), so earlier calls' high-water marks do not count."""
    import subprocess
    import sys

    payload = json.dumps({"args": vars(args), "method": method, "ratio": ratio})
    out = subprocess.run([sys.executable, "-m", module], input=payload, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def serve_peak_request(runner_class: Any) -> None:
    """The fresh process's side: build the runner from stdin's request, run one call, print the MB added.

    The high-water mark restarts once the method is in place, so neither building the model nor patching
    (nor, on jax, compiling) counts as the call's.
    """
    import sys

    request = json.loads(sys.stdin.read())
    args = argparse.Namespace(**request["args"])
    # JSON turned the options' int keys (level_cells={1: 4}) into strings: read them again from the command line
    args.options = parse_options(getattr(args, "option", None) or [])
    args.variants = variant_options(getattr(args, "variant", None) or [])
    runner = runner_class(args)
    call = runner.train_step if request["args"].get("train") else runner.call  # --train: one training step
    with runner.method(request["method"], request["ratio"]):
        before = _restart_peak_kb()
        call()
    print((_peak_kb() - before) / 1024)


def _restart_peak_kb() -> float:
    """Restart the resident-memory high-water mark at the current size (Linux >= 4.0; elsewhere it keeps
    its value) and return it in kB."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _peak_kb()


def _peak_kb() -> float:
    """This process's resident-memory high-water mark in kB.

    Linux's own ``VmHWM`` where there is one: ``ru_maxrss`` also counts the size of the parent at the fork
    that started this process, so a large parent hides a smaller call's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1])
    except OSError:
        pass
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


@dataclass
class Row:
    """One method at one ratio."""

    ratio: float
    method: str
    median_s: float
    speedup: float
    oracle_share: float
    fidelity_step: float
    fidelity_sampled: float
    peak_mb: Optional[float] = None
    note: str = ""
    times_s: List[float] = field(default_factory=list)
    resolution: Optional[int] = None
    psnr: Optional[float] = None
    ssim: Optional[float] = None
    accuracy: Optional[float] = None
    stacked: bool = False  # --stack: a whole pipeline loop; fidelity_sampled compares its final output
    train: Optional[str] = None  # --train: a training step ('full' or 'lora'); grad_l2 in place of fidelity
    grad_l2: Optional[float] = None  # --train: the input latent's gradient against the unpatched step's
    metrics: Dict[str, float] = field(default_factory=dict)  # a runner's own columns (video: per frame, temporal)


def measure(
    runner: Any, ratio: float, methods: Sequence[str], repeats: int, warmup: int, progress,
    outputs: Optional[Dict[str, Any]] = None, call: Optional[Any] = None,
) -> Dict[str, List[float]]:
    """Alternate the methods ``repeats`` times after ``warmup`` rounds; per-method call times in seconds.

    ``outputs`` (if given) receives each method's last output as numpy (converted after the timed part), so
    the fidelity at the mid timestep needs no extra call (a call's output does not depend on its round).
    ``call`` is what is timed (default ``runner.call``, one model call; ``--stack`` times ``runner.loop``)."""
    import numpy as np

    call = call or runner.call
    times: Dict[str, List[float]] = {m: [] for m in methods}
    for round_index in range(warmup + repeats):
        for method in methods:
            with runner.method(method, ratio):
                start = time.perf_counter()
                result = call()
                elapsed = time.perf_counter() - start
            if outputs is not None:
                outputs[method] = np.asarray(result)
            if round_index >= warmup:
                times[method].append(elapsed)
            progress.update(1)
    return times


def bench_methods(args: argparse.Namespace, has_peer: bool) -> List[str]:
    """The methods of a run in timing order: ``--methods`` (the peer only where there is one), each variant
    ``ours:NAME`` after ``ours`` and each ``oracle:NAME`` (``--variant-oracles``) after ``oracle``."""
    methods = [m for m in args.methods if m != "peer" or has_peer]
    at = methods.index("ours") + 1 if "ours" in methods else len(methods)
    methods[at:at] = [f"ours:{name}" for name in args.variants]
    oracles = [f"oracle:{name}" for name in getattr(args, "variant_oracles", None) or []]
    at = methods.index("oracle") + 1 if "oracle" in methods else len(methods)
    methods[at:at] = oracles
    return methods


def timing_columns(medians: Dict[str, float], method: str) -> Dict[str, float]:
    """A row's ``median_s``, ``speedup`` over the unpatched median and ``oracle_share`` (against the method's
    oracle, :func:`_oracle_of`), NaN where the medians lack what a column needs."""
    nan = float("nan")
    unpatched, oracle = medians.get("unpatched"), medians.get(_oracle_of(method, medians))
    mine = medians.get(method, nan)
    return dict(
        median_s=mine,
        speedup=unpatched / mine if unpatched is not None and method in medians else nan,
        oracle_share=oracle_share(unpatched, mine, oracle) if unpatched is not None and oracle is not None else nan,
    )


def _oracle_of(method: str, medians: Dict[str, float]) -> str:
    """The oracle a method's share is measured against: a variant's own (``oracle:NAME``) when timed."""
    variant = method.partition(":")[2]
    if variant and f"oracle:{variant}" in medians:
        return f"oracle:{variant}"
    return "oracle"


def spread(times: Sequence[float]) -> float:
    """``(max - min) / median`` of a method's timed calls (0 with fewer than two)."""
    if len(times) < 2:
        return 0.0
    return (max(times) - min(times)) / statistics.median(times)


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True

def variant_options(variants: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """``["plain:proportional_attn=False"]`` -> ``{"plain": {"proportional_attn": False}}``; options are split
    on commas outside brackets and quotes (``c:level_cells={1:4,2:2},mode=kv``)."""
    parsed = {}
    for variant in variants:
        name, sep, options = variant.partition(":")
        if not sep or not name:
            raise ValueError(f"--variant must look like NAME:OPT=VAL[,OPT=VAL], got {variant!r}")
        parsed[name] = parse_options([o for o in split_top_level(options) if o])
    return parsed


def split_top_level(text: str, separator: str = ",") -> List[str]:
    """``text`` split on ``separator`` where it is outside ``{}``, ``[]``, ``()`` and quotes."""
    parts, depth, quote, current = [], 0, None, []
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "{[(":
            depth += 1
        elif char in "}])":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    if depth or quote:
        raise ValueError(f"unbalanced brackets or quotes in {text!r}")
    parts.append("".join(current))
    return parts


def parse_options(items: Sequence[str]) -> Dict[str, Any]:
    """``["use_rand=False", "sx=3"]`` -> ``{"use_rand": False, "sx": 3}`` (values read as Python literals)."""
    import ast

    options = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--option must look like NAME=VALUE, got {item!r}")
        try:
            options[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[name.strip()] = value.strip()
    return options
