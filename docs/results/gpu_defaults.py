"""GPU, float16, PyTorch SDPA: the default (keys/values in cells, one token drawn per cell) next to the cells' mean,
ToMe for SD at 0.5 (`ratio=0.5`), tomesd and the unpatched model, and what size-aware attention's bias does to
SDPA's choice of kernel. Needs CUDA, diffusers and tomesd.

    python docs/results/gpu_defaults.py [part ...]    # writes gpu_defaults.json to $OUT (default /tmp)

Three parts, each row written as soon as it is measured:
1. ``sdpa``: one SDPA call at the shapes ToMe for SD's merged attention has (SD 1.5 at 1024 px, batch 2, its
   finest level after merging half the tokens; Flux at 1024 px, 2048 image + 512 text tokens), with and without
   the ``[B, 1, 1, K]`` log-size bias, under each backend SDPA has, and the kernels the default dispatch runs
   (profiler), timed with ``triton.testing.do_bench`` (median).
2. ``unet``: SD 1.5 architecture (random weights), one UNet call per method captured in a CUDA graph (no launch
   overhead; a capture also proves the patched call makes no host sync), replays timed with CUDA events in
   alternating rounds; eager calls too where a method cannot be captured (tomesd at an even batch); fid@t is
   the relative L2 to the unpatched call at t=500 on image-like latents.
3. ``flux``, ``pixart``, ``wan``: one call of each at its released width with fewer blocks, CUDA graph, at the
   reductions the knob's settings run (ToMe for SD at 0.25 / 0.5 / 0.75 where keys cannot be taken apart; cells
   of 2x1 / 2x2 / 4x4 where they can), with and without size-aware attention.
4. ``newer`` (named only): Flux.2, Qwen-Image, HunyuanVideo and LTX-Video at their released widths with 1-2
   blocks of each kind (the bench's presets), ``ratio=0.5`` against unpatched.
"""
import os
import statistics
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import tomesd
import tome_core.torch as tome
from tome_tools.diffusers_models import build_transformer, build_unet, transformer_inputs
from tome_tools.bench_core import image_like_latents
from gpu_timing import Recorder, capture, on_device, relative_l2, time_rounds

warnings.simplefilter("ignore")
dev, dtype = "cuda", torch.float16
record = Recorder(os.path.join(os.environ.get("OUT", "/tmp"), "gpu_defaults.json"),
                  device=torch.cuda.get_device_name(), torch=torch.__version__)


def sdpa_part():
    shapes = {  # name: (batch, heads, tokens, head dim)
        "sd15 1024px b2, unmerged": (2, 8, 16384, 40),
        "sd15 1024px b2, tokens 0.5": (2, 8, 8192, 40),
        "flux 1024px, unmerged": (1, 24, 4608, 128),
        "flux 1024px, tokens 0.5": (1, 24, 2560, 128),
    }
    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    print("\nSDPA, float16, median ms (do_bench)", flush=True)
    for name, (b, h, n, d) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dtype, generator=g) for _ in range(3))
        sizes = torch.randint(1, 4, (b, 1, 1, n), device=dev, generator=g).to(dtype)
        bias = sizes.log()
        for masked in (False, True):
            mask = bias if masked else None
            kernels = []
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                torch.cuda.synchronize()
            kernels = sorted({e.name[:70] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
            for label, backend in backends.items():
                def call():
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                try:
                    if backend is None:
                        ms = do_bench(call, warmup=25, rep=150, return_mode="median")
                    else:
                        with sdpa_kernel([backend]):
                            ms = do_bench(call, warmup=25, rep=150, return_mode="median")
                    err = None
                except Exception as e:  # a backend that refuses the shape or the mask
                    ms, err = None, str(e).splitlines()[0][:90]
                record(part="sdpa", shape=name, bias=masked, backend=label, ms=ms, error=err,
                       kernels=kernels if backend is None else None)
                print(f"  {name:<28} bias={masked!s:<5} {label:<9} " + (f"{ms:8.3f} ms" if ms else f"refused ({err})"), flush=True)
            print(f"  {name:<28} bias={masked!s:<5} default runs: {'; '.join(kernels)}", flush=True)


METHODS = {
    "unpatched": None,
    "tomesd 0.5": "tomesd",
    "ratio 0.5 (ToMe for SD)": {"ratio": 0.5},
    "ratio 0.5 plain": {"ratio": 0.5, "proportional_attn": False},
    "default (auto)": {},
    "auto, cell mean": {"cell_pool": "mean"},
    "kv 2x2 sample": {"mode": "kv", "matching": "cell", "cell_pool": "sample"},
    "kv 2x1 sample": {"mode": "kv", "matching": "cell", "cell_pool": "sample", "sx": 2, "sy": 1},
    "kv 4x4 sample": {"mode": "kv", "matching": "cell", "cell_pool": "sample", "sx": 4, "sy": 4},
    "kv 4x4+2x2 sample": {"mode": "kv", "matching": "cell", "cell_pool": "sample", "level_cells": {1: 4, 2: 2}, "max_downsample": 2},
    "kv similarity 0.5": {"mode": "kv", "ratio": 0.5},
}


def unet_part():
    unet = build_unet("sd15").to(dev, dtype).eval()

    def setup(m):
        tome.remove(unet)
        tomesd.remove_patch(unet)
        spec = METHODS[m]
        if spec == "tomesd":
            tomesd.apply_patch(unet, ratio=0.5)
        elif spec is not None:
            tome.patch(unet, **spec)

    for res, batch, rounds, reps, eager in [(512, 2, 7, 20, True), (1024, 1, 5, 10, False), (1024, 2, 5, 10, True)]:
        lat = torch.tensor(image_like_latents(batch, 4, res // 8, res // 8, seed=0), dtype=dtype, device=dev)
        text = torch.randn(batch, 77, 768, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
        t = torch.tensor(500, device=dev)
        graphs, outs, note = {}, {}, {}
        with torch.no_grad():
            for m in METHODS:
                setup(m)
                try:
                    graphs[m], out = capture(lambda: unet(lat, t, text).sample)
                    outs[m] = out.float().clone()
                except Exception as e:
                    note[m] = str(e).splitlines()[0][:80]
                    torch.cuda.synchronize()
                    outs[m] = unet(lat, t, text).sample.float()
            setup("unpatched")
            times = time_rounds(graphs, rounds, reps)
            base = statistics.median(times["unpatched"])
            print(f"\nUNet {res}px batch {batch}: unpatched {base:.2f} ms (CUDA graph replays, median of {rounds} x {reps})", flush=True)
            ref = outs["unpatched"]
            for m in METHODS:
                fid = relative_l2(outs[m], ref)
                if m in times:
                    tm = statistics.median(times[m])
                    spread = (max(times[m]) - min(times[m])) / tm
                    record(part="unet", timing="graph", resolution=res, batch=batch, method=m, ms=tm, speedup=base / tm, fid=fid, spread=spread)
                    print(f"  {m:<24} {tm:8.2f} ms {base / tm:6.2f}x  fid@t {fid:.4f}  spread {spread:.1%}", flush=True)
                else:
                    record(part="unet", timing="graph", resolution=res, batch=batch, method=m, ms=None, fid=fid, note=note[m])
                    print(f"  {m:<24} no CUDA graph ({note[m]})  fid@t {fid:.4f}", flush=True)
            del graphs
            torch.cuda.empty_cache()
            if not eager:
                continue
            eager_methods = ["unpatched", "tomesd 0.5", "ratio 0.5 (ToMe for SD)", "default (auto)", "auto, cell mean"]
            call = lambda: unet(lat, t, text)  # noqa: E731
            # patched in turn: patching is not timed
            times = time_rounds({m: call for m in eager_methods}, rounds, reps, before={m: (lambda m=m: setup(m)) for m in eager_methods})
            setup("unpatched")
            base = statistics.median(times["unpatched"])
            print(f"UNet {res}px batch {batch}, eager: unpatched {base:.2f} ms", flush=True)
            for m in eager_methods:
                tm = statistics.median(times[m])
                spread = (max(times[m]) - min(times[m])) / tm
                record(part="unet", timing="eager", resolution=res, batch=batch, method=m, ms=tm, speedup=base / tm, spread=spread)
                print(f"  {m:<24} {tm:8.2f} ms {base / tm:6.2f}x  spread {spread:.1%}", flush=True)
    tome.remove(unet)


def transformer_part(label, model, inputs, methods, rounds=7, reps=10):
    """One call of ``model(**inputs)`` per method in a CUDA graph, alternating replays; fid@t against unpatched."""
    graphs, outs = {}, {}
    with torch.no_grad():
        for m, spec in methods.items():
            tome.remove(model)
            if spec is not None:
                tome.patch(model, **spec)
            graphs[m], out = capture(lambda: model(**inputs).sample)
            outs[m] = out.float().clone()
        tome.remove(model)
        times = time_rounds(graphs, rounds, reps)
    base = statistics.median(times["unpatched"])
    print(f"\n{label}: unpatched {base:.2f} ms (CUDA graph)", flush=True)
    ref = outs["unpatched"]
    for m in methods:
        tm = statistics.median(times[m])
        fid = relative_l2(outs[m], ref)
        spread = (max(times[m]) - min(times[m])) / tm
        record(part="transformer", model=label, method=m, ms=tm, speedup=base / tm, fid=fid, spread=spread)
        print(f"  {m:<34} {tm:8.2f} ms {base / tm:6.2f}x  fid@t {fid:.4f}  spread {spread:.1%}", flush=True)
    del graphs, outs
    torch.cuda.empty_cache()


RATIOS = {"unpatched": None, "ratio 0.25": {"ratio": 0.25}, "default = ratio 0.5": {},
          "ratio 0.5, proportional_attn=False": {"proportional_attn": False}, "ratio 0.75": {"ratio": 0.75}}


def flux_part():
    """Flux at its released width (1 double + 2 single blocks), bfloat16 (as Flux runs), 512 + 1024 px."""
    model = build_transformer("flux-small", num_layers=1, num_single_layers=2).to(dev, torch.bfloat16).eval()
    for px in (512, 1024):
        inputs = on_device(transformer_inputs(model, px // 8, px // 8, text=512), dev, torch.bfloat16)
        transformer_part(f"Flux width, {px} px", model, inputs, RATIOS)


def pixart_part():
    """PixArt-alpha at its released width (4 of its 28 blocks), float16, batch 2 (guidance), 512 + 1024 px."""
    model = build_transformer("pixart", num_layers=4).to(dev, dtype).eval()
    methods = {"unpatched": None, "ratio 0.5 (ToMe for SD)": {"ratio": 0.5}, "default (kv 2x2 sample)": {},
               "kv 2x1 sample": {"mode": "kv", "matching": "cell", "cell_pool": "sample", "sx": 2, "sy": 1},
               "kv 4x2 sample": {"mode": "kv", "matching": "cell", "cell_pool": "sample", "sx": 4, "sy": 2},
               "kv 3x3 sample": {"mode": "kv", "matching": "cell", "cell_pool": "sample", "sx": 3, "sy": 3},
               "kv 4x4 sample": {"mode": "kv", "matching": "cell", "cell_pool": "sample", "sx": 4, "sy": 4},
               "kv similarity 0.5": {"mode": "kv", "ratio": 0.5}}
    for px in (512, 1024):
        inputs = on_device(transformer_inputs(model, px // 8, px // 8, batch=2, text=120), dev, dtype)
        transformer_part(f"PixArt width, {px} px, batch 2", model, inputs, methods)


def wan_part():
    """Wan 2.1 1.3B at its released width (2 of its 30 blocks), bfloat16, batch 2, 480x832, 9 frames."""
    from tome_tools.diffusers_models import build_video_transformer, video_transformer_inputs

    model = build_video_transformer("wan-1.3b", num_layers=2).to(dev, torch.bfloat16).eval()
    inputs = on_device(video_transformer_inputs(model, 3, 60, 104, batch=2, text=512), dev, torch.bfloat16)
    transformer_part("Wan 1.3B width, 480x832, 9 frames, batch 2", model, inputs, RATIOS)


def newer_part():
    """The newer families at their released widths with 1-2 blocks of each kind (the bench's presets), bfloat16,
    batch 1: Flux.2 dev and Qwen-Image at 1024 px, HunyuanVideo at 544x960 x 5 frames, LTX-Video at 512x704 x 161."""
    from tome_tools.diffusers_models import video_transformer_inputs

    methods = {"unpatched": None, "ratio 0.5": {"ratio": 0.5}}
    for preset, label, video in [
        ("flux2-small", "Flux.2 dev width, 1024 px", None), ("qwen-image-small", "Qwen-Image width, 1024 px", None),
        ("hunyuan-video-small", "HunyuanVideo width, 544x960, 5 frames", (2, 68, 120)),
        ("ltx-small", "LTX-Video width, 512x704, 161 frames", (21, 16, 22)),
    ]:
        model = build_transformer(preset).to(dev, torch.bfloat16).eval()
        made = video_transformer_inputs(model, *video, text=256) if video else transformer_inputs(model, 128, 128, text=512)
        try:
            transformer_part(label, model, on_device(made, dev, torch.bfloat16), methods)
        except Exception as e:  # one model failing keeps the others' rows
            print(f"{label} failed: {type(e).__name__}: {e}"[:300], flush=True)
            record(part="transformer", model=label, error=f"{type(e).__name__}: {e}"[:300])
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    parts = sys.argv[1:] or ["sdpa", "unet", "flux", "pixart", "wan"]
    for part in parts:
        torch.cuda.empty_cache()
        try:
            {"sdpa": sdpa_part, "unet": unet_part, "flux": flux_part, "pixart": pixart_part, "wan": wan_part,
             "newer": newer_part}[part]()
        except Exception as e:  # one part failing keeps the others' rows
            print(f"part {part} failed: {type(e).__name__}: {e}", flush=True)
            record(part=part, error=f"{type(e).__name__}: {e}"[:300])
