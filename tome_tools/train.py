"""Train the small models the benchmark's sample fidelity rests on (:mod:`tome_tools.trained`), on a CPU.

    python -m tome_tools.train classifier --out models/classifier
    python -m tome_tools.train unet --out models/trained-unet --steps 800
    python -m tome_tools.train dit --out models/trained-dit --steps 1500
    python -m tome_tools.train mmdit --out models/trained-mmdit --steps 1500

Seeded and reproducible (same seed, threads and torch build give the same weights); prints the loss curve and
stores it in the folder's ``model_info.json`` (``classifier.json`` for the classifier). Needs torch, diffusers
and scikit-image (``pip install ".[trained]"`` from the clone).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional, Sequence

DEFAULT_STEPS = {"unet": 800, "dit": 1500, "mmdit": 1500, "classifier": 1000}
DEFAULT_LR = {"unet": 1e-3, "dit": 6e-4, "mmdit": 6e-4}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tome_tools.train", description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=sorted(DEFAULT_STEPS), help="what to train")
    p.add_argument("--out", required=True, help="folder to write the model to")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default: {DEFAULT_STEPS})")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: 32 for diffusion, 64 for the classifier)")
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate of a diffusion model (default: {DEFAULT_LR})")
    p.add_argument("--per-class", type=int, default=512, help="training crops per class")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parser().parse_args(argv)
    from tome_tools.console import quiet_known_notices

    quiet_known_notices()
    import torch

    from tome_tools import diffusers_trained as trained

    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or DEFAULT_STEPS[args.kind]
    if steps < 1:
        raise SystemExit(f"--steps must be at least 1, got {steps}")
    if args.kind == "classifier":
        record = trained.train_classifier(args.out, steps=steps, batch=args.batch or 64, seed=args.seed, per_class=args.per_class)
        print(f"held-out accuracy on real crops: {record['held_out_accuracy']:.3f}")
        return record
    return trained.train_diffusion(
        args.kind, args.out, steps=steps, batch=args.batch or 32, seed=args.seed,
        per_class=args.per_class, lr=args.lr or DEFAULT_LR[args.kind],
    )


if __name__ == "__main__":
    main()
