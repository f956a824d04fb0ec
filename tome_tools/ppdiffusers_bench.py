"""The paddle side of ``python -m tome_tools.bench``: a ppdiffusers UNet and each method's patch.

Inputs, method dispatch and the sampling loop are :class:`tome_tools.bench_runner.BenchRunner`'s; the peer is
ppdiffusers' built-in ToMe (its port of tomesd, kept reachable as :data:`tome_core.paddle.PPDIFFUSERS_APPLY_TOME`).
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import paddle
from ppdiffusers import DDIMScheduler, UNet2DConditionModel
from ppdiffusers.patches import tomesd_patch_utils

import tome_core.paddle as tome
from tome_core.models import model_tree
from tome_core.adapters.ppdiffusers import FRAMEWORK
from tome_tools.ppdiffusers_models import build_unet
from tome_tools.bench_core import serve_peak_request
from tome_tools.bench_runner import BenchRunner, Undo, median_ms


class Runner(BenchRunner):
    """A ppdiffusers UNet; the peer is ppdiffusers' built-in ToMe.

    Random draws are numpy's (seeded), so paddle's global generator stays untouched.
    """

    has_peer = tome.PPDIFFUSERS_APPLY_TOME is not None
    scheduler_class = DDIMScheduler

    def set_threads(self, threads: int) -> None:
        try:
            from paddle.base import core

            core.set_num_threads(threads)
        except (ImportError, AttributeError):  # older paddle: OMP_NUM_THREADS before start-up is the way
            pass

    def load_unet(self) -> UNet2DConditionModel:
        model = self.args.model
        if not model:
            return build_unet(self.args.preset)
        try:
            unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
        except (OSError, EnvironmentError, ValueError):
            unet = UNet2DConditionModel.from_pretrained(model)
        unet.eval()
        return unet

    def finest_level(self) -> int:
        return model_tree.finest_level(FRAMEWORK, self.unet)

    def to_tensor(self, array: np.ndarray) -> paddle.Tensor:
        return paddle.to_tensor(array)

    def as_timestep(self, timestep: int) -> paddle.Tensor:
        return paddle.to_tensor(timestep)

    def unet_call(self, sample: paddle.Tensor, timestep: Any) -> paddle.Tensor:
        with paddle.no_grad():
            return self.unet(sample, timestep, self.text, added_cond_kwargs=self.added).sample

    def done(self, output: paddle.Tensor) -> np.ndarray:
        # .numpy() waits for the result (a no-op on CPU, a device sync elsewhere), so timing is complete.
        return output.numpy()

    def patch_ours(self, options: Dict[str, Any]) -> Undo:
        tome.patch(self.unet, **options)
        return lambda: tome.remove(self.unet)

    def patch_peer(self, ratio: float, max_downsample: int, options: Dict[str, Any]) -> Undo:
        tome.remove(self.unet)
        tome.PPDIFFUSERS_APPLY_TOME(self.unet, ratio=ratio, max_downsample=max_downsample, **options)

        def undo() -> None:
            tome.PPDIFFUSERS_REMOVE_TOME(self.unet)
            tome.remove(self.unet)  # also drops the port's size hook and info, which its own remove leaves

        return undo

    def framework(self) -> Any:
        return FRAMEWORK

    def peer_note(self) -> str:
        import ppdiffusers

        return f"ppdiffusers {ppdiffusers.__version__} built-in ToMe"


# -- per-block microbenchmark ------------------------------------------------------------------------
def micro(batch: int = 2, height: int = 64, width: int = 64, channels: int = 320, ratio: float = 0.5, repeats: int = 20) -> Dict[str, Any]:
    """One block's match + merge + unmerge (use_rand=False), ours vs ppdiffusers' built-in: medians, equality.

    No op count: paddle has no dispatch-level op counter like torch's ``TorchDispatchMode`` ("ops": null).
    """
    from tome_core import bipartite_match, get_ops, merge, unmerge

    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((batch, height * width, channels)).astype("float32"))
    r = int(height * width * ratio)
    ops = get_ops(x)

    def ours():
        match = bipartite_match(ops, x, height, width, 2, 2, r, None)
        return unmerge(merge(x, match), match).numpy()

    def theirs():
        m, u = tomesd_patch_utils.bipartite_soft_matching_random2d(x, width, height, 2, 2, r, no_rand=True)
        return u(m(x)).numpy()

    with paddle.no_grad():
        medians = median_ms({"ours": ours, "ppdiffusers": theirs}, repeats)
        same = np.allclose(ours(), theirs(), rtol=1e-5, atol=1e-6)
    return {
        "shape": [batch, height * width, channels],
        "median_ms": medians,
        "time_ratio": medians["ours"] / medians["ppdiffusers"],
        "ops": None,
        "identical_outputs": bool(same),
    }


if __name__ == "__main__":
    serve_peak_request(Runner)
