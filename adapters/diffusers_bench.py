"""The torch side of ``python -m tome_core.bench``: a diffusers UNet, its inputs, and each method's patch."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Dict, Iterator, List

import numpy as np
import torch
from diffusers import DDIMScheduler, UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock

import tome_core.torch as tome
from tome_core.adapters.diffusers import finest_level
from tome_core.adapters.diffusers_models import build_unet
from tome_core.bench import image_like_latents, noised, peak_memory_in_fresh_process, serve_peak_request
from tome_core.config import ToMeConfig
from tome_core.levels import downsample_factor

try:
    import tomesd
except ImportError:  # the peer is optional
    tomesd = None

MID_TIMESTEP = 500


def load_unet(args: Any) -> UNet2DConditionModel:
    if not args.model:
        return build_unet(args.preset)
    try:
        return UNet2DConditionModel.from_pretrained(args.model, subfolder="unet", local_files_only=True).eval()
    except (OSError, EnvironmentError):
        return UNet2DConditionModel.from_pretrained(args.model, local_files_only=True).eval()


class Runner:
    """One UNet and fixed inputs; ``method(name, ratio)`` patches it for one of the bench's methods."""

    def __init__(self, args: Any):
        if args.threads:
            torch.set_num_threads(args.threads)
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
        self.sample_in = torch.from_numpy(noised(clean, noise, alpha_bar))
        self.noise = torch.from_numpy(noise)
        generator = torch.Generator().manual_seed(2)
        self.text = torch.randn(args.batch, 77, config.cross_attention_dim, generator=generator)
        self.added = None
        if config.addition_embed_type == "text_time":
            pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            self.added = {
                "text_embeds": torch.randn(args.batch, pooled, generator=generator),
                "time_ids": torch.tensor([[latent * 8, latent * 8, 0, 0, latent * 8, latent * 8]] * args.batch, dtype=torch.float32),
            }
        self.has_peer = tomesd is not None
        self.description = f"{args.model or args.preset} {args.resolution}px batch {args.batch}"

    # -- methods ---------------------------------------------------------------------------------------
    def _max_downsample(self) -> int:
        """The level bound 'ours' resolves to; the peer and the oracle merge the same levels."""
        chosen = self.options.get("max_downsample")
        return chosen if chosen is not None else finest_level(self.unet)

    @contextlib.contextmanager
    def method(self, name: str, ratio: float) -> Iterator[None]:
        handles: List[Any] = []
        if name.startswith("ours"):
            tome.patch(self.unet, **self.options_for(name, ratio))
        elif name == "peer":
            tomesd.apply_patch(self.unet, ratio=ratio, max_downsample=self._max_downsample(), **self._peer_options())
        elif name == "oracle":
            handles = self._oracle(ratio)
        try:
            yield
        finally:
            if name.startswith("ours"):
                tome.remove(self.unet)
            elif name == "peer":
                tomesd.remove_patch(self.unet)
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
        """Hooks that drop and restore the same token counts as ToMe by slicing: free token reduction."""
        config = ToMeConfig.from_options(self.options)
        max_downsample = self._max_downsample()
        sublayers = [name for name, on in (("attn1", config.merge_attn), ("attn2", config.merge_crossattn), ("ff", config.merge_mlp)) if on]
        handles = []

        def drop(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            tokens = x.shape[1]
            if downsample_factor(self.latent_hw, tokens) > max_downsample:
                return None
            module._oracle_tokens = tokens
            kept = x[:, : tokens - int(tokens * ratio)]
            return ((kept,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": kept})

        def restore(module, args, kwargs, output):
            tokens = module.__dict__.pop("_oracle_tokens", None)
            if tokens is None:
                return None
            return output[:, torch.arange(tokens) % output.shape[1]]

        for block in self.unet.modules():
            if isinstance(block, BasicTransformerBlock):
                for name in sublayers:
                    target = getattr(block, name, None)
                    if target is not None:
                        handles.append(target.register_forward_pre_hook(drop, with_kwargs=True))
                        handles.append(target.register_forward_hook(restore, with_kwargs=True))
        return handles

    def note(self, name: str) -> str:
        if name == "peer":
            return f"tomesd {getattr(tomesd, '__version__', '0.1.3')}" if self.has_peer else "tomesd is not installed"
        return ""

    # -- calls -----------------------------------------------------------------------------------------
    def _unet(self, sample: torch.Tensor, timestep: Any) -> torch.Tensor:
        with torch.no_grad():
            return self.unet(sample, timestep, self.text, added_cond_kwargs=self.added).sample

    def call(self) -> torch.Tensor:
        return self._unet(self.sample_in, MID_TIMESTEP)

    def output(self, name: str, ratio: float) -> np.ndarray:
        with self.method(name, ratio):
            return self.call().numpy()

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
        return peak_memory_in_fresh_process("tome_core.adapters.diffusers_bench", self.args, name, ratio)


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

    times: Dict[str, List[float]] = {"ours": [], "tomesd": []}
    with torch.no_grad():
        for fn in (ours, theirs, ours, theirs):
            fn()
        for _ in range(repeats):
            for name, fn in (("ours", ours), ("tomesd", theirs)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        same = torch.allclose(ours(), theirs(), rtol=1e-5, atol=1e-6)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "shape": [batch, height * width, channels],
        "median_ms": {k: v * 1000 for k, v in medians.items()},
        "time_ratio": medians["ours"] / medians["tomesd"],
        "ops": {"ours": count_ops(ours), "tomesd": count_ops(theirs)},
        "identical_outputs": bool(same),
    }


if __name__ == "__main__":
    serve_peak_request(Runner)
