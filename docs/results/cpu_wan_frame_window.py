"""What ``frame_window`` (a video transformer's similarity search limited to nearby frames) changes, on video-like
inputs: one Wan 2.1 1.3B-width block (``cpu_wan_block.py``'s model, random weights, float32) at 480x832 px and 81
frames (21 latent frames, 32,760 tokens), its latent a camera panning one latent pixel per frame over an
image-like scene (``tome_tools.bench_core.video_latents``, consecutive frames nearly alike, as in real videos),
noised by flow matching at sigma 0.5 (timestep 500), with 512 text tokens.

Two figures, against the whole clip's search (``frame_window=None``):

* the match: on the block's input, of the sources that the whole clip's search merges (ratio 0.5, the default's
  cells, destinations at each cell's first token), the share whose most similar destination already lies within
  1 (or 0, 2) frames of their own, and the share of merged sources both searches pick;
* the output: the relative L2 distance of each method's output to the unpatched model's (``fid``), and of its
  frame-to-frame differences (``motion err``, as ``tome_tools.bench``'s video rows).

    PYTHONPATH=.:src python docs/results/cpu_wan_frame_window.py [--frames F] [--json PATH]

About 6 minutes on a 2-core CPU (21 frames).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict

import numpy as np
import torch

import tome_core.torch as tome
from tome_core import get_ops
from tome_core.algorithm.match import batch_as_channels, best_destinations, rank_sources
from tome_core.algorithm.partition import frame_bands, split
from tome_tools.bench_core import relative_l2, video_latents

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_wan_block as block  # noqa: E402

WINDOWS = (0, 1, 2)


def inputs(frames: int) -> torch.Tensor:
    """The panning latent ``[1, 16, frames, 60, 104]`` noised at sigma 0.5."""
    clean = torch.from_numpy(video_latents(1, frames, 16, 60, 104, seed=0)).transpose(1, 2)
    noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(1))
    return 0.5 * clean + 0.5 * noise


def match_agreement(x: torch.Tensor, frames: int) -> Dict[str, float]:
    """On the block input ``x`` ``[1, N, C]`` (the frames' 30 x 52 grids stacked): the whole clip's search against
    the windowed ones, over the sources the whole search merges."""
    ops = get_ops(x)
    rows, cols, frame_rows = frames * 30, 52, 30
    dst, src = split(ops, x, rows, cols, 2, 2, None)
    metric = batch_as_channels(ops, x)
    best, which = best_destinations(ops, metric, src, dst)
    merged = rank_sources(ops, best)[0, : x.shape[1] // 2]  # ratio 0.5: the best matched sources
    src_frame = src[merged] // cols // frame_rows
    dst_frame = dst[which[0, merged]] // cols // frame_rows
    distance = (src_frame - dst_frame).abs()
    out = {f"whole search's merged sources within {k} frames": float((distance <= k).float().mean()) for k in WINDOWS}
    out["whole search's merged sources' frame distance, largest"] = int(distance.max())
    for k in WINDOWS:
        bands = frame_bands(rows, cols, 2, 2, frame_rows, k)
        windowed_best, _ = best_destinations(ops, metric, src, dst, bands=bands)
        picked = rank_sources(ops, windowed_best)[0, : x.shape[1] // 2]
        same = np.intersect1d(merged.numpy(), picked.numpy()).size / merged.numel()
        out[f"merged sources both pick, window {k}"] = same
    return out


def motion_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 distance of the consecutive-frame differences (frames on axis 2)."""
    return relative_l2(out[:, :, 1:] - out[:, :, :-1], ref[:, :, 1:] - ref[:, :, :-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=21, help="latent frames (21: Wan's 81 frames)")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "cpu_wan_frame_window.json"))
    args = parser.parse_args()
    latent = inputs(args.frames)
    call = block.build(latent.shape)
    model = call.model
    text, t = torch.randn(1, 512, 4096, generator=torch.Generator().manual_seed(2)), torch.tensor([500])

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model(latent, t, text, return_dict=False)[0]

    captured = {}
    hook = model.blocks[0].register_forward_pre_hook(lambda m, a: captured.update(x=a[0]))
    reference = run()
    hook.remove()
    agreement = match_agreement(captured["x"], args.frames)
    for name, value in agreement.items():
        print(f"{name:<55} {value:.4f}", flush=True)
    rows = []
    methods = {f"frame_window={k}": {"frame_window": k} for k in (*WINDOWS, None)}
    for name, options in methods.items():
        tome.patch(model, **options)
        out = run()
        tome.remove(model)
        rows.append(dict(method=name + (" (default)" if options["frame_window"] == 1 else ""),
                         fid=relative_l2(out, reference), motion_err=motion_error(out, reference)))
        print(f"{rows[-1]['method']:<28} fid {rows[-1]['fid']:.4f}  motion err {rows[-1]['motion_err']:.4f}", flush=True)
    undo = block.use(model, "oracle of default")
    out = run()
    undo()
    rows.append(dict(method="oracle of default", fid=relative_l2(out, reference), motion_err=motion_error(out, reference)))
    print(f"{'oracle of default':<28} fid {rows[-1]['fid']:.4f}  motion err {rows[-1]['motion_err']:.4f}", flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(latent=list(latent.shape), tokens=block.tokens_of(tuple(latent.shape)), torch=torch.__version__,
                       threads=torch.get_num_threads(), match=agreement, rows=rows), f, indent=1)
    print(f"rows in {args.json}")


if __name__ == "__main__":
    main()
