"""The README's JAX snippet runs as written and does what its comments say."""

from __future__ import annotations

import numpy as np


def test_quick_start_snippet_patches_a_module_with_the_same_params(readme_code):
    namespace: dict = {}
    exec(compile(readme_code("Quick start: JAX / Flax diffusers"), "README.md", "exec"), namespace)
    unet, params, out = namespace["unet"], namespace["params"], namespace["out"]
    sample, context = namespace["sample"], namespace["context"]
    jax, jnp = namespace["jax"], namespace["jnp"]
    # jitted: an eager call compiles every op separately (tens of seconds on a UNet)
    plain = jax.jit(lambda p: unet.apply({"params": p}, sample, jnp.array([500, 500]), context).sample)(params)
    assert out.shape == plain.shape == (2, 4, 16, 16)
    assert np.isfinite(np.asarray(out)).all() and not np.allclose(np.asarray(out), np.asarray(plain))
