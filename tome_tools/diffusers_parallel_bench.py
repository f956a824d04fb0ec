"""ToMe under diffusers' context parallelism (Ulysses), measured: one process against several, unpatched
against patched, on a Flux or Wan transformer at its released width with fewer blocks.

``python -m tome_tools.diffusers_parallel_bench --model flux-small --size 512 --processes 2``

Every process (the single one, then each of ``--processes`` on gloo) builds the same random-weight model
and inputs, and alternates unpatched and patched calls for ``--rounds`` rounds (paired, so load drifts hit
both alike). Each call records its wall time, the time spent inside the transformer blocks, and the keys of
every SDPA call (the tokens attention sees). Fidelity: the parallel patched output against the one-process
unpatched and patched outputs (relative mean absolute error). Each process uses one thread, so a process's
times are its own work (plus, in parallel, the exchange between processes).

On a CPU the exchange runs over loopback sockets (gloo); GPUs exchange over NVLink, so only ratios within a
column mean anything here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List

import torch

import tome_core.torch as tome
from tome_tools.diffusers_bench import SdpaCalls
from tome_tools.diffusers_models import (
    build_transformer, build_video_transformer, transformer_inputs, video_transformer_inputs,
)

# the released widths with fewer blocks: (builder, its overrides, inputs at a size in pixels)
MODELS: Dict[str, Dict[str, Any]] = {
    "flux-small": dict(kind="image", preset="flux-small", overrides=dict(num_layers=1, num_single_layers=2), text=512),
    "wan-small": dict(kind="video", preset="wan-1.3b", overrides=dict(num_layers=2), text=512, frames=3),
}


def build(name: str, size: int):
    """The model and the keyword inputs of one call on a ``size`` px image (an 8x VAE's latent)."""
    spec = MODELS[name]
    latent = size // 8
    if spec["kind"] == "image":
        model = build_transformer(spec["preset"], **spec["overrides"])
        return model, transformer_inputs(model, latent, latent, text=spec["text"])
    model = build_video_transformer(spec["preset"], **spec["overrides"])
    height, width = latent, latent * 832 // 480 // 2 * 2  # Wan's 480 x 832 aspect
    return model, video_transformer_inputs(model, spec["frames"], height, width, text=spec["text"])


def _block_timer(model: torch.nn.Module) -> Callable[[], float]:
    """Hooks that add up the time spent inside the model's transformer blocks; returns a reader that resets."""
    from tome_core.models.model_tree import blocks_of
    from tome_core.adapters.diffusers import FRAMEWORK

    spent = [0.0]
    started: Dict[int, float] = {}
    for block, _ in blocks_of(FRAMEWORK, model):
        block.register_forward_pre_hook(lambda m, a: started.__setitem__(id(m), time.perf_counter()))
        block.register_forward_hook(lambda m, a, o: spent.__setitem__(0, spent[0] + time.perf_counter() - started[id(m)]))

    def read() -> float:
        value, spent[0] = spent[0], 0.0
        return value

    return read


def measure(name: str, size: int, rounds: int, ratio: float, parallel: Callable[[torch.nn.Module], None] = lambda m: None) -> Dict[str, Any]:
    """Alternating unpatched and patched calls in this process; times in ms, outputs of the last round."""
    torch.manual_seed(0)
    model, inputs = build(name, size)
    blocks = _block_timer(model)
    parallel(model)
    found: Dict[str, Any] = {arm: dict(call=[], blocks=[]) for arm in ("unpatched", "patched")}
    with torch.no_grad():
        for round_ in range(rounds + 1):  # round 0 warms up
            for arm in ("unpatched", "patched"):
                if arm == "patched":
                    tome.patch(model, ratio=ratio)
                blocks()
                with SdpaCalls() as seen:
                    start = time.perf_counter()
                    out = model(**inputs, return_dict=False)[0].clone()  # waits for diffusers' gather
                    elapsed = time.perf_counter() - start
                if round_:
                    found[arm]["call"].append(1e3 * elapsed)
                    found[arm]["blocks"].append(1e3 * blocks())
                found[arm].update(keys=[keys for _, keys in seen.lengths], out=out)
                if arm == "patched":
                    found[arm]["summary"] = tome.patched_models(model)[0].state.summary()
                    tome.remove(model)
    return found


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cpu_process_group(rank: int, world: int, port: int, timeout: datetime.timedelta) -> Iterator[None]:
    """This process as ``rank`` of a ``world``-process gloo group on this machine, one thread each, torn down once
    every process is done (gloo aborts a process whose peer tears the group down under it). diffusers'
    ``enable_parallelism`` places a process on accelerator ``rank % device_count()``, which is 0 on a CPU-only
    torch: the count is taken as 1, and the processes run on the CPU all the same."""
    from torch import distributed as dist

    torch.set_num_threads(1)
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, out_dir: str, name: str, size: int, rounds: int, ratio: float) -> None:
    from diffusers import ContextParallelConfig

    with cpu_process_group(rank, world, port, datetime.timedelta(minutes=30)):
        cp = lambda m: m.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))  # noqa: E731
        torch.save(measure(name, size, rounds, ratio, cp), os.path.join(out_dir, f"rank{rank}.pt"))


def _error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return ((output - reference).abs().mean() / reference.abs().mean()).item()


def _row(found: Dict[str, Any]) -> Dict[str, Any]:
    median = lambda arm, what: statistics.median(found[arm][what])  # noqa: E731
    pairs = lambda what: [p / u for p, u in zip(found["patched"][what], found["unpatched"][what])]  # noqa: E731
    return dict(
        call_ms=dict(unpatched=median("unpatched", "call"), patched=median("patched", "call")),
        blocks_ms=dict(unpatched=median("unpatched", "blocks"), patched=median("patched", "blocks")),
        call_ratio=statistics.median(pairs("call")), blocks_ratio=statistics.median(pairs("blocks")),
        keys=dict(unpatched=max(found["unpatched"]["keys"]), patched=max(found["patched"]["keys"])),
        summary=found["patched"]["summary"],
    )


def run(name: str, size: int, processes: int, rounds: int, ratio: float) -> Dict[str, Any]:
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    one = measure(name, size, rounds, ratio)
    with tempfile.TemporaryDirectory() as out_dir:
        arguments = (processes, free_port(), out_dir, name, size, rounds, ratio)
        mp.start_processes(_worker, args=arguments, nprocs=processes, join=True, start_method="spawn")
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(processes)]
    reference, patched = one["unpatched"]["out"], one["patched"]["out"]
    return dict(
        model=name, size=size, processes=processes, rounds=rounds, ratio=ratio, threads_per_process=1,
        one_process=_row(one),
        per_process=[_row(found) for found in ranks],
        fidelity=dict(
            one_process_patched_vs_unpatched=_error(patched, reference),
            parallel_patched_vs_one_process_unpatched=_error(ranks[0]["patched"]["out"], reference),
            parallel_patched_vs_one_process_patched=_error(ranks[0]["patched"]["out"], patched),
            parallel_unpatched_vs_one_process_unpatched=_error(ranks[0]["unpatched"]["out"], reference),
        ),
    )


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="flux-small")
    parser.add_argument("--size", type=int, default=512, help="image side in pixels")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    result = run(args.model, args.size, args.processes, args.rounds, args.ratio)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
