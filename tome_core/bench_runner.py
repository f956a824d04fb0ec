"""The framework-free half of a benchmark runner: inputs, method dispatch, sampling loop, oracle arithmetic.

``python -m tome_core.bench`` drives one runner per framework (``tome_core.adapters.<framework>_bench``).
Everything the frameworks share lives here, written once: the UNet inputs (image-like latents noised to the
mid timestep, seeded text embeddings, SDXL's added conditions), which ToMe options each method uses, the
level bound the peer and the oracle copy from 'ours', the token counts the oracle keeps, and the DDIM loop.
A subclass supplies the framework: building the model, moving numpy arrays in, calling the UNet, and
patching and unpatching each method. No framework is imported here (numpy only).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from tome_core.bench import image_like_latents, noised, peak_memory_in_fresh_process
from tome_core.config import ToMeConfig
from tome_core.levels import downsample_factor

MID_TIMESTEP = 500
# Stable Diffusion's noise schedule; every framework's DDIM scheduler takes these keyword arguments.
DDIM_CONFIG = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
# The ToMe options tomesd and its ports understand: the peer gets these from --option, nothing else.
PEER_OPTIONS = ("sx", "sy", "use_rand", "merge_attn", "merge_crossattn", "merge_mlp")
Undo = Callable[[], None]


def oracle_sublayers(options: Dict[str, Any]) -> List[str]:
    """The transformer-block sub-layers ('attn1', 'attn2', 'ff') ToMe merges with these options."""
    config = ToMeConfig.from_options(options)
    chosen = (("attn1", config.merge_attn), ("attn2", config.merge_crossattn), ("ff", config.merge_mlp))
    return [name for name, on in chosen if on]


def oracle_kept(latent_hw: Tuple[int, int], tokens: int, ratio: float, max_downsample: int) -> Optional[int]:
    """How many of a sub-layer's ``tokens`` the oracle keeps (``None``: its level is not merged).

    ToMe merges ``int(tokens * ratio)`` of them, so the oracle runs the sub-layer on the first
    ``tokens - int(tokens * ratio)`` and restores the rest with the index ``arange(tokens) % kept``.
    """
    if downsample_factor(latent_hw, tokens) > max_downsample:
        return None
    return tokens - int(tokens * ratio)


def median_ms(functions: Dict[str, Callable[[], Any]], repeats: int, warmup: int = 2) -> Dict[str, float]:
    """Median milliseconds of each function, called in turn (A B A B ...) ``repeats`` times after ``warmup``
    untimed rounds (the micro benchmarks' timing)."""
    times: Dict[str, List[float]] = {name: [] for name in functions}
    for round_index in range(warmup + repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def remover(handles: List[Any]) -> Undo:
    """What removes these hook handles (torch's and paddle's both have ``remove()``)."""

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo


class BenchRunner:
    """One UNet and fixed inputs; ``method(name, ratio)`` patches it for one of the bench's methods.

    Methods: ``unpatched``, ``ours`` and ``ours:VARIANT`` (tome_core with the bench's options), ``peer``
    (another ToMe implementation in the same framework) and ``oracle`` (free token reduction). Subclasses
    implement the hooks below; the defaults of :meth:`timesteps` and :meth:`scheduler_step` speak the
    diffusers scheduler API (torch diffusers and ppdiffusers share it).
    """

    has_peer = False
    scheduler_class: Any = None  # the framework's DDIM scheduler, built with DDIM_CONFIG

    def __init__(self, args: Any):
        if getattr(args, "threads", None):
            self.set_threads(args.threads)
        self.args = args
        self.options = dict(getattr(args, "options", {}))
        args.variants = getattr(args, "variants", {})
        self.unet = self.load_unet()
        self.scheduler = self.scheduler_class(**DDIM_CONFIG)
        self.description = f"{args.model or args.preset} {args.resolution}px batch {args.batch}"
        self._build_inputs(self.unet.config)

    def _build_inputs(self, config: Any) -> None:
        """Noised image-like (or noise) latents at the mid timestep, the starting noise of the sampling
        loop, text embeddings and, for SDXL-style UNets, the added text and time conditions."""
        args = self.args
        latent = args.resolution // 8
        self.latent_hw = (latent, latent)
        shape = (args.batch, config.in_channels, latent, latent)
        if getattr(args, "latents", "image") == "image":
            clean = image_like_latents(*shape, seed=0)
        else:
            clean = np.random.default_rng(0).standard_normal(shape).astype("float32")
        noise = np.random.default_rng(1).standard_normal(shape).astype("float32")
        self.sample_in = self.to_tensor(noised(clean, noise, self.alpha_bar(MID_TIMESTEP)))
        self.noise = self.to_tensor(noise)
        self.timestep = self.as_timestep(MID_TIMESTEP)
        draw = self.normal_draws(seed=2)
        self.text = draw((args.batch, 77, config.cross_attention_dim))
        self.added = None
        if config.addition_embed_type == "text_time":
            pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            size = latent * 8
            self.added = {
                "text_embeds": draw((args.batch, pooled)),
                "time_ids": self.to_tensor(np.array([[size, size, 0, 0, size, size]] * args.batch, dtype="float32")),
            }

    # -- framework hooks ---------------------------------------------------------------------------------
    def set_threads(self, threads: int) -> None:
        """Use ``threads`` intra-op threads (``--threads``); called before the model is built."""
        raise NotImplementedError

    def load_unet(self) -> Any:
        """The UNet of ``--model`` (a local folder) or of ``--preset`` (random weights)."""
        raise NotImplementedError

    def finest_level(self) -> int:
        """The finest downsample level with attention, as 'ours' resolves ``max_downsample=None``."""
        raise NotImplementedError

    def to_tensor(self, array: np.ndarray) -> Any:
        """A numpy array as the framework's array."""
        raise NotImplementedError

    def as_timestep(self, timestep: int) -> Any:
        """The UNet's timestep argument for the mid-timestep call (a Python int unless overridden)."""
        return timestep

    def normal_draws(self, seed: int) -> Callable[[Tuple[int, ...]], Any]:
        """A function drawing float32 standard normals of a given shape, in sequence from ``seed``."""
        rng = np.random.default_rng(seed)
        return lambda shape: self.to_tensor(rng.standard_normal(shape).astype("float32"))

    def unet_call(self, sample: Any, timestep: Any) -> Any:
        """The UNet's output (``.sample``) for ``sample`` at ``timestep``, with the current method."""
        raise NotImplementedError

    def done(self, output: Any) -> Any:
        """``output``, computed to the end (the timed part of a call ends here)."""
        return output

    def alpha_bar(self, timestep: int) -> float:
        """The scheduler's cumulative alpha at ``timestep``."""
        return float(self.scheduler.alphas_cumprod[timestep])

    def timesteps(self, steps: int) -> Iterable[Any]:
        """The timesteps of a ``steps``-step DDIM loop."""
        self.scheduler.set_timesteps(steps)
        return self.scheduler.timesteps

    def scheduler_step(self, model_output: Any, timestep: Any, latents: Any) -> Any:
        """One DDIM step: the latents at the previous timestep."""
        return self.scheduler.step(model_output, timestep, latents).prev_sample

    def patch_ours(self, options: Dict[str, Any]) -> Undo:
        """Patch the UNet with tome_core and these options; returns what unpatches it."""
        raise NotImplementedError

    def patch_peer(self, ratio: float, max_downsample: int, options: Dict[str, Any]) -> Undo:
        """Patch the UNet with the peer implementation; returns what unpatches it."""
        raise ValueError(f"no peer to run: {self.peer_note()}")

    def install_oracle(self, ratio: float, max_downsample: int, sublayers: List[str]) -> Undo:
        """Make ``sublayers`` of every transformer block at levels ``<= max_downsample`` run on the first
        :func:`oracle_kept` tokens and restore the rest by index; returns what removes that."""
        raise NotImplementedError

    def peer_note(self) -> str:
        """What the peer is, or why there is none."""
        return ""

    # -- methods -------------------------------------------------------------------------------------------
    def max_downsample(self) -> int:
        """The level bound 'ours' resolves to; the peer and the oracle merge the same levels."""
        chosen = self.options.get("max_downsample")
        return chosen if chosen is not None else self.finest_level()

    def options_for(self, name: str, ratio: float) -> Dict[str, Any]:
        """ToMe options of method ``ours`` or ``ours:VARIANT``."""
        variant = name.partition(":")[2]
        return {"ratio": ratio, **self.options, **(self.args.variants[variant] if variant else {})}

    def peer_options(self) -> Dict[str, Any]:
        """The bench's options the peer understands."""
        return {k: v for k, v in self.options.items() if k in PEER_OPTIONS}

    def _apply(self, name: str, ratio: float) -> Undo:
        if name.startswith("ours"):
            return self.patch_ours(self.options_for(name, ratio))
        if name == "peer":
            return self.patch_peer(ratio, self.max_downsample(), self.peer_options())
        if name == "oracle":
            return self.install_oracle(ratio, self.max_downsample(), oracle_sublayers(self.options))
        if name != "unpatched":
            raise ValueError(f"unknown bench method {name!r}")
        return lambda: None

    @contextlib.contextmanager
    def method(self, name: str, ratio: float) -> Iterator[None]:
        """The UNet patched for method ``name`` at ``ratio`` inside the block, unpatched after it."""
        undo = self._apply(name, ratio)
        try:
            yield
        finally:
            undo()

    def note(self, name: str) -> str:
        return self.peer_note() if name == "peer" else ""

    # -- calls ---------------------------------------------------------------------------------------------
    def call(self) -> Any:
        """One UNet call on the fixed inputs at the mid timestep: what the bench times."""
        return self.done(self.unet_call(self.sample_in, self.timestep))

    def output(self, name: str, ratio: float) -> np.ndarray:
        """Method ``name``'s output of :meth:`call`, as numpy."""
        with self.method(name, ratio):
            return np.asarray(self.call())

    def sample(self, name: str, ratio: float, steps: int) -> np.ndarray:
        """A short DDIM loop from fixed noise; the final latents."""
        latents = self.noise
        with self.method(name, ratio):
            for t in self.timesteps(steps):
                latents = self.scheduler_step(self.unet_call(latents, t), t, latents)
        return np.asarray(latents)

    def peak_memory_mb(self, name: str, ratio: float) -> float:
        """Extra peak resident memory of one call, measured in a fresh process."""
        return peak_memory_in_fresh_process(type(self).__module__, self.args, name, ratio)
