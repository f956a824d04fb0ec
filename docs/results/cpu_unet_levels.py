"""Issue #42's CPU UNet cells, level by level: a whole UNet at a released config (random weights, float32, batch 1,
one call), each method against the unpatched call of the same round, methods alternating in forward and backward
order, and the time of each UNet part in every call (each ``Transformer2DModel`` counted at its level, the rest of
the call apart). The whole-call ratio of a large UNet on a shared 2-core CPU moves by several percent from call to
call; the per-level times say where a method saves and whether it costs anything where it does not merge.

    python docs/results/cpu_unet_levels.py [--unet sdxl] [--resolution 1024] [--rounds R] [--methods M ...]
    # rows to $OUT/cpu_<unet>_<resolution>_levels.json

Methods: ``default`` (``patch(unet)``), ``oracle of default`` (free removal of the tokens the default removes:
``tome_tools.oracle.attach_oracle``), ``prefer="speed"``, ``ratio=0.5`` (ToMe for SD's arrangement) and
``tomesd`` (``tomesd.apply_patch(unet, ratio=0.5)`` at the finest level with attention, as
``gpu_speed.py`` runs it: ``max_downsample=2`` on SDXL, where its default merges nothing). SDXL at 1024 px: about 45 s a call here.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import torch
from diffusers import UNet2DConditionModel

import tome_core.torch as tome
from tome_tools.diffusers_bench import hook_default_oracle
from tome_tools.presets import UNETS

METHODS = ("unpatched", "default", "oracle of default", 'prefer="speed"', "ratio=0.5", "tomesd")


def build(unet: str, resolution: int) -> Callable[[], Dict[str, float]]:
    """The UNet's call on seeded inputs; it returns seconds per part (``call.model``: the model; ``call.tokens``:
    each part's tokens per image)."""
    torch.manual_seed(0)
    config = UNETS[unet]
    model = UNet2DConditionModel(**config).eval()
    side = resolution // 8
    x, t = torch.randn(1, 4, side, side), torch.tensor([500])
    text = torch.randn(1, 77, config["cross_attention_dim"])
    extra = {}
    if config.get("addition_embed_type") == "text_time":
        pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
        extra = dict(added_cond_kwargs=dict(text_embeds=torch.randn(1, pooled), time_ids=torch.randn(1, 6)))
    seconds: Dict[str, float] = collections.defaultdict(float)
    started: Dict[str, float] = {}
    tokens: Dict[str, int] = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "Transformer2DModel":
            part = name.rsplit(".attentions", 1)[0]

            def begin(m: Any, a: Any, part: str = part) -> None:
                tokens[part] = a[0].shape[-2] * a[0].shape[-1]
                started[part] = time.perf_counter()

            def end(m: Any, a: Any, o: Any, part: str = part) -> None:
                seconds[part] += time.perf_counter() - started[part]

            module.register_forward_pre_hook(begin)
            module.register_forward_hook(end)

    def call() -> Dict[str, float]:
        seconds.clear()
        start = time.perf_counter()
        with torch.inference_mode():
            model(x, t, text, **extra)
        seconds["call"] = time.perf_counter() - start
        return dict(seconds)

    call.model = model  # type: ignore[attr-defined]
    call.tokens = tokens  # type: ignore[attr-defined]
    return call


def finest_attention(model: Any) -> int:
    """The downsample factor of the UNet's finest level with attention (2 on SDXL, whose first level has none):
    tomesd's ``max_downsample`` there, since its default of 1 merges nothing on SDXL."""
    kinds = model.config.down_block_types
    return 2 ** next(level for level, kind in enumerate(kinds) if "CrossAttn" in kind)


def use(model: Any, method: str) -> Callable[[], None]:
    """Patch ``model`` for ``method``; returns what removes it."""
    if method == "unpatched":
        return lambda: None
    if method == "tomesd":
        import tomesd

        tomesd.apply_patch(model, ratio=0.5, max_downsample=finest_attention(model))
        return lambda: tomesd.remove_patch(model)
    if method == "oracle of default":
        return hook_default_oracle(model)
    tome.patch(model, **{"default": {}, 'prefer="speed"': {"prefer": "speed"}, "ratio=0.5": {"ratio": 0.5}}[method])
    return lambda: tome.remove(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--unet", choices=sorted(UNETS), default="sdxl")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS, help="these (unpatched always)")
    args = parser.parse_args()
    methods = ("unpatched", *(m for m in args.methods if m != "unpatched"))
    torch.set_num_threads(args.threads)
    call = build(args.unet, args.resolution)
    call()  # warm-up
    parts: Dict[str, List[Dict[str, float]]] = {m: [] for m in methods}
    for r in range(args.rounds):
        for method in (methods if r % 2 == 0 else methods[::-1]):
            undo = use(call.model, method)
            parts[method].append(call())
            undo()
            print(f"round {r} {method:<20} {parts[method][-1]['call']:6.1f} s", flush=True)
    rows = []
    for method in methods:
        ratios = [u["call"] / m["call"] for u, m in zip(parts["unpatched"], parts[method])]
        medians = {part: statistics.median(p[part] for p in parts[method]) for part in parts[method][0]}
        medians["rest"] = statistics.median(p["call"] - sum(v for k, v in p.items() if k != "call") for p in parts[method])
        rows.append(dict(method=method, speedup=statistics.median(ratios), speedups=ratios, seconds=parts[method],
                         median_s=medians))
        print(f"{method:<20} {rows[-1]['speedup']:5.2f}x  " + "  ".join(f"{k} {v:5.2f}" for k, v in medians.items()))
    out = os.path.join(os.environ.get("OUT", "/tmp"), f"cpu_{args.unet}_{args.resolution}_levels.json")
    with open(out, "w") as f:
        json.dump(dict(unet=args.unet, resolution=args.resolution, threads=args.threads, torch=torch.__version__,
                       cpu=os.cpu_count(), rounds=args.rounds, tokens=call.tokens, command=" ".join(sys.argv), rows=rows), f, indent=1)
    print(f"rows in {out}")


if __name__ == "__main__":
    main()
