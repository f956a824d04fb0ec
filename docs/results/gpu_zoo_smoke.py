"""Every model class the zoo test merges, on a GPU in bfloat16: what the CPU tests cannot tell (device placement
of the indices and masks the patch builds, dtypes of the size bias and gathered rotary tables, kernels that
refuse a dtype). Each tiny model of ``tests/torch/test_zoo.py``'s ``MERGED`` table runs unpatched, with the
default and with ``ratio=0.5``; a class passes when every output is finite, the patched outputs differ from
the unpatched one and ``remove`` gives it back exactly. Needs CUDA and diffusers.

    python docs/results/gpu_zoo_smoke.py    # writes gpu_zoo_smoke.json to $OUT (default /tmp)
"""
import json
import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "torch"))
import test_zoo  # noqa: E402  (the tiny configs and inputs of every merged class)

import tome_core.torch as tome  # noqa: E402
from gpu_timing import in_dtype, on_device  # noqa: E402

warnings.simplefilter("ignore")
dev, dtype = "cuda", torch.bfloat16


def check(name):
    model, inputs = test_zoo.MERGED[name]()
    model, inputs = in_dtype(model, dev, dtype), on_device(inputs, dev, dtype)
    plain = test_zoo._run(model, inputs).float()
    noise = test_zoo._rel(test_zoo._run(model, inputs).float(), plain)  # run-to-run (atomics in GPU kernels)
    row = {"class": name, "finite": bool(torch.isfinite(plain).all()), "noise": noise}
    for label, options in (("default", {}), ("ratio 0.5", {"ratio": 0.5})):
        tome.patch(model, **options)
        out = test_zoo._run(model, inputs).float()
        row[label] = test_zoo._rel(out, plain)
        row["finite"] &= bool(torch.isfinite(out).all())
    tome.remove(model)
    row["removed exact"] = test_zoo._rel(test_zoo._run(model, inputs).float(), plain) <= noise
    row["ok"] = row["finite"] and row["removed exact"] and row["ratio 0.5"] > noise
    return row


if __name__ == "__main__":
    rows = []
    for name in test_zoo.MERGED:
        try:
            row = check(name)
        except Exception as error:  # one class failing keeps the others' rows
            row = {"class": name, "ok": False, "error": f"{type(error).__name__}: {error}"[:300],
                   "where": traceback.format_exc().splitlines()[-3][:200]}
        rows.append(row)
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {name:<42} " + (
            f"default {row['default']:.4f}  ratio 0.5 {row['ratio 0.5']:.4f}" if "default" in row else row.get("error", "")
        ), flush=True)
        torch.cuda.empty_cache()
    out = os.path.join(os.environ.get("OUT", "/tmp"), "gpu_zoo_smoke.json")
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": str(dtype), "rows": rows},
              open(out, "w"), indent=1)
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} classes ok", flush=True)
