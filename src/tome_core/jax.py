"""ToMe for jax / diffusers' Flax models: ``unet = tome_core.jax.patch(unet, ratio=0.5)``.

Flax modules are immutable: :func:`patch` on a ``FlaxUNet2DConditionModel`` or ``FlaxControlNetModel``
returns a patched module that takes the same parameter tree, and :func:`remove` returns the original.
A Flax pipeline (``FlaxStableDiffusionPipeline``, ``FlaxStableDiffusionControlNetPipeline``) is patched in
place and returned; it recompiles on its next ``jit=True`` call.

    pipe = tome_core.jax.patch(pipe, ratio=0.5, seed=0)
    images = pipe(prompt_ids, params, rng, jit=True).images
    tome_core.jax.remove(pipe)

Options, defaults and errors are those of :class:`tome_core.ToMeConfig`; ``seed`` may also be a
``jax.random`` key. The partition is a hash of (seed, timestep, block), so no key is threaded through the
model and the same seed gives the same output on every run. ``with tome_core.jax.record() as calls:``
collects what each patched call merged while jax traced it.
"""

from __future__ import annotations

from tome_core.adapters.flax import patch as _patch
from tome_core.adapters.flax import block_paths, is_patched, patched_models, record, remove
from tome_core.dropin import ratio_positional

patch = ratio_positional(_patch, "patch", __name__)  # patch(pipe, 0.5) as apply_tome(0.5)
apply_tome = ratio_positional(_patch, "apply_tome", __name__)
remove_tome = remove

__all__ = ["patch", "remove", "apply_tome", "remove_tome", "patched_models", "is_patched", "record", "block_paths"]


def __dir__():  # the public names only, not the imports
    return list(__all__)
