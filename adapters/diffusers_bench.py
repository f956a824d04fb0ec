"""The torch side of ``python -m tome_core.bench``: a diffusers UNet and each method's patch.

Inputs, method dispatch and the sampling loop are :class:`tome_core.bench_runner.BenchRunner`'s; the peer is
tomesd (when installed).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch
from diffusers import DDIMScheduler, UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock

import tome_core.torch as tome
from tome_core.adapters.diffusers import finest_level
from tome_core.adapters.diffusers_models import build_unet
from tome_core.bench import serve_peak_request
from tome_core.bench_runner import BenchRunner, Undo, median_ms, oracle_kept, remover

try:
    import tomesd
except ImportError:  # the peer is optional
    tomesd = None


class Runner(BenchRunner):
    """A diffusers UNet; the peer is tomesd (when installed), the oracle slices through forward hooks."""

    has_peer = tomesd is not None
    scheduler_class = DDIMScheduler

    def set_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)

    def load_unet(self) -> UNet2DConditionModel:
        model = self.args.model
        if not model:
            return build_unet(self.args.preset)
        try:
            return UNet2DConditionModel.from_pretrained(model, subfolder="unet", local_files_only=True).eval()
        except (OSError, EnvironmentError):
            return UNet2DConditionModel.from_pretrained(model, local_files_only=True).eval()

    def finest_level(self) -> int:
        return finest_level(self.unet)

    def to_tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array)

    def normal_draws(self, seed: int) -> Callable[[Tuple[int, ...]], torch.Tensor]:
        """Drawn by torch's generator (the inputs the README's measured tables came from)."""
        generator = torch.Generator().manual_seed(seed)
        return lambda shape: torch.randn(*shape, generator=generator)

    def unet_call(self, sample: torch.Tensor, timestep: Any) -> torch.Tensor:
        with torch.no_grad():
            return self.unet(sample, timestep, self.text, added_cond_kwargs=self.added).sample

    def patch_ours(self, options: Dict[str, Any]) -> Undo:
        tome.patch(self.unet, **options)
        return lambda: tome.remove(self.unet)

    def patch_peer(self, ratio: float, max_downsample: int, options: Dict[str, Any]) -> Undo:
        tomesd.apply_patch(self.unet, ratio=ratio, max_downsample=max_downsample, **options)
        return lambda: tomesd.remove_patch(self.unet)

    def install_oracle(self, ratio: float, max_downsample: int, sublayers: List[str]) -> Undo:
        """Forward hooks (keyword-aware) on each block's sub-layers: slice the input, index the output."""

        def drop(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            kept = oracle_kept(self.latent_hw, x.shape[1], ratio, max_downsample)
            if kept is None:
                return None
            module._oracle_tokens = x.shape[1]
            if args:
                return (x[:, :kept],) + tuple(args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x[:, :kept]}

        def restore(module, args, kwargs, output):
            tokens = module.__dict__.pop("_oracle_tokens", None)
            if tokens is None:
                return None
            return output[:, torch.arange(tokens) % output.shape[1]]

        handles = []
        for block in self.unet.modules():
            if isinstance(block, BasicTransformerBlock):
                for name in sublayers:
                    target = getattr(block, name, None)
                    if target is not None:
                        handles.append(target.register_forward_pre_hook(drop, with_kwargs=True))
                        handles.append(target.register_forward_hook(restore, with_kwargs=True))
        return remover(handles)

    def peer_note(self) -> str:
        return f"tomesd {getattr(tomesd, '__version__', '0.1.3')}" if self.has_peer else "tomesd is not installed"


# -- per-block microbenchmark ------------------------------------------------------------------------
def count_ops(fn) -> int:
    """Number of aten operations ``fn`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.calls += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Counter():
        fn()
    return Counter.calls


def micro(batch: int = 2, height: int = 64, width: int = 64, channels: int = 320, ratio: float = 0.5, repeats: int = 20) -> Dict[str, Any]:
    """One block's match + merge + unmerge (use_rand=False), ours vs tomesd: medians, op counts, equality."""
    from tome_core import bipartite_match, get_ops, merge, unmerge

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, height * width, channels, generator=generator)
    r = int(height * width * ratio)
    ops = get_ops(x)

    def ours():
        match = bipartite_match(ops, x, height, width, 2, 2, r, None)
        return unmerge(merge(x, match), match)

    def theirs():
        m, u = tomesd.merge.bipartite_soft_matching_random2d(x, width, height, 2, 2, r, no_rand=True)
        return u(m(x))

    with torch.no_grad():
        medians = median_ms({"ours": ours, "tomesd": theirs}, repeats)
        same = torch.allclose(ours(), theirs(), rtol=1e-5, atol=1e-6)
    return {
        "shape": [batch, height * width, channels],
        "median_ms": medians,
        "time_ratio": medians["ours"] / medians["tomesd"],
        "ops": {"ours": count_ops(ours), "tomesd": count_ops(theirs)},
        "identical_outputs": bool(same),
    }


if __name__ == "__main__":
    serve_peak_request(Runner)
