"""What the GPU scripts of ``docs/results`` (``gpu_defaults.py``, ``gpu_speed.py``, ``gpu_zoo_smoke.py``) share:
rows written as soon as they are measured, models and inputs in a GPU dtype, calls captured in CUDA graphs,
paired timing in alternating rounds, peak memory and the relative L2 between outputs.

Every helper also runs on the CPU (a host clock instead of CUDA events, no peak memory), so that a script's
``--dry-run`` goes through the same code before a GPU session spends its time on it; only :func:`capture` needs
CUDA. Imported by its folder name (``python docs/results/gpu_X.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch


class Recorder:
    """Rows written to ``path`` as JSON (``{**meta, "rows": [...]}``) each time one is added, so a command cut
    short by its time limit still hands back every row measured so far; the file is replaced whole each time
    (written beside it, then renamed), so a kill mid-write leaves the previous rows."""

    def __init__(self, path: str, **meta: Any):
        self.path = path
        self.meta = meta
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.rows: List[Dict[str, Any]] = []

    def __call__(self, **row: Any) -> None:
        self.rows.append(row)
        partial = self.path + ".part"
        with open(partial, "w") as f:
            json.dump({**self.meta, "rows": self.rows}, f, indent=1)
        os.replace(partial, self.path)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def on_device(value: Any, device: Any, dtype: torch.dtype) -> Any:
    """Inputs as a pipeline gives them, nested lists, tuples and dicts included: float32 tensors in the model's
    ``dtype`` on ``device``, other tensors (integer timesteps and ids, float64 position ids) on ``device`` as they are."""
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype) if value.dtype == torch.float32 else value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: on_device(v, device, dtype) for k, v in value.items()}
    return value


def in_dtype(model: torch.nn.Module, device: Any, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` in ``dtype`` on ``device``, the modules its class keeps in float32 (``_keep_in_fp32_modules``:
    Wan's norms and time embedding...) kept so, as ``from_pretrained(..., torch_dtype=dtype)`` loads it."""
    model = model.to(device, dtype)
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for path, module in model.named_modules():
        if any(name in path.split(".") for name in keep):
            module.float()
    return model


def relative_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float32."""
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def capture(fn: Callable[[], Any], pool: Any = None) -> Tuple[Callable[[], Any], Any]:
    """``fn`` captured in a CUDA graph: two warm-up calls on a side stream (as ``torch.cuda.graphs`` asks), the
    capture, one replay. Returns the replay and the captured output (rewritten by each replay). ``pool``
    (``torch.cuda.graph_pool_handle()``) shares one memory pool among graphs that are replayed one at a time
    and whose outputs are read right after their own capture, as a timing run does. A call that syncs with
    the host, or draws from a CPU generator, raises here."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay, out


def elapsed_ms(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """Milliseconds per call over ``reps`` calls back to back: CUDA events on a GPU (the GPU's time; an eager
    call whose host side is slower than its kernels shows the host's pace), the host clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / reps
    begin = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - begin) * 1000 / reps


def time_rounds(
    calls: Dict[str, Callable[[], Any]], rounds: int, reps: int, device: Any = "cuda",
    before: Optional[Dict[str, Callable[[], Any]]] = None,
) -> Dict[str, List[float]]:
    """Milliseconds per call of each ``calls[name]()`` (a graph replay or an eager call), one entry per round:
    the methods take turns (forward order in even rounds, backward in odd ones), each turn running
    ``before[name]()`` (if given: patching one model in turn; not timed), one untimed call, then ``reps`` timed ones."""
    device = torch.device(device)
    times: Dict[str, List[float]] = {name: [] for name in calls}
    for index in range(rounds):
        for name in list(calls) if index % 2 == 0 else list(reversed(calls)):
            if before is not None and name in before:
                before[name]()
            calls[name]()
            synchronize(device)
            times[name].append(elapsed_ms(calls[name], reps, device))
    return times


def paired(times: Sequence[float], base: Sequence[float]) -> Dict[str, float]:
    """A method's times against the same rounds' ``base`` (the unpatched call): median ms, the median over rounds
    of ``base / time`` (the speed-up, >1: faster; a round's two calls ran back to back, so drifting clocks or
    load slow both alike) and the spread of its times ((max - min) / median)."""
    median = statistics.median(times)
    return {
        "ms": median,
        "speedup": statistics.median(b / t for b, t in zip(base, times)),
        "spread": (max(times) - min(times)) / median if median else 0.0,
    }


def reset_peak(device: torch.device) -> int:
    """Start measuring peak memory on ``device``; returns the memory allocated now (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_since(device: torch.device, before: int) -> Dict[str, Optional[float]]:
    """The peak memory allocated since :func:`reset_peak` (MiB) and its rise above what was allocated then;
    None off CUDA."""
    if device.type != "cuda":
        return {"peak_mib": None, "peak_rise_mib": None}
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_mib": peak / 2**20, "peak_rise_mib": (peak - before) / 2**20}
