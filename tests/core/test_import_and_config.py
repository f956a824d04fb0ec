"""Framework-free core: importing it loads no framework, and options are validated with clear errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tome_core import ToMeConfig
from tome_core.models.levels import block_grid, downsample_factor, level_grid


def test_import_loads_no_framework():
    code = (
        "import sys, tome_core, tome_core.config, tome_core.hooks.state, tome_core.models.levels, tome_core.driver, tome_core.models.families;"
        "print(sorted(m for m in ('numpy', 'torch', 'paddle', 'jax', 'flax', 'diffusers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"ratio": 1.0}, ValueError, r"ratio must be in \[0, 0.75\] \(one token per 2x2 cell is kept: at most 1 - 1/\(sx\*sy\)\), got 1.0"),
        ({"ratio": -0.1}, ValueError, r"ratio must be in \[0, 0.75\] .*, got -0.1"),
        ({"ratio": float("nan")}, ValueError, "ratio must be in"),
        ({"ratio": "0.5"}, TypeError, "ratio must be a float"),
        ({"ratio": True}, TypeError, "ratio must be a float"),
        ({"ratio": 0.8}, ValueError, r"ratio=0.8 cannot be reached with sx=2, sy=2.*at most 1 - 1/\(sx\*sy\) = 0.75"),
        ({"ratio": 0.6, "sx": 1, "sy": 2}, ValueError, "at most 1 - 1/\\(sx\\*sy\\) = 0.5"),
        ({"sx": 0}, ValueError, "sx must be an int >= 1, got 0"),
        ({"sy": 2.0}, TypeError, "sy must be an int >= 1, got 2.0"),
        ({"max_downsample": 3}, ValueError, "max_downsample must be one of None, 1, 2, 4, 8, got 3"),
        ({"max_downsample": True}, ValueError, "max_downsample must be one of"),
        ({"use_rand": 1}, TypeError, "use_rand must be True or False, got 1"),
        ({"merge_mlp": "yes"}, TypeError, "merge_mlp must be True or False"),
        ({"seed": -1}, ValueError, "seed must be an int >= 0, got -1"),
        ({"timestep_range": 500}, TypeError, r"timestep_range must be a pair \(low, high\) of numbers with low <= high, or None, got 500"),
        ({"timestep_range": (0, "1000")}, TypeError, "timestep_range must be a pair.*bound '1000'"),
        ({"timestep_range": (0, float("nan"))}, TypeError, "timestep_range must be a pair"),
        ({"timestep_range": (900, 100)}, ValueError, r"got \(900, 100\) \(low > high\)"),
        ({"mode": "kv", "matching": "cell", "cell_pool": "max"}, ValueError, "cell_pool must be one of 'mean', 'sample', got 'max'"),
        ({"ratio": 0.5, "cell_pool": "sample"}, ValueError, "cell_pool='sample' says what stands for a cell of matching='cell', but matching is 'similarity'"),
        ({"ration": 0.5}, TypeError, "unknown ToMe option\\(s\\) ration \\(did you mean ratio for ration\\?\\); valid options are ratio, max_downsample"),
    ],
)
def test_bad_options_raise_naming_argument_value_and_allowed(options, error, message):
    with pytest.raises(error, match=message):
        ToMeConfig.from_options(options)


def test_defaults_follow_tomesd_except_max_downsample_and_size_aware_attention():
    config = ToMeConfig()
    assert config.proportional_attn is True  # the README's fidelity table; False is tomesd's arithmetic
    assert (config.ratio, config.sx, config.sy, config.use_rand) == (0.5, 2, 2, True)
    assert (config.merge_attn, config.merge_crossattn, config.merge_mlp) == (True, False, False)
    assert config.max_downsample is None
    assert ToMeConfig(ratio=0.75).ratio == 0.75  # the reachable maximum itself is allowed


@pytest.mark.parametrize(
    "latent, grid",
    [((64, 64), (32, 32)), ((63, 65), (32, 33)), ((63, 65), (16, 17)), ((32, 128), (8, 32)), ((8, 64), (1, 8))],
)
def test_level_grid_matches_a_strided_unet(latent, grid):
    tokens = grid[0] * grid[1]
    factor = downsample_factor(latent, tokens)
    assert level_grid(latent, factor) == grid
    assert block_grid(latent, factor, None, tokens) == grid


@pytest.mark.parametrize(
    "latent, grid, factor",
    [((64, 64), (32, 32), 2), ((63, 65), (16, 17), 4), ((1, 3), (1, 2), 2), ((5, 40), (1, 5), 8), ((8, 8), (8, 8), 1)],
)
def test_level_from_the_seen_grid_is_the_real_downsampling(latent, grid, factor):
    assert downsample_factor(latent, grid[0] * grid[1], grid) == factor


def test_block_grid_prefers_the_grid_seen_by_the_transformer():
    # 5x40 latent at downsample 8 is 1x5; tomesd's formula says factor 7, which would give 1x6.
    assert downsample_factor((5, 40), 5) == 7
    assert block_grid((5, 40), 7, (1, 5), 5) == (1, 5)
    with pytest.raises(ValueError, match="cannot place 5 tokens on a grid"):
        block_grid((5, 40), 7, None, 5)


def test_installed_names_are_the_library_alone(tmp_path):
    """Outside a checkout only ``tome_core`` and its subpackages import: no top-level ``backends``/``adapters``
    and none of the repository's tools."""
    code = (
        "import importlib.util as u;"
        "print([n for n in ('tome_core', 'tome_core.backends', 'tome_core.adapters', 'backends', 'adapters',"
        " 'tome_tools', 'tome_core.bench', 'tome_core.noxfile', 'tome_core.tests')"
        " if u.find_spec(n) is not None])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).stdout
    assert out.strip() == "['tome_core', 'tome_core.backends', 'tome_core.adapters']"


# Values of the wrong type for each option that takes one of a few values (issue 43: prefer=["speed"] raised a bare
# "unhashable type: 'list'", and an array for mode, matching, cell_pool, max_downsample or frames_per_chunk "The
# truth value of an array ... is ambiguous"): each message names the option and the value.
WRONG_TYPES = [["speed"], {"speed": 1}, {"speed"}, np.array([1, 2]), np.float32(0.5), 2, b"kv"]


@pytest.mark.parametrize("name", ["prefer", "mode", "matching", "cell_pool", "max_downsample", "frames_per_chunk"])
@pytest.mark.parametrize("value", WRONG_TYPES, ids=lambda v: type(v).__name__)
def test_wrong_types_raise_naming_the_option_and_the_value(name, value):
    if name in ("max_downsample", "frames_per_chunk") and type(value) is int:
        return  # a valid value of these
    with pytest.raises((TypeError, ValueError)) as raised:
        ToMeConfig.from_options({name: value})
    assert str(raised.value).startswith(f"{name} must be") and repr(value) in str(raised.value), raised.value


def _merged_share(config: ToMeConfig, tokens: int, kv_input: bool, unet: bool) -> float:
    """The share of a self-attention's keys that ``mode="auto"`` under ``config`` merges at ``tokens`` tokens of the
    finest merged level: its cell's where keys pool, else ToMe for SD's ratio."""
    choice = next(chosen for fewest, chosen in config.auto_choices(kv_input, unet) if tokens >= fewest)
    return choice.max_ratio if choice.matching == "cell" else choice.ratio


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 1 << 20), st.booleans(), st.booleans())
def test_the_knob_is_monotone_at_every_token_count(tokens, kv_input, unet):
    """``prefer`` moves one way (issue 43: from 128x128 tokens "speed" ran 4x2 cells in transformers where
    "balance" runs 4x4): at every token count and model kind, "speed" merges at least as much as "balance",
    which merges at least as much as "fidelity"."""
    shares = [_merged_share(ToMeConfig(prefer=p), tokens, kv_input, unet) for p in ("fidelity", "balance", "speed")]
    assert shares == sorted(shares), (tokens, kv_input, unet, shares)


def test_the_knob_is_monotone_at_the_table_thresholds():
    """The same at every threshold of the table and on both sides of it (hypothesis may draw none of them)."""
    thresholds = {fewest for p in ("fidelity", "balance", "speed") for unet in (True, False)
                  for fewest, _ in ToMeConfig(prefer=p).auto_choices(True, unet)}
    for at in sorted(t for t in {1, *thresholds, *(t - 1 for t in thresholds), *(2 * t for t in thresholds)} if t >= 1):
        for unet in (True, False):
            shares = [_merged_share(ToMeConfig(prefer=p), at, True, unet) for p in ("fidelity", "balance", "speed")]
            assert shares == sorted(shares), (at, unet, shares)


def test_numpy_numbers_are_accepted_as_option_values():
    config = ToMeConfig(
        ratio=np.float32(0.5), sx=np.int64(2), seed=np.int32(3), level_ratios={np.int64(1): np.float64(0.25)},
        blocks=np.arange(3), reuse_blocks=np.int64(2),
    )
    assert (type(config.ratio), config.ratio, config.sx, config.seed) == (float, 0.5, 2, 3)
    assert config.level_ratios == {1: 0.25} and config.blocks == (0, 1, 2) and config.reuse_blocks == 2
    with pytest.raises(TypeError, match="ratio must be a float"):
        ToMeConfig(ratio=np.bool_(True))
    with pytest.raises(ValueError, match="reuse_blocks must be an int >= 1, got 0"):
        ToMeConfig(reuse_blocks=0)


def test_timestep_range_merges_a_call_only_when_its_whole_batch_is_inside():
    config = ToMeConfig(timestep_range=[np.int64(500), np.inf])
    assert config.timestep_range == (500.0, math.inf)
    assert config.merges_at([500]) and config.merges_at([999.5, 700]) and config.merges_at([1e9])
    assert not config.merges_at([499.9]) and not config.merges_at([700, 100])  # one side of the bound each
    assert ToMeConfig().merges_at([0]) and ToMeConfig(timestep_range=(3, 3)).merges_at([3.0])


def test_the_tools_run_from_the_repository_root_on_the_installed_library():
    """From a checkout's root the tools (``tome_tools``, beside the library) import and the benchmark starts,
    while ``tome_core`` is the installed package: the ``src/`` layout keeps the checkout from shadowing it."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import tome_core, tome_tools.bench; print(tome_core.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    import tome_core

    assert done.stdout.strip() == tome_core.__file__  # the same library the tests run, not a folder of the checkout
    done = subprocess.run([sys.executable, "-m", "tome_tools.bench", "--help"], cwd=root, capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "usage: python -m tome_tools.bench" in done.stdout, done.stderr


@pytest.mark.parametrize("options", [
    {}, {"ratio": 0.5}, {"ratio": 0.3, "merge_mlp": True, "blocks": [0, 2]},
    {"mode": "kv", "matching": "cell", "level_cells": {1: 4, 2: 2}, "cell_pool": "sample"}, {"level_ratios": {1: 0.25}, "proportional_attn": False},
])
def test_config_prints_as_the_call_that_makes_it(options):
    """A config prints only what differs from the defaults, and that text builds an equal config."""
    config = ToMeConfig(**options)
    assert eval(repr(config), {"ToMeConfig": ToMeConfig}) == config
    assert repr(ToMeConfig()) == "ToMeConfig()" and "proportional_attn" not in repr(ToMeConfig(ratio=0.3))


def test_readme_options_tables_and_help_name_the_same_options():
    """help() is generated from ToMeConfig; the option tables (the README's, of the options tomesd has, and
    docs/options.md's, of the others) must list the same names."""
    import pathlib
    import re
    from dataclasses import fields

    from tome_core.config import options_help

    root = pathlib.Path(__file__).resolve().parents[2]
    section = (root / "README.md").read_text().split("## Options", 1)[1].split("\n## ", 1)[0]
    section += (root / "docs" / "options.md").read_text()
    in_tables = {name for row in re.findall(r"^\| (`[^|]*)\|", section, flags=re.M) for name in re.findall(r"`(\w+)`", row)}
    names = {f.name for f in fields(ToMeConfig)}
    assert in_tables == names
    assert all(f"    {name}=" in options_help() for name in names)


@pytest.mark.parametrize("framework", ["torch", "paddle", "jax"])
@pytest.mark.parametrize("entry", ["patch", "apply_tome"])
def test_help_of_each_entry_point_lists_every_option_and_dir_the_public_names(framework, entry):
    """Run where the framework is installed (its nox session); help() is generated from ToMeConfig."""
    import importlib
    import pydoc
    from dataclasses import fields

    from tome_core.config import option_meanings

    if framework not in os.environ.get("TOME_TEST_BACKENDS", "numpy").split(","):
        pytest.skip(f"{framework} is not tested in this session")
    entry_point = importlib.import_module(f"tome_core.{framework}")
    text = pydoc.render_doc(getattr(entry_point, entry), renderer=pydoc.plaintext)
    meanings = option_meanings()
    flowing = " ".join(text.split())  # help wraps each option's text
    for f in fields(ToMeConfig):
        assert f"{f.name}={f.default!r}: " in text and " ".join(meanings[f.name].split())[:40] in flowing, f.name
    assert "obj: a " in text  # what it accepts
    assert dir(entry_point) == sorted(entry_point.__all__)


def test_every_option_has_its_group_and_help_and_help_lists_them_by_group():
    """Options are defined once, as fields with their own help (not parsed from a docstring)."""
    from dataclasses import fields

    from tome_core.config import OPTION_GROUPS, options_help

    groups = [group for group, _ in OPTION_GROUPS]
    for f in fields(ToMeConfig):
        assert f.metadata["group"] in groups and len(f.metadata["help"]) > 20, f.name
    text = options_help()
    titles = [text.index(f"  {title}:\n") for _, title in OPTION_GROUPS]
    assert titles == sorted(titles)
    for f in fields(ToMeConfig):  # each option under its own group's title
        at = text.index(f"    {f.name}={f.default!r}: ")
        group = groups.index(f.metadata["group"])
        assert titles[group] < at and (group + 1 == len(titles) or at < titles[group + 1]), f.name


@pytest.mark.parametrize("options", [
    {}, dict(prefer="speed"), dict(mode="auto", prefer="fidelity"), dict(ratio=0.5),
    dict(mode="kv", matching="cell", level_cells={1: (2, 2), 2: (4, 4)}), dict(mode="kv", matching="cell", sx=4, sy=4),
], ids=["default", "prefer", "auto", "ratio", "mixed cells", "cells"])
def test_dataclasses_replace_changes_one_option_and_keeps_the_rest(options):
    """Edges round three, 1: ``replace`` passes every field's acting value back in, and the default's own ratio,
    cells and matching (and a cell's ratio) were refused as if given; the module's docstring says replace works."""
    import dataclasses

    config = ToMeConfig(**options)
    changed = dataclasses.replace(config, seed=3)
    assert changed.seed == 3 and changed == ToMeConfig(**options, seed=3)
    assert dataclasses.replace(changed, seed=config.seed) == config
