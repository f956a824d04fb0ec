"""The jax quick start runs as documented and reports what ToMe did (checked against the grid's arithmetic
and its own outputs)."""

from __future__ import annotations

from importlib import import_module


def test_quickstart_reports_patched_blocks_merged_tokens_speed_and_change(capsys):
    result = import_module("examples.jax_quickstart").main(["--size", "16", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "FlaxUNet2DConditionModel: 7 transformer blocks hooked" in out
    assert "1/1 scale: 3 blocks, 256 -> 128 tokens (50% merged; tokens, similarity)" in out
    assert "jitted UNet call: unpatched" in out and "speedup" in out
    assert result["blocks"] == 7 and result["state"].ledger.stats[1].kept == 128
    assert 0 < result["change"] < 1 and result["speedup"] > 0
