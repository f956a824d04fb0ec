"""The README's PaddlePaddle snippet runs as written and does what its comments say, as a user runs it: from a
directory outside the clone, with the library and ppdiffusers alone (``tome_tools`` cannot be imported there). The
pipeline it loads by id is a tiny stand-in with random weights, saved by the test under that id in the working
directory, where ``from_pretrained`` reads a local folder of that name first."""

from __future__ import annotations

import importlib
import pathlib
import sys

import pytest

from tome_tools.ppdiffusers_models import build_pipeline

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_start_snippet_patches_and_restores_the_pipeline(readme_code, tmp_path, monkeypatch):
    build_pipeline("sd").save_pretrained(str(tmp_path / "runwayml/stable-diffusion-v1-5"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and pathlib.Path(p).resolve() != ROOT])
    for name in [m for m in sys.modules if m == "tome_tools" or m.startswith("tome_tools.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tome_tools")
    namespace: dict = {}
    exec(compile(readme_code("Quick start: PaddlePaddle / ppdiffusers"), "README.md", "exec"), namespace)
    pipe, image, tome = namespace["pipe"], namespace["image"], namespace["tome"]
    assert image.size == (64, 64)
    assert tome.patched_models(pipe) == []  # removed again
    pipe.apply_tome(ratio=0.5)
    [(model, state)] = tome.patched_models(pipe)
    assert model is pipe.unet and state.config.ratio == 0.5
