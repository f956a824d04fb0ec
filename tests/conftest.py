"""Shared test fixtures. TOME_TEST_BACKENDS (comma-separated) names the array backends the core tests run on;
a named backend that cannot be loaded is a failure, not a skip."""

from __future__ import annotations

import os
import pathlib
import re
import warnings

import numpy as np
import pytest
from hypothesis import settings

from tome_core import load_backend

BACKENDS = [b for b in os.environ.get("TOME_TEST_BACKENDS", "numpy").split(",") if b]

# CI (noxfile.py) runs the "ci" profile: every property test draws the same examples on every run, so a failure
# there reproduces; anywhere else each run draws new ones, and a failure prints the example that falsified it.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_configure(config):
    config.addinivalue_line("markers", "cost_model: runs with the measured bounds of tome_core.models.cost")


@pytest.fixture(autouse=True)
def merging_always_pays(request, monkeypatch):
    """Tests check what merging does on tiny models, far below the sizes where it pays (tome_core.models.cost), so the
    default merges at every size here; tests marked ``cost_model`` (tests/core/test_cost.py and the checks that
    the default runs small levels unmerged) keep the measured bounds."""
    if request.node.get_closest_marker("cost_model") is None:
        from tome_core.models import cost
        monkeypatch.setattr(cost, "MIN_TOKENS", dict.fromkeys(cost.MIN_TOKENS, 0))


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


def _numpy_partition(case, offsets) -> np.ndarray:
    """Brute-force partition of an ``h x w`` grid (``case`` holds h, w, sx, sy): walk the cells and mark each
    destination (``offsets[i, j]``: its position in cell (i, j); None: the first). ``[h*w]`` booleans."""
    h, w, sx, sy = case["h"], case["w"], case["sx"], case["sy"]
    is_dst = np.zeros((h, w), bool)
    for i in range(h // sy):
        for j in range(w // sx):
            o = 0 if offsets is None else int(offsets[i, j])
            is_dst[i * sy + o // sx, j * sx + o % sx] = True
    return is_dst.reshape(-1)


@pytest.fixture(scope="session")
def numpy_partition():
    """The brute-force partition oracle of the core tests (:func:`_numpy_partition`)."""
    return _numpy_partition


# Bad options and the error every entry point of every backend must raise (argument, value, what is allowed).
BAD_OPTIONS = [
    ({"ratio": 1.0}, ValueError, r"ratio must be in \[0, 0.75\] \(one token per 2x2 cell is kept: at most 1 - 1/\(sx\*sy\)\), got 1.0"),
    ({"ratio": -0.1}, ValueError, r"ratio must be in \[0, 0.75\] .*, got -0.1"),
    ({"ratio": "0.5"}, TypeError, r"ratio must be a float in \[0, 1 - 1/\(sx\*sy\)\], got '0.5'"),
    ({"ratio": 0.6, "sx": 1, "sy": 2}, ValueError, r"ratio=0.6 cannot be reached with sx=1, sy=2.* = 0.5"),
    ({"sx": 0}, ValueError, "sx must be an int >= 1, got 0"),
    ({"sy": 2.0}, TypeError, "sy must be an int >= 1, got 2.0"),
    ({"max_downsample": 16}, ValueError, "max_downsample must be one of None, 1, 2, 4, 8, got 16"),
    ({"max_downsample": True}, ValueError, "max_downsample must be one of None, 1, 2, 4, 8, got True"),
    ({"merge_mlp": "yes"}, TypeError, "merge_mlp must be True or False, got 'yes'"),
    ({"attn_ratio": 0.9}, ValueError, "attn_ratio=0.9 cannot be reached"),
    ({"level_ratios": {3: 0.5}}, ValueError, "level_ratios keys must be levels 1, 2, 4 or 8, got 3"),
    ({"level_ratios": [0.5]}, TypeError, "level_ratios must be a dict"),
    ({"reuse_steps": 0}, ValueError, "reuse_steps must be an int >= 1, got 0"),
    ({"local_window": -1}, ValueError, "local_window must be an int >= 0, got -1"),
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
    # issue 43: an unhashable value named neither the option nor the value ("unhashable type: 'list'")
    ({"prefer": ["speed"]}, TypeError, r"prefer must be one of 'fidelity', 'balance', 'speed' or None, got \['speed'\] \(list\)"),
    ({"rato": 0.5}, TypeError, r"unknown ToMe option\(s\) rato \(did you mean ratio for rato\?\); valid options are ratio, max_downsample"),
    # max_downsample=None merges only the finest attention level (1 on an SD-shaped UNet): another level's
    # ratio can never act (issue 35)
    ({"ratio": 0.0, "level_ratios": {2: 0.5}}, ValueError, r"level_ratios names level 2 \(1/2 scale\), where no block of \w+ merges"),
]


@pytest.fixture(params=BAD_OPTIONS, ids=lambda case: ",".join(f"{k}={v!r}" for k, v in case[0].items()))
def bad_option(request):
    """``(options, error class, message pattern)`` of one bad option set."""
    return request.param


# Options that merge nothing on an SD-shaped UNet, and the reason the warning must give.
NOTHING_MERGES = [
    ({"merge_attn": False}, "merge_attn, merge_crossattn and merge_mlp are all False"),
    # the options that zero every merged block are named (issue 35: not "ratio=0.5")
    ({"attn_ratio": 0.0}, r"attn_ratio=0.0 \(no merged block has a ratio above 0\)"),
    ({"level_ratios": {1: 0.0}}, r"level_ratios\[1\]=0.0 \(no merged block has a ratio above 0\)"),
    ({"ratio": 0.0, "max_downsample": 2, "level_ratios": {2: 0.0}}, r"level_ratios\[2\]=0.0, ratio=0.0 \(no merged"),
]


@pytest.fixture(params=NOTHING_MERGES, ids=lambda case: ",".join(f"{k}={v!r}" for k, v in case[0].items()))
def nothing_merges(request):
    """``(options, reason pattern)`` of a patch that merges no token on an SD-shaped UNet."""
    return request.param


def _check_central_differences(checked, central, rng, atol, directions=None) -> None:
    """Analytic gradients ``checked`` (name -> numpy array) against ``central(shift)``, the central difference of
    the loss along ``shift`` (name -> array of the same shape): on three coordinates of each (its largest
    gradient and two random ones, relative 1e-5, absolute ``atol``), then along one random direction through
    every tensor of ``directions`` (name -> its analytic gradient; default ``checked``), relative 1e-6."""
    for name, gradient in checked.items():
        flat = gradient.reshape(-1)
        coordinates = {int(np.argmax(np.abs(flat))), *rng.choice(flat.size, 2, replace=False).tolist()}
        for index in coordinates:
            unit = np.zeros(flat.size)
            unit[index] = 1.0
            numeric = central({name: unit.reshape(gradient.shape)})
            assert numeric == pytest.approx(flat[index], rel=1e-5, abs=atol), (name, index)
    everything = checked if directions is None else directions
    direction = {name: rng.standard_normal(gradient.shape) for name, gradient in everything.items()}
    expected = sum(float((everything[name] * d).sum()) for name, d in direction.items())
    assert central(direction) == pytest.approx(expected, rel=1e-6)


@pytest.fixture(scope="session")
def central_differences():
    """``central_differences(checked, central, rng, atol, directions=None)``: analytic gradients against central
    differences of the loss, on a few coordinates and along a random direction (paddle and jax training tests)."""
    return _check_central_differences


@pytest.fixture(scope="session")
def readme_code():
    """``readme_code(title)``: the python code blocks of the README section ``## title``, joined."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()

    def code(title: str) -> str:
        section = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
        return "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S))

    return code


@pytest.fixture(scope="session")
def guide_code():
    """``guide_code(page)``: the python code blocks of the guide ``docs/<page>.md``, joined, and its path."""

    def code(page: str):
        path = pathlib.Path(__file__).resolve().parents[1] / "docs" / f"{page}.md"
        return "\n".join(re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)), str(path)

    return code


class ComposeMatrix:
    """The set-up of a "works with" matrix (tests/*/test_compose.py), the same on every backend: a fresh
    pipeline of ``kind`` with feature ``name`` and ToMe (patched with ``options``: ratio 0.5 unless given; ``{}``
    is the default users get from ``patch(pipe)``) in either order, and each case's references.

    ``features[name](pipe)`` sets the feature up and returns (the pipeline the user then holds, its seeded call).
    """

    ORDERS = ("feature_then_patch", "patch_then_feature")

    def __init__(self, build_pipeline, patch, features, options=None):
        self.build_pipeline = build_pipeline
        self.patch = patch
        self.features = features
        self.options = {"ratio": 0.5} if options is None else options
        self.cache = {}

    def set_up(self, kind: str, name: str, order: str):
        """(what the user holds, its seeded call) with the feature and ToMe set up in ``order``."""
        pipe = self.build_pipeline(kind)
        if order == "feature_then_patch":
            target, run = self.features[name](pipe)
            self.patch(target, **self.options)
        else:
            self.patch(pipe, **self.options)
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


def _patch_or_refuse(tome, model, options):
    """The first half of the option-contract property (tests/*/test_contracts.py, issue 35): ``tome.patch(model,
    **options)`` either patches, returning the warnings it gave, or is refused with an error naming one of the
    options given (or what to pass instead: ``mode``, ``proportional_attn``) before anything was patched, then
    returns None."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tome.patch(model, **options)
    except (ValueError, TypeError) as error:
        named = set(options) | {"proportional_attn", "mode"}
        assert any(re.search(rf"\b{name}\b", str(error)) for name in named), (options, str(error))
        assert tome.patched_models(model) == []
        return None
    return [str(w.message) for w in caught]


@pytest.fixture(scope="session")
def patch_or_refuse():
    """:func:`_patch_or_refuse`."""
    return _patch_or_refuse


@pytest.fixture(scope="session")
def compose_matrix():
    """:class:`ComposeMatrix`, to build per test module."""
    return ComposeMatrix


class VideoChecks:
    """What the video UNet tests (tests/*/test_video.py) observe and demand, the same on every backend: the shape
    of the hidden states every attention module (attn1/attn2) receives, unpatched and patched, against the
    counts the grid gives (spatial self-attention merged per frame, temporal attention always the frame count).

    ``tome``: the backend's module (``patch``, ``remove``, ``patched_models``). ``call(model, frames, height,
    width, batch)``: one seeded call of a video UNet. ``modules(model)``: its ``(name, module)`` pairs.
    ``hooked(module)``: whether the module carries any forward hook. ``framework``: the adapter's
    :class:`tome_core.framework.Framework` (``FRAMEWORK``).
    """

    # Where the temporal layers of these UNets live (module names): motion modules (AnimateDiff), temporal
    # transformers (UNet3D), SVD's temporal blocks. Independent of the driver's class table.
    TEMPORAL_NAMES = ("motion_modules", "temp_attentions", "transformer_in", "temporal_transformer_blocks")
    SPATIAL_CONTAINERS = ("Transformer2DModel", "TransformerSpatioTemporalModel")

    def __init__(self, tome, call, modules, hooked, framework):
        self.tome, self.call, self.modules, self.hooked = tome, call, modules, hooked
        self.framework = framework

    @staticmethod
    def pre_hook(module, fn):
        """Register ``fn(shape)``, called with the shape of the hidden states ``module`` receives, after the hooks
        registered before it (ToMe's: it sees merged inputs); returns a handle with ``remove()``. torch and
        paddle register forward pre-hooks alike."""

        def hook(module, args, kwargs):
            fn(tuple((args[0] if args else kwargs["hidden_states"]).shape))

        return module.register_forward_pre_hook(hook, with_kwargs=True)

    @classmethod
    def is_temporal(cls, name: str) -> bool:
        return any(part in cls.TEMPORAL_NAMES for part in name.split("."))

    def record_attention(self, model):
        """``{name: [shape, ...]}`` of the hidden states every attention module receives, and the hook handles."""
        seen, handles = {}, []
        for name, module in self.modules(model):
            if name.rsplit(".", 1)[-1] in ("attn1", "attn2"):
                handles.append(self.pre_hook(module, lambda shape, name=name: seen.setdefault(name, []).append(shape)))
        return seen, handles

    def observe(self, model, ratio, frames, hw, **options):
        """Shapes seen by each attention, unpatched and patched, and the patch's statistics (the model is left
        unpatched); batch 2."""
        plain, handles = self.record_attention(model)
        try:
            self.call(model, frames, hw, hw, 2)
        finally:
            for handle in handles:
                handle.remove()
        self.tome.patch(model, ratio=ratio, **options)
        patched, handles = self.record_attention(model)  # after ToMe's hooks: they see the merged inputs
        try:
            self.call(model, frames, hw, hw, 2)
            stats = dict(self.tome.patched_models(model)[0].state.ledger.stats)
        finally:
            self.tome.remove(model)
            for handle in handles:
                handle.remove()
        return plain, patched, stats

    def check_blocks_found(self, model):
        """The driver finds exactly the spatial BasicTransformerBlocks (down, mid, two up at the attention
        levels), none inside temporal layers; the model is the one to patch; its finest attention level is 1."""
        from tome_core.models.model_tree import blocks_of, find_models, finest_level

        names = {id(m): n for n, m in self.modules(model)}
        found = [names[id(block)] for block, _ in blocks_of(self.framework, model)]
        spatial = [n for n, m in self.modules(model) if type(m).__name__ == "BasicTransformerBlock" and not self.is_temporal(n)]
        assert found == spatial and len(spatial) == 4
        temporal = [n for n, m in self.modules(model) if n.endswith("attn1") and self.is_temporal(n)]
        assert temporal  # the model has temporal attention, and none of it is in a found block
        assert not any(t.startswith(f + ".") for t in temporal for f in found)
        assert finest_level(self.framework, model) == 1
        assert find_models(self.framework, model) == [model]

    def check_finest_level_two(self, model):
        """AnimateDiff on an SDXL-like UNet (no spatial attention at full resolution, motion modules everywhere):
        the finest attention level is 2, so max_downsample=None merges there, 16 frames being 16 tokens there;
        motion modules do not count."""
        from tome_core.models.model_tree import finest_level

        assert finest_level(self.framework, model) == 2
        plain, patched, stats = self.observe(model, 0.5, 16, 8, max_downsample=None)
        assert {level: (s.blocks, s.tokens, s.kept) for level, s in stats.items()} == {2: (4, 16, 8)}
        assert all(plain[name] == patched[name] for name in plain if self.is_temporal(name))

    def check_token_counts(self, model, max_downsample, frames=4, hw=8, ratio=0.5):
        """Spatial self-attention sees N - int(N * ratio) per frame at the merged levels (N from the grid the
        unpatched model gives it); every temporal attention sees exactly the frame count, as unpatched."""
        plain, patched, stats = self.observe(model, ratio, frames, hw, max_downsample=max_downsample)
        merged_levels = {1: hw * hw, 2: (hw // 2) ** 2}
        spatial_level_blocks = {}
        for name, shapes in plain.items():
            assert patched[name][0][0] == shapes[0][0]  # batch dims unchanged
            if self.is_temporal(name):
                assert all(shape[1] == frames for shape in shapes + patched[name]), name
                continue
            tokens = shapes[0][1]
            assert shapes[0][0] == 2 * frames  # (batch * frames) sequences, one per frame
            level = {v: k for k, v in merged_levels.items()}[tokens]
            if name.endswith("attn1") and level <= max_downsample:
                assert patched[name][0][1] == tokens - int(tokens * ratio), name
                spatial_level_blocks[level] = spatial_level_blocks.get(level, 0) + 1
            else:  # cross-attention (merge_crossattn=False by default) and levels above max_downsample
                assert patched[name][0][1] == tokens, name
        # stats count spatial blocks only
        assert {level: (s.blocks, s.tokens, s.kept) for level, s in stats.items()} == {
            level: (count, merged_levels[level], merged_levels[level] // 2) for level, count in spatial_level_blocks.items()
        }

    def check_frames_equal_level_tokens(self, model):
        """A 4x4 latent (16 tokens at level 1) with 16 frames (16 tokens per temporal sequence), and
        max_downsample=2 where the 2x2 level has 4 tokens: temporal attention stays at 16 frames, and the
        temporal layers carry no hook while patched."""
        frames, hw = 16, 4
        plain, patched, stats = self.observe(model, 0.5, frames, hw, max_downsample=2)
        temporal = [name for name in plain if self.is_temporal(name)]
        assert temporal
        for name in temporal:
            assert plain[name] == patched[name], name
            assert all(shape[1] == frames for shape in patched[name])
        for name in plain:
            if not self.is_temporal(name) and name.endswith("attn1"):
                tokens = plain[name][0][1]
                assert patched[name][0][1] == tokens - tokens // 2
        assert {level: s.blocks for level, s in stats.items()} == {1: 3, 2: 1}  # spatial blocks only
        self.tome.patch(model, ratio=0.5, max_downsample=2)
        try:
            assert [n for n, m in self.modules(model) if self.is_temporal(n) and self.hooked(m)] == []
        finally:
            self.tome.remove(model)

    def check_container_grids(self, model, frames=3, height=7, width=5):
        """Each spatial block's grid is its container's 4-D input (batch * frames, C, H, W), also on a
        non-square odd latent (batch 1)."""
        self.tome.patch(model, ratio=0.5, max_downsample=2)
        state = self.tome.patched_models(model)[0].state
        last, seen, handles = {}, [], []
        try:
            for name, module in self.modules(model):
                if type(module).__name__ in self.SPATIAL_CONTAINERS:
                    handles.append(self.pre_hook(module, lambda shape: last.update(grid=tuple(shape[-2:]))))
                elif name.endswith("attn1") and not self.is_temporal(name):
                    handles.append(self.pre_hook(module, lambda shape: seen.append((state.grid_hw, last["grid"], shape[0]))))
            self.call(model, frames, height, width, 1)
        finally:
            self.tome.remove(model)
            for handle in handles:
                handle.remove()
        assert len(seen) == 4
        assert all(grid == container for grid, container, _ in seen)
        assert {grid for grid, _, _ in seen} == {(height, width), ((height + 1) // 2, (width + 1) // 2)}
        assert all(rows == frames for _, _, rows in seen)

    def check_block_indices(self, model):
        """Block indices count spatial blocks only: block 0 merges one spatial self-attention; index 4 (the
        fifth, of four spatial blocks) is refused."""
        plain, patched, _ = self.observe(model, 0.5, 4, 8, blocks=[0])
        merged = [n for n in plain if n.endswith("attn1") and patched[n][0][1] != plain[n][0][1]]
        assert len(merged) == 1 and not self.is_temporal(merged[0])
        with pytest.raises(ValueError, match="index 4 is out of range"):
            self.tome.patch(model, ratio=0.5, blocks=[4])

    @staticmethod
    def chunk_tokens(frames_per_chunk: int, tokens: int, ratio: float, frame_ratio: float = 0.9) -> int:
        """Tokens a chunk's self-attention sees when merging across frames: the other frames' unmerged tokens
        and the reference frame's."""
        other = (frames_per_chunk - 1) * tokens
        return other - int(other * frame_ratio) + tokens - int(tokens * ratio)

    def check_cross_frame_token_counts(self, model, frames_per_chunk, frames=4, hw=8, ratio=0.5):
        """With ``frames_per_chunk``, spatial self-attention runs once per chunk on the merged tokens of its
        frames; cross-attention keeps one sequence per frame; temporal attention is untouched."""
        plain, patched, stats = self.observe(model, ratio, frames, hw, frames_per_chunk=frames_per_chunk)
        tokens = hw * hw
        kept = self.chunk_tokens(frames_per_chunk, tokens, ratio)
        for name, shapes in plain.items():
            if self.is_temporal(name) or name.endswith("attn2") or shapes[0][1] != tokens:
                assert patched[name] == shapes, name
            else:
                assert patched[name][0][:2] == (2 * frames // frames_per_chunk, kept), name
        assert {level: (s.blocks, s.tokens, s.kept, s.frames) for level, s in stats.items()} == {
            1: (3, tokens * frames_per_chunk, kept, frames_per_chunk)
        }

    def check_pipeline(self, pipe, run, **options):
        """A video pipeline patched at ratio 0.5 (and ``options``) gives finite frames that differ from
        unpatched, the same on a second call, merges its UNet's three level-1 spatial blocks (64 tokens per frame
        on the 8x8 latent, per frame or per chunk of frames) and nothing else, and gives the unpatched frames
        again once removed. ``run(pipe)``: its frames (numpy)."""
        plain = run(pipe)
        self.tome.patch(pipe, ratio=0.5, **options)
        assert [type(p.model).__name__ for p in self.tome.patched_models(pipe)] == [type(pipe.unet).__name__]
        patched = run(pipe)
        assert np.isfinite(patched).all()
        assert np.abs(patched - plain).max() > 1e-4
        np.testing.assert_array_equal(run(pipe), patched)
        stats = self.tome.patched_models(pipe)[0].state.ledger.stats
        chunk = options.get("frames_per_chunk", 1)
        kept = self.chunk_tokens(chunk, 64, 0.5) if chunk > 1 else 32
        assert {level: (s.blocks, s.tokens, s.kept) for level, s in stats.items()} == {1: (3, 64 * chunk, kept)}
        self.tome.remove(pipe)
        np.testing.assert_array_equal(run(pipe), plain)


@pytest.fixture(scope="session")
def video_checks():
    """:class:`VideoChecks`, to build per backend."""
    return VideoChecks


def _check_sdxl(tome, pipe, run, attn1_token_counts) -> None:
    """On the tiny SDXL pipeline (its finest level has no attention): ``patch(pipe)`` merges level 2 in 2x2
    cells, ``ratio=0.5`` halves level 2's 256 tokens, and ``max_downsample=1`` warns that it excludes it.
    ``run(pipe)``: one seeded call; ``attn1_token_counts(unet)``: the list every attn1's token count joins."""
    tome.patch(pipe)  # mode="auto": level 2's keys and values pooled in 2x2 cells
    run(pipe)
    [(_, state)] = tome.patched_models(pipe)
    assert {factor: (level.tokens, level.kept) for factor, level in state.ledger.stats.items()} == {2: (256, 64)}
    tome.patch(pipe, ratio=0.5)
    counts = attn1_token_counts(pipe.unet)
    run(pipe)
    assert 128 in counts and 256 not in counts  # level 2 (16x16 = 256 tokens) merged to 128
    with pytest.warns(UserWarning, match="max_downsample=1 but the finest level with attention is downsampled 2x"):
        tome.patch(pipe, max_downsample=1)


@pytest.fixture(scope="session")
def sdxl_check():
    """:func:`_check_sdxl`, the same on torch and paddle."""
    return _check_sdxl

