"""Shared test fixtures. TOME_TEST_BACKENDS (comma-separated) names the array backends the core tests run on;
a named backend that cannot be loaded is a failure, not a skip."""

from __future__ import annotations

import os
import pathlib
import re

import numpy as np
import pytest

from tome_core import load_backend

BACKENDS = [b for b in os.environ.get("TOME_TEST_BACKENDS", "numpy").split(",") if b]


class Converter:
    """Moves numpy arrays into one backend's arrays and back."""

    def __init__(self, name: str):
        self.name = name
        self.ops = load_backend(name)

    def asarray(self, a: np.ndarray):
        if self.name == "numpy":
            return a
        if self.name == "torch":
            import torch

            return torch.from_numpy(np.ascontiguousarray(a))
        if self.name == "paddle":
            import paddle

            return paddle.to_tensor(a)
        if self.name == "jax":
            import jax.numpy as jnp

            return jnp.asarray(a)
        raise AssertionError(self.name)

    def numpy(self, x) -> np.ndarray:
        return np.asarray(x) if self.name != "torch" else x.detach().cpu().numpy()


@pytest.fixture(params=BACKENDS, scope="session")
def xp(request) -> Converter:
    return Converter(request.param)


# Bad options and the error every entry point of every backend must raise (argument, value, what is allowed).
BAD_OPTIONS = [
    ({"ratio": 1.0}, ValueError, r"ratio must be in \[0, 1\), got 1.0"),
    ({"ratio": -0.1}, ValueError, r"ratio must be in \[0, 1\), got -0.1"),
    ({"ratio": "0.5"}, TypeError, r"ratio must be a float in \[0, 1\), got '0.5'"),
    ({"ratio": 0.6, "sx": 1, "sy": 2}, ValueError, r"ratio=0.6 cannot be reached with sx=1, sy=2.* = 0.5"),
    ({"sx": 0}, ValueError, "sx must be an int >= 1, got 0"),
    ({"sy": 2.0}, TypeError, "sy must be an int >= 1, got 2.0"),
    ({"max_downsample": 16}, ValueError, "max_downsample must be one of None, 1, 2, 4, 8, got 16"),
    ({"max_downsample": True}, ValueError, "max_downsample must be one of None, 1, 2, 4, 8, got True"),
    ({"merge_mlp": "yes"}, TypeError, "merge_mlp must be True or False, got 'yes'"),
    ({"proportional_attn": 1}, TypeError, "proportional_attn must be True or False, got 1"),
    ({"seed": -1}, ValueError, "seed must be an int >= 0, got -1"),
    ({"mode": "fast"}, ValueError, "mode must be one of 'auto', 'tokens', 'kv', 'queries', got 'fast'"),
    ({"mode": "auto", "ratio": 0.5}, ValueError, "mode='auto' chooses the arrangement, ratio and cells by the latent size; leave out ratio"),
    ({"matching": "cells"}, ValueError, "matching must be one of 'similarity', 'cell', got 'cells'"),
    ({"mode": "kv", "merge_attn": False}, ValueError, "mode='kv' arranges self-attention, but merge_attn=False"),
    ({"matching": "cell", "ratio": 0.5}, ValueError, r"ratio=0.5 contradicts matching='cell' with 2x2 cells.* 0.75"),
    ({"matching": "cell", "level_ratios": {1: 0.5}}, ValueError, "level_ratios cannot be combined with matching='cell'"),
    ({"level_cells": {1: 0}}, ValueError, r"level_cells\[1\] must be an int >= 1, got 0"),
    ({"frames_per_chunk": 0}, ValueError, "frames_per_chunk must be an int >= 1, got 0"),
    ({"frame_ratio": 0.5}, ValueError, r"frame_ratio=0.5 merges across frames, which needs frames_per_chunk > 1"),
    ({"frames_per_chunk": 2, "frame_ratio": 1.5}, ValueError, r"frame_ratio must be in \[0, 1\], got 1.5"),
    ({"frames_per_chunk": 2, "mode": "kv"}, ValueError, "frames_per_chunk=2 cannot be combined with mode='kv'"),
    ({"rato": 0.5}, TypeError, r"unknown ToMe option\(s\) rato; valid options are ratio, max_downsample"),
]


@pytest.fixture(params=BAD_OPTIONS, ids=lambda case: ",".join(f"{k}={v!r}" for k, v in case[0].items()))
def bad_option(request):
    """``(options, error class, message pattern)`` of one bad option set."""
    return request.param


# Options that merge nothing on an SD-shaped UNet, and the reason the warning must give.
NOTHING_MERGES = [
    ({"merge_attn": False}, "merge_attn, merge_crossattn and merge_mlp are all False"),
    ({"attn_ratio": 0.0}, r"ratio=0.5 \(and no sub-layer or level ratio above 0\)"),
    # max_downsample=None merges only the finest attention level (1 here): other levels' ratios are moot.
    ({"level_ratios": {1: 0.0}}, r"ratio=0.5 \(and no sub-layer or level ratio above 0\)"),
    ({"ratio": 0.0, "level_ratios": {2: 0.5}}, r"ratio=0.0 \(and no sub-layer or level ratio above 0\)"),
]


@pytest.fixture(params=NOTHING_MERGES, ids=lambda case: ",".join(f"{k}={v!r}" for k, v in case[0].items()))
def nothing_merges(request):
    """``(options, reason pattern)`` of a patch that merges no token on an SD-shaped UNet."""
    return request.param


@pytest.fixture(scope="session")
def readme_code():
    """``readme_code(title)``: the python code blocks of the README section ``## title``, joined."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()

    def code(title: str) -> str:
        section = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
        return "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S))

    return code


class ComposeMatrix:
    """The set-up of a "works with" matrix (tests/*/test_compose.py), the same on every backend: a fresh
    pipeline of ``kind`` with feature ``name`` and ToMe (ratio 0.5) in either order, and each case's references.

    ``features[name](pipe)`` sets the feature up and returns (the pipeline the user then holds, its seeded call).
    """

    ORDERS = ("feature_then_patch", "patch_then_feature")

    def __init__(self, build_pipeline, patch, features):
        self.build_pipeline = build_pipeline
        self.patch = patch
        self.features = features
        self.cache = {}

    def set_up(self, kind: str, name: str, order: str):
        """(what the user holds, its seeded call) with the feature and ToMe set up in ``order``."""
        pipe = self.build_pipeline(kind)
        if order == "feature_then_patch":
            target, run = self.features[name](pipe)
            self.patch(target, ratio=0.5)
        else:
            self.patch(pipe, ratio=0.5)
            target, run = self.features[name](pipe)
        return target, run

    def reference(self, kind: str, name: str):
        """Outputs of the feature alone (never patched) and of the feature then ToMe, on fresh pipelines,
        computed once for both orders' tests: ``{"alone": ..., "with_tome": ...}``."""
        if (kind, name) not in self.cache:
            _, run = self.features[name](self.build_pipeline(kind))
            _, run_both = self.set_up(kind, name, "feature_then_patch")
            self.cache[kind, name] = {"alone": run(), "with_tome": run_both()}
        return self.cache[kind, name]


@pytest.fixture(scope="session")
def compose_matrix():
    """:class:`ComposeMatrix`, to build per test module."""
    return ComposeMatrix
