"""The jax side of ``python -m tome_tools.bench``: a Flax diffusers UNet (diffusers 0.39) and each method's patch.

Every UNet call is compiled by ``jax.jit`` ahead of time, when a method is entered, so a timed call never
includes a compilation, whatever ``--warmup`` says; a call is timed until ``block_until_ready``. Flax
modules are immutable: 'ours' runs the module ``tome_core.jax.patch`` returns, and the oracle is a
:func:`flax.linen.intercept_methods` interceptor entered inside the traced call. No other ToMe
implementation exists for Flax, so there is no peer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import diffusers
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from diffusers import FlaxDDIMScheduler, FlaxUNet2DConditionModel
from diffusers.models.attention_flax import FlaxBasicTransformerBlock

import tome_core.jax as tome
from tome_core.adapters.flax import finest_level, module_fields
from tome_tools.flax_models import build_unet
from tome_tools.bench_core import serve_peak_request
from tome_core.config import ToMeConfig
from tome_core.models.levels import block_grid, downsample_factor, level_grid
from tome_tools.bench_runner import BenchRunner, Undo, median_ms

diffusers.utils.logging.set_verbosity_error()  # diffusers 0.39 warns from every Flax module setup


def set_xla_threads(threads: int) -> None:
    """Make XLA's CPU client use ``threads`` threads (``--threads``).

    The client sizes its thread pools from ``PJRT_NPROC`` when jax creates it (at the first array or
    computation); ``XLA_FLAGS``' ``intra_op_parallelism_threads`` no longer changes them. So this works only
    before jax has run anything, and says so otherwise.
    """
    from jax._src import xla_bridge  # jax has no public way to ask whether its backend exists

    wanted = str(threads)
    if xla_bridge.backends_are_initialized() and os.environ.get("PJRT_NPROC") != wanted:
        raise RuntimeError(
            f"--threads {threads}: jax's CPU backend is already running, with its thread count fixed at start-up; "
            f"set PJRT_NPROC={threads} in the environment before Python starts instead"
        )
    os.environ["PJRT_NPROC"] = wanted


# A UNet transformer block's sub-layers by the name ToMeConfig gives their kind.
SUBLAYER_KINDS = {"attn1": "attn", "attn2": "crossattn", "ff": "mlp"}


@dataclasses.dataclass(frozen=True)
class OracleCut:
    """What the oracle does to one sub-layer call: the reduced part keeps the first ``kept`` of ``tokens``
    tokens, in ``arrangement`` (ToMeConfig's ``mode``, for self-attention; ``tokens`` elsewhere):

    * ``tokens``: the sub-layer runs on the first ``kept`` tokens, its output restored by the index
      ``arange(tokens) % kept``;
    * ``kv``: self-attention's queries are every token, its keys and values the first ``kept`` (nothing to
      restore);
    * ``queries``: its queries are the first ``kept``, its keys and values every token, its output restored as
      for ``tokens``.
    """

    name: str  # the sub-layer: attn1, attn2, ff (UNets) or a family's child name
    tokens: int
    kept: int
    arrangement: str


class OraclePlan:
    """The token counts 'ours' keeps in a UNet with one configuration, per sub-layer and token count, for the
    :class:`Oracle` (free removal of the same counts; every other framework's oracle is the library's own,
    :func:`tome_tools.oracle.attach_oracle`): similarity matching merges ``int(tokens * ratio)`` (the sub-layer's,
    level's and cell's ratio, at most the sources of the partition), cell matching keeps one token per full
    ``sx x sy`` cell of the level (``level_cells``) plus the leftover rows and columns. ``mode`` decides the
    arrangement of self-attention (``attn1``).
    """

    def __init__(self, config: ToMeConfig, latent_hw: Tuple[int, int], max_downsample: int):
        self.config = config
        self.latent_hw = latent_hw
        self.max_downsample = max_downsample

    @property
    def sublayers(self) -> List[str]:
        """The UNet block sub-layers ('attn1', 'attn2', 'ff') the configuration merges."""
        on = self.config.sublayers
        return [name for name, kind in SUBLAYER_KINDS.items() if on[kind]]

    def arrangement(self, kind: str) -> str:
        return self.config.mode if kind == "attn" else "tokens"

    def kept(self, kind: str, tokens: int) -> Optional[int]:
        """How many of ``tokens`` the oracle keeps in a sub-layer of ``kind`` ('attn', 'crossattn', 'mlp');
        ``None`` when its level is not merged."""
        level = downsample_factor(self.latent_hw, tokens)
        if level > self.max_downsample:
            return None
        try:
            h, w = block_grid(self.latent_hw, level, None, tokens)
        except ValueError:  # not a grid of this latent: no cells, as the partition sees it
            h = w = 0
        config = self.config
        sx, sy = config.cell_at(level)
        cells = (h // sy) * (w // sx)
        if config.matching == "cell":
            return tokens if sx * sy == 1 or cells == 0 else tokens - cells * (sx * sy - 1)
        merged = min(int(tokens * config.ratio_for(kind, level)), tokens - cells)
        return tokens - max(merged, 0)

    def cut(self, name: str, tokens: int) -> Optional[OracleCut]:
        """The cut of UNet sub-layer ``name`` ('attn1', 'attn2', 'ff') on ``tokens`` tokens (``None``: untouched)."""
        kind = SUBLAYER_KINDS[name]
        if not self.config.sublayers[kind]:
            return None
        kept = self.kept(kind, tokens)
        if kept is None or kept == tokens:
            return None
        return OracleCut(name, tokens, kept, self.arrangement(kind))

    def table(self) -> Tuple[OracleCut, ...]:
        """Every cut at the token counts of this latent's levels 1, 2, 4, 8: a hashable plan (Flax's oracle is
        a static argument of a jitted call)."""
        cuts = []
        for level in (1, 2, 4, 8):
            h, w = level_grid(self.latent_hw, level)
            for name in self.sublayers:
                cut = self.cut(name, h * w)
                if cut is not None:
                    cuts.append(cut)
        return tuple(cuts)


@dataclasses.dataclass(frozen=True)
class Oracle:
    """A Flax interceptor making the sub-layers of every transformer block that the plan cuts run on their
    first ``kept`` tokens, the rest restored by index; self-attention in ``kv`` mode gets the first ``kept`` as
    keys/values (its ``context``) and every query, in ``queries`` mode the first ``kept`` as queries and every
    token as context (:class:`OracleCut`). Frozen (hashable), as a static argument of
    the jitted call must be: it holds the plan's table of cuts, one per sub-layer and token count.

    The other frameworks' oracle is the library's own hooks (:func:`tome_tools.oracle.attach_oracle`). Flax's
    hooks live inside a patched module's traced call, built from its ``tome`` config field
    (:mod:`tome_core.adapters.flax`), which has no room for an oracle switch without adding one to the public
    module; so the Flax bench keeps this table (UNets only, where its counts are :class:`OraclePlan`'s)."""

    cuts: Tuple[OracleCut, ...]

    def __call__(self, next_fun: Callable, args: Tuple, kwargs: Dict[str, Any], context: Any) -> Any:
        module = context.module
        if context.method_name != "__call__" or not isinstance(module.parent, FlaxBasicTransformerBlock):
            return next_fun(*args, **kwargs)
        hidden_states = args[0]  # FlaxBasicTransformerBlock passes it positionally
        tokens = hidden_states.shape[1]
        cut = next((c for c in self.cuts if c.name == module.name and c.tokens == tokens), None)
        if cut is None:
            return next_fun(*args, **kwargs)
        kept = cut.kept
        if cut.arrangement == "kv":  # attn1 is called without a context: its keys come from hidden_states
            return next_fun(hidden_states, hidden_states[:, :kept], *args[2:], **kwargs)
        if cut.arrangement == "queries":
            out = next_fun(hidden_states[:, :kept], hidden_states, *args[2:], **kwargs)
        else:
            out = next_fun(hidden_states[:, :kept], *args[1:], **kwargs)
        return jnp.take(out, jnp.arange(tokens) % kept, axis=1)


def unet_output(model: nn.Module, interceptor: Optional[Oracle], params: Any, sample: jax.Array,
                timestep: jax.Array, text: jax.Array, added: Optional[Dict[str, jax.Array]]) -> jax.Array:
    """``model``'s output (``.sample``), with ``interceptor`` active while the call is traced."""
    intercepting = nn.intercept_methods(interceptor) if interceptor is not None else contextlib.nullcontext()
    with intercepting:
        return model.apply({"params": params}, sample, timestep, text, added).sample


_jitted_unet = jax.jit(unet_output, static_argnums=(0, 1))


def hashable(model: nn.Module) -> nn.Module:
    """``model`` rebuilt with its list fields as tuples (see :func:`tome_core.adapters.flax.module_fields`)."""
    return type(model)(**module_fields(model))


class Runner(BenchRunner):
    """A FlaxUNet2DConditionModel and its parameters; ``model`` and ``interceptor`` are what the current
    method runs (``unet`` and ``None`` outside a method)."""

    scheduler_class = FlaxDDIMScheduler

    def __init__(self, args: Any):
        super().__init__(args)
        self._use(self.unet, None)

    def _use(self, model: nn.Module, interceptor: Optional[Oracle]) -> None:
        """Run ``model`` with ``interceptor`` from now on, compiled now (jax keeps the trace and the
        executable per model, interceptor and shapes, so entering a method again takes milliseconds)."""
        self.model, self.interceptor = model, interceptor
        inputs = (self.params, self.sample_in, self.timestep, self.text, self.added)
        self._compiled = _jitted_unet.lower(model, interceptor, *inputs).compile()

    def set_threads(self, threads: int) -> None:
        set_xla_threads(threads)

    def load_unet(self) -> FlaxUNet2DConditionModel:
        """Also sets ``params``."""
        model = self.args.model
        if not model:
            unet, self.params = build_unet(self.args.preset)
            return unet
        try:
            unet, self.params = FlaxUNet2DConditionModel.from_pretrained(model, subfolder="unet", local_files_only=True)
        except (OSError, EnvironmentError):
            unet, self.params = FlaxUNet2DConditionModel.from_pretrained(model, local_files_only=True)
        return hashable(unet)

    def finest_level(self) -> int:
        return finest_level(self.unet)

    def to_tensor(self, array: np.ndarray) -> jax.Array:
        return jnp.asarray(array)

    def as_timestep(self, timestep: Any) -> jax.Array:
        return jnp.asarray(timestep, jnp.int32)

    def unet_call(self, sample: jax.Array, timestep: Any) -> jax.Array:
        return self._compiled(self.params, sample, self.as_timestep(timestep), self.text, self.added)

    def done(self, output: jax.Array) -> jax.Array:
        return output.block_until_ready()

    @functools.cached_property
    def scheduler_state(self) -> Any:
        return self.scheduler.create_state()

    def alpha_bar(self, timestep: int) -> float:
        return float(self.scheduler_state.common.alphas_cumprod[timestep])

    def timesteps(self, steps: int) -> Iterable[jax.Array]:
        """Also keeps the loop's scheduler state for :meth:`scheduler_step`."""
        self._loop_state = self.scheduler.set_timesteps(self.scheduler_state, steps)
        return self._loop_state.timesteps

    def scheduler_step(self, model_output: jax.Array, timestep: Any, latents: jax.Array) -> jax.Array:
        return self.scheduler.step(self._loop_state, model_output, timestep, latents).prev_sample

    def patch_ours(self, options: Dict[str, Any]) -> Undo:
        self._use(tome.patch(self.unet, **options), None)
        return lambda: self._use(tome.remove(self.model), None)

    def install_oracle(self, name: str, ratio: float) -> Undo:
        config = self.config_for(name, ratio)
        self._use(self.unet, Oracle(OraclePlan(config, self.latent_hw, self.max_downsample_of(config)).table()))
        return lambda: self._use(self.unet, None)

    def peer_note(self) -> str:
        return "no other ToMe implementation exists for Flax"


# -- per-block microbenchmark ------------------------------------------------------------------------
def count_ops(fn: Callable, *args: Any) -> int:
    """Number of jax primitives ``fn(*args)`` traces to (the equations of its jaxpr, with calls of nested
    jaxprs such as ``pjit`` counted by their contents)."""

    def count(jaxpr: Any) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            inner = list(_sub_jaxprs(eqn.params))
            total += sum(count(sub) for sub in inner) if inner else 1
        return total

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


def _sub_jaxprs(params: Dict[str, Any]) -> Iterator[Any]:
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns"):
                yield getattr(item, "jaxpr", item)


def micro(batch: int = 2, height: int = 64, width: int = 64, channels: int = 320, ratio: float = 0.5, repeats: int = 20) -> Dict[str, Any]:
    """One block's match + merge + unmerge (use_rand=False), jitted: median time, primitive count, and
    whether it equals the numpy backend's result. No peer exists for Flax ("time_ratio": null)."""
    from tome_core import bipartite_match, get_ops, merge, unmerge

    x = np.random.default_rng(0).standard_normal((batch, height * width, channels)).astype("float32")
    r = int(height * width * ratio)

    def ours(tokens: Any) -> Any:
        match = bipartite_match(get_ops(tokens), tokens, height, width, 2, 2, r, None)
        return unmerge(merge(tokens, match), match)

    x_jax = jnp.asarray(x)
    compiled = jax.jit(ours).lower(x_jax).compile()
    medians = median_ms({"ours": lambda: compiled(x_jax).block_until_ready()}, repeats)
    same = np.allclose(np.asarray(compiled(x_jax)), ours(x), rtol=1e-5, atol=1e-6)
    return {
        "shape": [batch, height * width, channels],
        "median_ms": medians,
        "time_ratio": None,
        "ops": {"ours": count_ops(ours, x_jax)},
        "identical_outputs": bool(same),
        "compared_with": "tome_core's numpy backend (no other ToMe implementation exists for Flax)",
    }


if __name__ == "__main__":
    serve_peak_request(Runner)
