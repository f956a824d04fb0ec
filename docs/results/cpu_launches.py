"""Issue #58's count: the kernels a merged block launches, per arrangement, in a warm eager call (aten operations
that are not views; the same on a GPU as on this CPU), patched against unpatched, per merged block, with each
operation's share. Test widths: the count depends on the block structure, not on width.

    python docs/results/cpu_launches.py    # rows to $OUT/cpu_launches.json (a few seconds)

Rows: ToMe for SD at 0.5 and tomesd at 0.5 on SD 1.5's UNet layout at 512 px (64x64 latent, batch 2; its finest level's
5 blocks merge), the default there (keys and values in 2x2 cells, drawn per call; ``min_tokens=0`` so that it merges
on a CPU as it does where the cost model says it pays), the default on FLUX.1's 19 + 38 blocks at 1024 px (4,096
image tokens: ToMe for SD at 0.5, one match for the batch, rotary positions moved), and the default on a call it runs
unmerged (the UNet at 128 px: 256 tokens)."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any, Dict

import torch

from tome_tools.diffusers_bench import patched_launches, warm_launches
from tome_tools.diffusers_models import build_transformer, build_unet, transformer_inputs
from tome_tools.presets import UNETS

SD15 = dict(UNETS["sd15"], block_out_channels=(32, 64, 64, 64), cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)


def row(name: str, patched: Counter, unpatched: Counter, blocks: int) -> Dict[str, Any]:
    extra = patched.copy()
    extra.subtract(unpatched)
    total = sum(patched.values()) - sum(unpatched.values())
    return dict(
        case=name, blocks=blocks, extra=total, per_block=round(total / blocks, 2) if blocks else None,
        ops={op: count for op, count in sorted(extra.items(), key=lambda kv: -kv[1]) if count},
    )


def patched_row(name: str, model: Any, unpatched: Counter, args=(), kwargs=None, **options: Any) -> Dict[str, Any]:
    patched, blocks, summary = patched_launches(model, options, *args, **(kwargs or {}))
    return dict(row(name, patched, unpatched, blocks), summary=summary)


def main() -> None:
    import tomesd

    torch.manual_seed(0)
    unet = build_unet("tiny", **SD15).eval()
    generator = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 4, 64, 64, generator=generator), torch.tensor(500), torch.randn(2, 7, 32, generator=generator))
    unpatched = warm_launches(unet, *args)
    rows = [
        patched_row("sd15 512px, ToMe for SD 0.5", unet, unpatched, args, ratio=0.5),
        patched_row("sd15 512px, default (min_tokens=0)", unet, unpatched, args, min_tokens=0),
    ]
    tomesd.apply_patch(unet, ratio=0.5)
    try:
        rows.append(row("sd15 512px, tomesd 0.5", warm_launches(unet, *args), unpatched, 5))
    finally:
        tomesd.remove_patch(unet)
    small = (args[0][..., :16, :16].contiguous(), args[1], args[2])
    rows.append(patched_row("sd15 128px, default (unmerged)", unet, warm_launches(unet, *small), small))
    flux = build_transformer("tiny-flux", num_layers=19, num_single_layers=38).eval()
    inputs = transformer_inputs(flux, 128, 128)
    rows.append(patched_row("flux 1024px (19 + 38 blocks), default (min_tokens=0)", flux, warm_launches(flux, **inputs), kwargs=inputs, min_tokens=0))
    for entry in rows:
        print(f"{entry['case']}: {entry['extra']} extra launches, {entry['per_block']} per merged block")
    out = os.path.join(os.environ.get("OUT", "."), "cpu_launches.json")
    with open(out, "w") as f:
        json.dump(dict(torch=torch.__version__, rows=rows), f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
