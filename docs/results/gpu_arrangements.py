"""GPU, float16, SDPA (SD 1.5 architecture, random weights): one UNet call per method captured in a CUDA graph
(no launch overhead; capture also proves the patched call has no host sync), replays timed with CUDA events,
methods alternating; fidelity (relative L2 at t=500) against unpatched. Needs CUDA and tomesd.

    python docs/results/gpu_arrangements.py    # writes gpu_graphs.json to $OUT (default /tmp)
"""
import json, os, statistics, warnings
import torch, tomesd
import tome_core.torch as tome
from tome_tools.diffusers_models import build_unet
from tome_tools.bench_core import image_like_latents

warnings.simplefilter("ignore")
dev, dtype = "cuda", torch.float16
unet = build_unet("sd15").to(dev, dtype).eval()
METHODS = {
    "unpatched": None, "tomesd 0.5": "tomesd", "tokens 0.5": {"ratio": 0.5}, "tokens 0.5 plain": {"ratio": 0.5, "proportional_attn": False},
    "tokens 0.75": {"ratio": 0.75}, "auto (default)": {}, "kv cell 2x2": {"mode": "kv", "matching": "cell"},
    "kv cell 4x4": {"mode": "kv", "matching": "cell", "sx": 4, "sy": 4},
    "kv cell 4x4+2x2": {"mode": "kv", "matching": "cell", "level_cells": {1: 4, 2: 2}, "max_downsample": 2},
    "kv 0.75": {"mode": "kv", "ratio": 0.75}, "queries 0.5": {"mode": "queries", "ratio": 0.5},
}
def setup(m):
    tome.remove(unet); tomesd.remove_patch(unet)
    spec = METHODS[m]
    if spec == "tomesd": tomesd.apply_patch(unet, ratio=0.5)
    elif spec is not None: tome.patch(unet, **spec)
rows = []
for res, batch, rounds, reps in [(512, 2, 7, 20), (768, 2, 5, 10), (1024, 1, 5, 10), (1024, 2, 5, 10), (1536, 1, 3, 5), (2048, 1, 3, 3)]:
    lat = torch.tensor(image_like_latents(batch, 4, res // 8, res // 8, seed=0), dtype=dtype, device=dev)
    text = torch.randn(batch, 77, 768, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
    t = torch.tensor(500, device=dev)
    graphs, outs, note = {}, {}, {}
    for m in METHODS:
        setup(m)
        with torch.no_grad():
            s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2): unet(lat, t, text)
            torch.cuda.current_stream().wait_stream(s)
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = unet(lat, t, text).sample
                graphs[m] = (g, out); g.replay(); torch.cuda.synchronize(); outs[m] = out.float().clone()
            except Exception as e:
                note[m] = str(e).splitlines()[0][:80]
                torch.cuda.synchronize()
                outs[m] = unet(lat, t, text).sample.float()
    setup("unpatched")
    times = {m: [] for m in graphs}
    for r in range(rounds):
        for m in (list(graphs) if r % 2 == 0 else list(reversed(graphs))):
            g = graphs[m][0]; g.replay()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps): g.replay()
            b.record(); torch.cuda.synchronize(); times[m].append(a.elapsed_time(b) / reps)
    base = statistics.median(times["unpatched"])
    print(f"\n{res}px batch {batch}: unpatched {base:.2f} ms per call (CUDA graph replays; median of {rounds} rounds x {reps})", flush=True)
    for m in METHODS:
        fid = ((outs[m] - outs["unpatched"]).norm() / outs["unpatched"].norm()).item()
        if m in times:
            tm = statistics.median(times[m]); spread = (max(times[m]) - min(times[m])) / tm
            rows.append(dict(resolution=res, batch=batch, method=m, ms=tm, speedup=base / tm, fid=fid, spread=spread))
            print(f"  {m:<18} {tm:8.2f} ms {base / tm:6.2f}x  fid@t {fid:.4f}  spread {spread:.1%}", flush=True)
        else:
            print(f"  {m:<18} no CUDA graph ({note[m]})  fid@t {fid:.4f}", flush=True)
    del graphs, outs; torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "gpu_graphs.json"), "w"), indent=1)
