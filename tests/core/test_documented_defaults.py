"""The options table of the README gives each option's default as ``ToMeConfig`` has it, and passing that
default explicitly changes nothing: an explicit default never switches the arrangement. A value in brackets
after the default (what ``None`` resolves to) acts as the default does too."""

from __future__ import annotations

import ast
import pathlib
import re
from dataclasses import fields

import pytest

from tome_core.config import ToMeConfig

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^\| ((?:`\w+`(?:, )?)+) \| `([^`]*)`(?: \(`?([^`)]*)`?\))? \|", re.M)


def _rows():
    """``(option, default, resolved or None)`` of every row of the README's option tables."""
    for names, default, resolved in ROW.findall(README.read_text()):
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
