"""The examples run as documented and report what they did (checked against their own outputs)."""

from __future__ import annotations

import math
import pathlib
import re
from importlib import import_module

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quickstart_reports_merged_tokens_and_a_real_change(capsys):
    result = import_module("examples.torch_quickstart").main(["--preset", "tiny", "--size", "64", "--steps", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "ToMe patch(pipe) (the default)" in out  # what users get: keys and values in 2x2 cells
    assert "1/1 scale: 3 blocks, 1024 -> 256 keys/values (75% merged; kv, 2x2 cells)" in out
    assert 0 < result["change"] < 1
    result = import_module("examples.torch_quickstart").main(["--preset", "tiny", "--size", "64", "--steps", "1", "--repeats", "1", "--ratio", "0.5"])
    out = capsys.readouterr().out
    assert "UNet2DConditionModel, in the last call:" in out
    assert "1/1 scale: 3 blocks, 1024 -> 512 tokens (50% merged; tokens, similarity)" in out
    assert 0 < result["change"] < 1 and result["speedup"] > 0
    [(model, state)] = result["models"]
    assert state.ledger.stats[1].kept == 512


def test_finetune_lora_prints_finite_curves_that_differ_and_ratio_zero_equals_unpatched(capsys, monkeypatch):
    monkeypatch.setenv("TOME_CORE_MODELS", str(ROOT / "models"))  # nox tests the installed package, without models/
    argv = ["--steps", "3", "--batch", "2", "--log-every", "1", "--per-class", "4", "--held-out", "2", "--samples-per-class", "1",
            "--sample-steps", "2", "--methods", "unpatched", "tokens-0.5", "kv-cell+stop", "ratio-0", "tokens-0.5+noisy",
            "kv-42-sample+after1+stop2", "--stop-tome-at", "1", "--seed", "2"]
    with pytest.warns(UserWarning, match="merges no tokens"):  # ratio-0
        result = import_module("examples.finetune_lora").main(argv)
    out = capsys.readouterr().out
    # the printed loss table: a header naming the runs, then one row per logged step, every value finite
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("training loss (")) + 1
    assert lines[header].split() == ["step", "unpatched", "tokens-0.5", "kv-cell+stop", "ratio-0", "tokens-0.5+noisy", "kv-42-sample+after1+stop2"]
    rows = [[float(v) for v in line.split()] for line in lines[header + 1 : header + 4]]
    assert [row[0] for row in rows] == [1, 2, 3] and all(math.isfinite(v) for row in rows for v in row[1:])
    losses = result["losses"]
    assert [row[1:] for row in rows] == [[round(losses[n][i], 4) for n in result["losses"]] for i in range(3)]
    # reduction changes the training: from the first step on (the same batch, the same initial weights)
    assert losses["tokens-0.5"][0] != losses["unpatched"][0] and losses["kv-cell+stop"][0] != losses["unpatched"][0]
    # the schedule: merged in step 1, tome.remove before step 2
    assert result["merged"]["kv-cell+stop"] == [True, False, False] and result["merged"]["tokens-0.5"] == [True] * 3
    assert "step 2: tome.remove(unet) in kv-cell+stop;" in out
    # an unmerged warm-up of one step, then merging in step 2 only: the same batches, so step 1 is unpatched's
    assert result["merged"]["kv-42-sample+after1+stop2"] == [False, True, False]
    assert "step 2: tome.patch(unet) in kv-42-sample+after1+stop2;" in out and "step 3: tome.remove(unet) in kv-42-sample+after1+stop2;" in out
    assert losses["kv-42-sample+after1+stop2"][0] == losses["unpatched"][0] and losses["kv-42-sample+after1+stop2"][1] != losses["unpatched"][1]
    # the timestep schedule: a batch draws all its timesteps from one half, and merges only in the upper one
    halves = [{t >= 500 for t in batch} for batch in result["timesteps"]["tokens-0.5+noisy"]]
    assert all(len(half) == 1 for half in halves) and result["timesteps"]["unpatched"] == result["timesteps"]["tokens-0.5+noisy"]
    assert result["merged"]["tokens-0.5+noisy"] == [half == {True} for half in halves] == [False, True, True]
    held_out = result["held_out"]  # without reduction, before training and at every logged step
    assert [step for step, _ in held_out["tokens-0.5"]] == [0, 1, 2, 3]
    assert all(math.isfinite(loss) for curve in held_out.values() for _, loss in curve)
    assert held_out["tokens-0.5"][0] == held_out["unpatched"][0] and held_out["tokens-0.5"][1] != held_out["unpatched"][1]
    # ratio 0 merges nothing: the unpatched run exactly (losses, trained adapter, samples)
    assert losses["ratio-0"] == losses["unpatched"] and held_out["ratio-0"] == held_out["unpatched"]
    assert result["reduced_loss"]["ratio-0"] == result["held_loss"]["unpatched"] and math.isnan(result["reduced_loss"]["unpatched"])
    lora = result["lora"]
    assert lora["ratio-0"].keys() == lora["unpatched"].keys() and lora["unpatched"]
    assert all(torch.equal(lora["ratio-0"][k], lora["unpatched"][k]) for k in lora["unpatched"])
    assert not all(torch.equal(lora["tokens-0.5"][k], lora["unpatched"][k]) for k in lora["unpatched"])
    quality = result["quality"]
    assert quality["ratio-0"]["psnr"] == math.inf and quality["unpatched"]["psnr"] == math.inf
    assert math.isfinite(quality["tokens-0.5"]["psnr"]) and 0 <= quality["tokens-0.5"]["accuracy"] <= 1
    assert all(t > 0 for times in result["times"].values() for t in times)


@pytest.mark.parametrize("name", ["kv-cell+stop0", "kv-cell+stopx", "unpatched+stop5", "kv-cell+later", "kv-2",
                                  "kv-cell+after", "kv-cell+stop5+stop6", "kv-cell+after10+stop5", "unpatched+after3"])
def test_finetune_lora_refuses_an_unknown_method_naming_what_is_allowed(name):
    with pytest.raises(SystemExit, match=rf"unknown method {re.escape(repr(name))}: choose from unpatched, .*\+afterN"):
        import_module("examples.finetune_lora").method(name, 500, 50)


def test_finetune_lora_schedules():
    method, cell = import_module("examples.finetune_lora").method, {"mode": "kv", "matching": "cell"}
    assert method("kv-cell", 500, 50) == (cell, 1, None)
    assert method("kv-cell+stop", 500, 50) == (cell, 1, 50)
    assert method("kv-cell+stop12", 500, 50) == (cell, 1, 12)
    assert method("kv-cell+after10", 500, 50) == (cell, 11, None)
    assert method("kv-cell+stop20+after10", 500, 50) == (cell, 11, 20)
    assert method("tokens-0.5+noisy", 500, 50) == ({"ratio": 0.5, "timestep_range": (500, 1000)}, 1, None)
    assert method("kv-42+after5+noisy", 500, 50) == (
        {"mode": "kv", "matching": "cell", "level_cells": {1: 4, 2: 2}, "max_downsample": 2, "timestep_range": (500, 1000)}, 6, None)
    assert method("unpatched", 500, 50) == (None, 1, None)
