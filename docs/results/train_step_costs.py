"""Where one training step of the SD 1.5 UNet spends its time on a CPU, by operator group, unpatched and with
the recommended fine-tuning options: the ceiling any attention reduction can reach on this machine.

One full fine-tune step (forward + backward, every weight trained, random weights, batch 1, one thread, torch's
CPU profiler, self time per operator) after a warm-up step, at 512 and 768 px; and the unpatched step with every
weight frozen (gradients for the input only: what a LoRA step computes besides its small adapters). ``attention`` is every
scaled-dot-product attention (self- and cross-attention, forward and backward), ``convolution`` every
convolution, ``linear`` every matrix product of the projections and feed-forward. ``ceiling`` is the step time
over the step without its attention: the speedup if attention cost nothing. Run: ``python
docs/results/train_step_costs.py`` (torch; about 10 minutes). Where docs/results/train_step_costs.txt comes from."""

import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tome_tools.console import quiet_known_notices

quiet_known_notices()

import tome_core.torch as tome
from tome_tools.diffusers_models import build_unet

torch.set_num_threads(1)
# name: (ToMe options or None, weights frozen)
CONFIGS = {
    "unpatched": (None, False),
    "kv 4x4 + 2x2 (recommended)": (dict(mode="kv", matching="cell", level_cells={1: 4, 2: 2}, max_downsample=2), False),
    "unpatched, weights frozen": (None, True),
}
GROUPS = ("attention", "convolution", "linear", "other")


def group(op: str) -> str:
    if "scaled_dot_product" in op or "flash_attention" in op or "softmax" in op or "bmm" in op:
        return "attention"
    if "conv" in op:
        return "convolution"
    if op in ("aten::mm", "aten::addmm", "aten::linear"):
        return "linear"
    return "other"


def profiled_step(unet: torch.nn.Module, resolution: int, frozen: bool) -> tuple:
    latent = resolution // 8
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, latent, latent, generator=generator).requires_grad_(frozen)
    unet.requires_grad_(not frozen)
    text = torch.randn(1, 77, 768, generator=generator)

    def step():
        unet.zero_grad(set_to_none=True)
        unet(sample, torch.tensor([500]), encoder_hidden_states=text).sample.pow(2).mean().backward()

    step()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        total = time.perf_counter() - start
    seconds = collections.Counter()
    for event in prof.key_averages():
        seconds[group(event.key)] += event.self_cpu_time_total / 1e6
    return total, seconds


def main() -> None:
    unet = build_unet("sd15")
    print(f"{'':8}{'configuration':32}{'step s':>8}" + "".join(f"{g:>16}" for g in GROUPS) + f"{'ceiling':>9}")
    for resolution in (512, 768):
        for name, (options, frozen) in CONFIGS.items():
            if options is not None:
                tome.patch(unet, **options)
            total, seconds = profiled_step(unet, resolution, frozen)
            tome.remove(unet)
            shares = "".join(f"{seconds[g]:>8.1f}s ({seconds[g] / total:3.0%})" for g in GROUPS)
            print(f"{resolution:>4} px {name:32}{total:>8.1f}{shares}{total / (total - seconds['attention']):>8.2f}x")


if __name__ == "__main__":
    main()
