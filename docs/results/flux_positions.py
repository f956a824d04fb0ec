"""Which rotary position should a merged Flux token carry? Fidelity of three choices (random weights).

Relative L2 distance of the transformer output to the unpatched output, one call at a mid timestep:

* ``destination`` (what tome_core does): each merged token takes the position of the token it stands at;
* ``mean``: the rotary tables (cos, sin) averaged over the tokens merged into a slot (not a rotation any
  more, but what merging the position embeddings like the tokens would give);
* ``truncated``: the first ``N - r`` image positions, ignoring which token is where (what passing the
  positions through untouched would amount to if the attention accepted it).

Run: ``python docs/results/flux_positions.py --preset flux-small --resolution 512``.
"""

from __future__ import annotations

import argparse

from tome_tools.console import quiet_known_notices

quiet_known_notices()  # before diffusers is imported

import torch

from tome_core.hooks import block_hooks
import tome_core.torch as tome
from tome_tools.diffusers_models import build_transformer, transformer_inputs
from tome_core.algorithm.merge import merge


def _mean(rotary, match, *layout):  # Flux: text first, no head or tail (the layout merge_positions takes)
    moved = []
    for table in rotary:
        text = table.shape[0] - match.tokens
        image = merge(table[text:][None].expand(match.batch, -1, -1), match)[0]
        moved.append(torch.cat([table[:text], image]))
    return tuple(moved)


def _truncated(rotary, match, *layout):
    return tuple(table[: table.shape[0] - match.merged] for table in rotary)


CHOICES = {"destination": block_hooks.merge_positions, "mean": _mean, "truncated": _truncated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="flux-small")
    parser.add_argument("--resolution", type=int, default=512, help="pixels (latent = px / 8)")
    parser.add_argument("--ratio", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    args = parser.parse_args()
    model = build_transformer(args.preset)
    latent = args.resolution // 8
    inputs = transformer_inputs(model, latent, latent, batch=1)
    with torch.no_grad():
        reference = model(**inputs).sample
        print(f"{args.preset} {args.resolution}px: relative L2 to unpatched")
        print("ratio  " + "  ".join(f"{name:>11}" for name in CHOICES))
        original = block_hooks.merge_positions
        try:
            for ratio in args.ratio:
                row = []
                for choice in CHOICES.values():
                    block_hooks.merge_positions = choice  # where the sub-layer hooks look it up
                    tome.patch(model, ratio=ratio)
                    out = model(**inputs).sample
                    tome.remove(model)
                    row.append(float((out - reference).norm() / reference.norm()))
                print(f"{ratio:<5}  " + "  ".join(f"{value:11.4f}" for value in row))
        finally:
            block_hooks.merge_positions = original


if __name__ == "__main__":
    main()
