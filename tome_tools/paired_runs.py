"""Unpatched and patched runs of one pipeline, alternated, and what the examples print of them."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, Iterable, Tuple

import numpy as np


def paired_runs(generate: Callable[[], np.ndarray], patch: Callable[[], Any], remove: Callable[[], Any], repeats: int) -> Dict[str, Any]:
    """Unpatched then patched, ``repeats`` times (A B A B, so drift on a shared machine hits both alike), after
    the caller's warm-up: median seconds of each, the speedup (the median of the pairs' ratios) with the lowest
    and highest pair's (its spread), and the relative L2 change of the last image."""
    plain_times, tome_times = [], []
    for _ in range(repeats):
        remove()
        start = time.perf_counter()
        plain = generate()
        plain_times.append(time.perf_counter() - start)
        patch()
        start = time.perf_counter()
        merged = generate()
        tome_times.append(time.perf_counter() - start)
    plain_s, tome_s = statistics.median(plain_times), statistics.median(tome_times)
    ratios = [a / b for a, b in zip(plain_times, tome_times)]
    change = float(np.linalg.norm(merged - plain) / np.linalg.norm(plain))
    return {
        "plain_s": plain_s, "tome_s": tome_s, "speedup": statistics.median(ratios), "spread": (min(ratios), max(ratios)),
        "change": change, "repeats": repeats,
    }


def print_report(title: str, models: Iterable[Tuple[Any, Any]], result: Dict[str, Any]) -> None:
    """What each patched model ran on fewer tokens in its last call, time and image change."""
    print(title)
    for model, state in models:
        print(f"{type(model).__name__}, in the last call:")
        print(state.summary())
    low, high = result["spread"]
    print(f"pipeline time: unpatched {result['plain_s']:.2f}s, ToMe {result['tome_s']:.2f}s (medians of "
          f"{result['repeats']} alternating pairs) -> speedup {result['speedup']:.2f}x (pairs {low:.2f}-{high:.2f}x)")
    print(f"image change vs unpatched: relative L2 {result['change']:.4f}")


def quickstart_parser(description: str, library: str, steps: int, repeats: int, ratio: Any = None,
                      ratio_help: str = "ToMe for SD's ratio") -> argparse.ArgumentParser:
    """The quick-start examples' options: a local ``library`` pipeline folder or a preset UNet, size, steps,
    ratio, and the paired runs for the timing."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help=f"local {library} pipeline folder (default: random weights)")
    parser.add_argument("--preset", default="sd15-small", help="UNet architecture when --model is not given")
    parser.add_argument("--size", type=int, default=512, help="image height and width")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--ratio", type=float, default=ratio, help=ratio_help)
    parser.add_argument("--repeats", type=int, default=repeats, help="paired runs for the timing (medians)")
    return parser
