"""Whether merging pays: the default merges a level only where measurements say it makes the call faster.

Merging trades attention over fewer keys (or tokens) for work of its own (choosing and gathering tokens, and in
eager code the hooks' Python and kernel launches). Below some number of tokens per level that costs more than
attention saves, so the default runs such a level unmerged and ``summary()`` says why. ``min_tokens`` sets the
bound by hand (0: every size); options that choose an arrangement themselves merge at every size unless it is given.

The bounds are read off paired measurements of whole calls against the same run's unpatched call
(``docs/results/gpu_h200_defaults.json`` and ``gpu_h200_speed*.json``: H200, float16/bfloat16, SD 1.5, SDXL,
PixArt, Flux, Flux.2, Wan, HunyuanVideo, LTX at released widths; ``docs/results/defaults_speed_sd15_*.json``: this project's 2-core
CPUs, float32). Across those, the token count of the merged level separated the cells that paid from those that did
not for each device, execution and arrangement; the models' widths (320-3072 channels), heads and dtypes did
not, so they are not inputs. Each bound sits at a measured size that paid, above the largest that did not.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

DEVICES = ("cpu", "gpu")  # every accelerator counts as "gpu" (CUDA, ROCm, XPU, MPS, TPU)
EXECUTIONS = ("eager", "captured", "compiled")  # Python per call; a CUDA graph replayed; a traced program (torch.compile, jax.jit)
ARRANGEMENTS = ("cells", "similarity")  # keys/values in cells (no similarity computed); ToMe for SD's bipartite match

# (device, execution, arrangement) -> fewest tokens at a level for merging to pay there.
MIN_TOKENS: Dict[Tuple[str, str, str], int] = {
    # SD 1.5 UNet, kv 2x2 cells: 4,096 tokens 0.90x eager, 1.03x in a CUDA graph; 16,384 tokens 1.27x graph, and
    # eager 1.17x at batch 2 but 0.85x and 0.89x at batch 1 (two H200 hosts, gpu_h200_speed*.json): an eager GPU call
    # is bound by its host, so no size up to 16,384 reliably pays there; the next measured size that pays eagerly is a
    # video DiT's (below), so UNets merge eagerly from 32,768 tokens (2048 px; not measured yet).
    # PixArt (1,152 channels), kv 2x2 cells in a graph: 1,024 tokens 0.95x, 4,096 tokens 1.30x.
    ("gpu", "eager", "cells"): 32768,
    ("gpu", "captured", "cells"): 4096,
    ("gpu", "compiled", "cells"): 4096,
    # ToMe for SD at 0.5 on joint attention in a graph: Flux 1,024 image tokens 0.89x, 4,096 tokens 1.13x; Flux.2
    # 4,096 tokens 1.30x; HunyuanVideo 4,080 tokens 1.16x (the fewest measured that paid); Wan 4,680 tokens 1.00x.
    # SD 1.5 eager at 0.5: 4,096 tokens 0.77x, 16,384 tokens 1.01x. Eager, batch 1: Flux 4,096 tokens 0.83x; Wan 1.3B
    # width 32,760 tokens (81 frames at 480p) 1.31x, 75,600 (720p) 1.66x; HunyuanVideo 118,800 tokens 2.46x.
    # These eager bounds were measured before the merge became launch-lean (per merged block 54 -> 19 kernels for ToMe
    # for SD, 15 -> 3 for cells: docs/results/launches.md); gpu_speed.py's `launches` part and eager rows re-derive
    # them on the next GPU (a level pays where the attention it saves outweighs launches x one launch's cost).
    ("gpu", "eager", "similarity"): 16384,
    ("gpu", "captured", "similarity"): 4080,
    ("gpu", "compiled", "similarity"): 4080,
    # CPUs (2 cores, float32): SD 1.5 at 512 px, 4,096 tokens: kv 2x2 cells 1.05x, ToMe for SD 0.5 1.04x; 16,384
    # tokens 1.67x / 1.34x (docs/results/defaults_speed_sd15_{512,1024}.json); smaller sizes are not measured yet,
    # so the bound is the smallest size measured to pay. A CPU runs no CUDA graph. The whole SDXL UNet at 1024 px
    # (4,096 tokens at its finest attention level, 640 channels): kv 2x2 cells 1.07x, ToMe for SD 0.5 1.06x, its merged
    # blocks 8.6 -> 5.4 s a call (docs/results/cpu_sdxl_1024_levels.json). ToMe for SD 0.5 on Flux at 1024 px (4,096
    # image tokens) 1.29x (cpu_flux_1024.json); on a Wan 1.3B block, its search within 1 frame, 2.18x at 32,760
    # tokens, 2.66x at 75,600 (cpu_wan_block*.json).
    ("cpu", "eager", "cells"): 4096,
    ("cpu", "compiled", "cells"): 4096,
    ("cpu", "eager", "similarity"): 4096,
    ("cpu", "compiled", "similarity"): 4096,
}


def fewest_tokens(device: str, execution: str, arrangement: str) -> int:
    """The fewest tokens at a level for merging to pay, from :data:`MIN_TOKENS`."""
    for name, value, allowed in (("device", device, DEVICES), ("execution", execution, EXECUTIONS), ("arrangement", arrangement, ARRANGEMENTS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    if (device, execution) == ("cpu", "captured"):
        raise ValueError("execution='captured' (a CUDA graph) needs a GPU, got device='cpu'")
    return MIN_TOKENS[(device, execution, arrangement)]


def why_unpaid(tokens: int, device: str, execution: str, arrangement: str, min_tokens: Optional[int]) -> Optional[str]:
    """Why a level of ``tokens`` tokens runs unmerged, or None where it merges: ``min_tokens`` when given
    (the option), else the measured bound for this device, execution and arrangement."""
    if min_tokens is not None:
        if tokens >= min_tokens:
            return None
        return f"{tokens} tokens, fewer than min_tokens={min_tokens}"
    fewest = fewest_tokens(device, execution, arrangement)
    if tokens >= fewest:
        return None
    return (
        f"{tokens} tokens, fewer than the {fewest} from which merging pays on a {device} ({execution}, {arrangement}; "
        "measured), so the default runs them unmerged (min_tokens=0 merges anyway)"
    )
