"""The README's JAX snippet runs as written and does what its comments say, as a user runs it: from a directory
outside the clone, with the library and diffusers alone (``tome_tools`` cannot be imported there). The UNet it
loads by id is a tiny stand-in with random parameters, saved by the test under that id in the working directory,
where ``from_pretrained`` reads a local folder of that name first."""

from __future__ import annotations

import importlib
import pathlib
import sys

import numpy as np
import pytest

from tome_tools.flax_models import build_unet

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_start_snippet_patches_a_module_with_the_same_params(readme_code, tmp_path, monkeypatch):
    tiny, tiny_params = build_unet("tiny")
    tiny.save_pretrained(tmp_path / "CompVis/stable-diffusion-v1-4/unet", params=tiny_params)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and pathlib.Path(p).resolve() != ROOT])
    for name in [m for m in sys.modules if m == "tome_tools" or m.startswith("tome_tools.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tome_tools")
    namespace: dict = {}
    exec(compile(readme_code("Quick start: JAX / Flax diffusers"), "README.md", "exec"), namespace)
    unet, params, out = namespace["unet"], namespace["params"], namespace["out"]
    sample, context = namespace["sample"], namespace["context"]
    jax, jnp = namespace["jax"], namespace["jnp"]
    # jitted: an eager call compiles every op separately (tens of seconds on a UNet)
    plain = jax.jit(lambda p: unet.apply({"params": p}, sample, jnp.array([500, 500]), context).sample)(params)
    assert out.shape == plain.shape == (2, 4, 16, 16)
    assert np.isfinite(np.asarray(out)).all() and not np.allclose(np.asarray(out), np.asarray(plain))
