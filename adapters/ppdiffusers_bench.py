"""The paddle side of ``python -m tome_core.bench``: a ppdiffusers UNet, its inputs, and each method's patch.

The twin of :mod:`tome_core.adapters.diffusers_bench`; the peer is ppdiffusers' built-in ToMe (its port of
tomesd, kept reachable as :data:`tome_core.paddle.PPDIFFUSERS_APPLY_TOME`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Dict, Iterator, List

import numpy as np
import paddle
from ppdiffusers import DDIMScheduler, UNet2DConditionModel
from ppdiffusers.models.attention import BasicTransformerBlock
from ppdiffusers.patches import tomesd_patch_utils

import tome_core.paddle as tome
from tome_core.adapters.ppdiffusers import _finest_level
from tome_core.adapters.ppdiffusers_models import build_unet
from tome_core.bench import image_like_latents, noised, peak_memory_in_fresh_process, serve_peak_request
from tome_core.config import ToMeConfig
from tome_core.levels import downsample_factor

MID_TIMESTEP = 500


def load_unet(args: Any) -> UNet2DConditionModel:
    if not args.model:
        return build_unet(args.preset)
    try:
        unet = UNet2DConditionModel.from_pretrained(args.model, subfolder="unet")
    except (OSError, EnvironmentError, ValueError):
        unet = UNet2DConditionModel.from_pretrained(args.model)
    unet.eval()
    return unet


def _set_threads(threads: int) -> None:
    try:
        from paddle.base import core

        core.set_num_threads(threads)
    except (ImportError, AttributeError):  # older paddle: OMP_NUM_THREADS before start-up is the way
        pass


class Runner:
    """One UNet and fixed inputs; ``method(name, ratio)`` patches it for one of the bench's methods."""

    def __init__(self, args: Any):
        if getattr(args, "threads", None):
            _set_threads(args.threads)
        self.args = args
        self.options = dict(getattr(args, "options", {}))
        args.variants = getattr(args, "variants", {})
        self.unet = load_unet(args)
        config = self.unet.config
        latent = args.resolution // 8
        self.latent_hw = (latent, latent)
        self.scheduler = DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
        alpha_bar = float(self.scheduler.alphas_cumprod[MID_TIMESTEP])
        shape = (args.batch, config.in_channels, latent, latent)
        if getattr(args, "latents", "image") == "image":
            clean = image_like_latents(*shape, seed=0)
        else:
            clean = np.random.default_rng(0).standard_normal(shape).astype("float32")
        noise = np.random.default_rng(1).standard_normal(shape).astype("float32")
        self.sample_in = paddle.to_tensor(noised(clean, noise, alpha_bar))
        self.noise = paddle.to_tensor(noise)
        self.timestep = paddle.to_tensor(MID_TIMESTEP)
        rng = np.random.default_rng(2)  # seeded text embeddings (numpy: paddle's global generator stays untouched)
        self.text = paddle.to_tensor(rng.standard_normal((args.batch, 77, config.cross_attention_dim)).astype("float32"))
        self.added = None
        if config.addition_embed_type == "text_time":
            pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            self.added = {
                "text_embeds": paddle.to_tensor(rng.standard_normal((args.batch, pooled)).astype("float32")),
                "time_ids": paddle.to_tensor(
                    [[latent * 8, latent * 8, 0, 0, latent * 8, latent * 8]] * args.batch, dtype="float32"
                ),
            }
        self.has_peer = tome.PPDIFFUSERS_APPLY_TOME is not None
        self.description = f"{args.model or args.preset} {args.resolution}px batch {args.batch}"

    # -- methods ---------------------------------------------------------------------------------------
    def _max_downsample(self) -> int:
        """The level bound 'ours' resolves to; the peer and the oracle merge the same levels."""
        chosen = self.options.get("max_downsample")
        return chosen if chosen is not None else _finest_level(self.unet)

    @contextlib.contextmanager
    def method(self, name: str, ratio: float) -> Iterator[None]:
        handles: List[Any] = []
        if name.startswith("ours"):
            tome.patch(self.unet, **self.options_for(name, ratio))
        elif name == "peer":
            tome.remove(self.unet)
            tome.PPDIFFUSERS_APPLY_TOME(self.unet, ratio=ratio, max_downsample=self._max_downsample(), **self._peer_options())
        elif name == "oracle":
            handles = self._oracle(ratio)
        try:
            yield
        finally:
            if name.startswith("ours"):
                tome.remove(self.unet)
            elif name == "peer":
                tome.PPDIFFUSERS_REMOVE_TOME(self.unet)
                tome.remove(self.unet)  # also drops the port's size hook and info, which its own remove leaves
            for handle in handles:
                handle.remove()

    def options_for(self, name: str, ratio: float) -> Dict[str, Any]:
        """ToMe options of method ``ours`` or ``ours:VARIANT``."""
        variant = name.partition(":")[2]
        return {"ratio": ratio, **self.options, **(self.args.variants[variant] if variant else {})}

    def _peer_options(self) -> Dict[str, Any]:
        names = ("sx", "sy", "use_rand", "merge_attn", "merge_crossattn", "merge_mlp")
        return {k: v for k, v in self.options.items() if k in names}

    def _oracle(self, ratio: float) -> List[Any]:
        """Hooks that drop and restore the same token counts as ToMe by slicing: free token reduction.

        ppdiffusers' blocks pass the hidden states to ``attn1`` / ``attn2`` / ``ff`` positionally, so plain
        (positional) paddle hooks see them.
        """
        config = ToMeConfig.from_options(self.options)
        max_downsample = self._max_downsample()
        sublayers = [name for name, on in (("attn1", config.merge_attn), ("attn2", config.merge_crossattn), ("ff", config.merge_mlp)) if on]
        handles = []

        def drop(layer, inputs):
            x = inputs[0]
            tokens = int(x.shape[1])
            if downsample_factor(self.latent_hw, tokens) > max_downsample:
                return None
            layer._oracle_tokens = tokens
            return (x[:, : tokens - int(tokens * ratio)],) + tuple(inputs[1:])

        def restore(layer, inputs, output):
            tokens = layer.__dict__.pop("_oracle_tokens", None)
            if tokens is None:
                return None
            return paddle.index_select(output, paddle.arange(tokens) % int(output.shape[1]), axis=1)

        for block in self.unet.sublayers(include_self=True):
            if isinstance(block, BasicTransformerBlock):
                for name in sublayers:
                    target = getattr(block, name, None)
                    if target is not None:
                        handles.append(target.register_forward_pre_hook(drop))
                        handles.append(target.register_forward_post_hook(restore))
        return handles

    def note(self, name: str) -> str:
        if name == "peer":
            import ppdiffusers

            return f"ppdiffusers {ppdiffusers.__version__} built-in ToMe"
        return ""

    # -- calls -----------------------------------------------------------------------------------------
    def _unet(self, sample: paddle.Tensor, timestep: Any) -> paddle.Tensor:
        with paddle.no_grad():
            return self.unet(sample, timestep, self.text, added_cond_kwargs=self.added).sample

    def call(self) -> np.ndarray:
        # .numpy() waits for the result (a no-op on CPU, a device sync elsewhere), so timing is complete.
        return self._unet(self.sample_in, self.timestep).numpy()

    def output(self, name: str, ratio: float) -> np.ndarray:
        with self.method(name, ratio):
            return self.call()

    def sample(self, name: str, ratio: float, steps: int) -> np.ndarray:
        """A short DDIM loop from fixed noise; the final latents."""
        self.scheduler.set_timesteps(steps)
        latents = self.noise.clone()
        with self.method(name, ratio):
            for t in self.scheduler.timesteps:
                latents = self.scheduler.step(self._unet(latents, t), t, latents).prev_sample
        return latents.numpy()

    def peak_memory_mb(self, name: str, ratio: float) -> float:
        """Extra peak resident memory of one call, measured in a fresh process."""
        return peak_memory_in_fresh_process("tome_core.adapters.ppdiffusers_bench", self.args, name, ratio)


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

    times: Dict[str, List[float]] = {"ours": [], "ppdiffusers": []}
    with paddle.no_grad():
        for fn in (ours, theirs, ours, theirs):
            fn()
        for _ in range(repeats):
            for name, fn in (("ours", ours), ("ppdiffusers", theirs)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        same = np.allclose(ours(), theirs(), rtol=1e-5, atol=1e-6)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "shape": [batch, height * width, channels],
        "median_ms": {k: v * 1000 for k, v in medians.items()},
        "time_ratio": medians["ours"] / medians["ppdiffusers"],
        "ops": None,
        "identical_outputs": bool(same),
    }


if __name__ == "__main__":
    serve_peak_request(Runner)
