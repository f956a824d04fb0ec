"""The paddle example runs as documented and reports what ToMe did (checked against its own outputs)."""

from __future__ import annotations

from importlib import import_module


def test_quickstart_reports_merged_tokens_and_a_real_change(capsys):
    result = import_module("examples.paddle_quickstart").main(["--preset", "tiny", "--size", "64", "--steps", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "UNet2DConditionModel, in the last call:" in out
    assert "1/1 scale: 3 blocks, 1024 -> 512 tokens (50% merged; tokens, similarity)" in out
    assert 0 < result["change"] < 1 and result["speedup"] > 0
    [(model, state)] = result["models"]
    assert state.ledger.stats[1].kept == 512 and state.ledger.stats[1].blocks == 3
