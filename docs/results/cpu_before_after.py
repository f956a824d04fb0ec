"""Issue #58's CPU check: the whole SD 1.5 UNet (860M, random weights, float32, batch 2) at one latent size, patched
against unpatched in the same process, alternating (a warm-up round, then ``rounds`` paired rounds), with whichever
tome_core is first on PYTHONPATH; run it once with the code before a change and once after, in turn. The patch is
taken on and off between calls, and ``remove`` clears the kept tables, so the tables are kept across that remove
here, as a user who patches once keeps them.

    PYTHONPATH=OLD_CHECKOUT/src:OLD_CHECKOUT python docs/results/cpu_before_after.py 64 3 '{}'   # before
    PYTHONPATH=. python docs/results/cpu_before_after.py 64 3 '{}'                               # after
    # one JSON line: the ratios (unpatched / patched time) of each round and their median
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import tome_core
import tome_core.driver as driver
import tome_core.torch as tome
from tome_tools.diffusers_models import build_unet

if hasattr(driver, "forget_tables"):
    driver.forget_tables = lambda: None  # a user patches once: keep the tables across this script's removes


def main() -> None:
    side, rounds = int(sys.argv[1]), int(sys.argv[2])
    options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = build_unet("sd15").eval()
    args = (torch.randn(2, 4, side, side, generator=generator), torch.tensor(500), torch.randn(2, 77, 768, generator=generator))
    times = {"unpatched": [], "patched": []}
    summary = ""
    with torch.no_grad():
        for round_ in range(rounds + 1):
            for method in (("unpatched", "patched") if round_ % 2 == 0 else ("patched", "unpatched")):
                if method == "patched":
                    tome.patch(model, **options)
                start = time.perf_counter()
                model(*args)
                elapsed = time.perf_counter() - start
                if method == "patched":
                    summary = tome.patched_models(model)[0].state.summary()
                    tome.remove(model)
                if round_:
                    times[method].append(elapsed)
    ratios = [u / p for u, p in zip(times["unpatched"], times["patched"])]
    print(json.dumps(dict(
        code=tome_core.__file__, side=side, options=options, threads=torch.get_num_threads(), ratios=ratios,
        median=statistics.median(ratios), summary=summary,
    )))


if __name__ == "__main__":
    main()
