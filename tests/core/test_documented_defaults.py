"""The options tables (the README's, of the options tomesd has, and docs/options.md's, of the others) give each
option's default as ``ToMeConfig`` has it, and passing that default explicitly changes nothing: an explicit
default never switches the arrangement. A value in brackets after the default (what ``None`` resolves to) acts as
the default does too."""

from __future__ import annotations

import ast
import pathlib
import re
from dataclasses import fields

import pytest

from tome_core.config import ToMeConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLES = (ROOT / "README.md", ROOT / "docs" / "options.md")
ROW = re.compile(r"^\| ((?:`\w+`(?:, )?)+) \| `([^`]*)`(?: \(`?([^`)]*)`?\))? \|", re.M)


def _rows():
    """``(option, default, resolved or None)`` of every row of the option tables."""
    for names, default, resolved in ROW.findall("\n".join(path.read_text() for path in TABLES)):
        for name in re.findall(r"`(\w+)`", names):
            yield name, ast.literal_eval(default), ast.literal_eval(resolved) if resolved else None


def _behaviour(config: ToMeConfig):
    """What a config runs: its mode, frames per chunk and what ``mode="auto"`` chooses in a UNet and a transformer."""
    chosen = lambda unet: [  # noqa: E731
        (tokens, c.mode, c.matching, c.sx, c.sy, c.ratio, c.cell_pool) for tokens, c in config.auto_choices(True, unet)
    ]
    return config.mode, config.frames, config.ratio, config.sx, config.sy, config.matching, chosen(True), chosen(False)


def test_every_option_has_a_row():
    assert {name for name, *_ in _rows()} == {f.name for f in fields(ToMeConfig)}


@pytest.mark.parametrize("name, default, resolved", list(_rows()), ids=lambda v: str(v))
def test_the_documented_default_is_the_default_and_acts_as_it(name, default, resolved):
    field = next(f for f in fields(ToMeConfig) if f.name == name)
    assert field.default == default
    assert ToMeConfig(**{name: default}) == ToMeConfig()
    if resolved is not None:
        assert _behaviour(ToMeConfig(**{name: resolved})) == _behaviour(ToMeConfig())


def test_the_entry_points_signature_lists_every_option_with_its_acting_default():
    """Every framework's ``patch`` and ``apply_tome`` is :func:`~tome_core.dropin.ratio_positional` around its
    adapter: its signature (inspect, help(), completion) is the model, the ratio (also positional), then every
    other option by keyword, each with the default that acts as leaving it out."""
    import inspect

    from tome_core.dropin import ratio_positional

    entry = ratio_positional(lambda model, **options: (model, options), "patch", __name__)
    parameters = list(inspect.signature(entry).parameters.values())
    assert [p.name for p in parameters] == ["model", "ratio"] + [f.name for f in fields(ToMeConfig) if f.name != "ratio"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters[2:])
    defaults = {f.name: f.default for f in fields(ToMeConfig)}
    assert all(p.default == defaults[p.name] for p in parameters[1:])
    assert all(ToMeConfig(**{p.name: p.default}) == ToMeConfig() for p in parameters[1:])
    assert entry("pipe", 0.5, seed=3) == ("pipe", {"seed": 3, "ratio": 0.5})
