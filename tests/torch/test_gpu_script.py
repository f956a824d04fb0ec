"""The prepared GPU script of issue #42 (``docs/results/gpu_speed.py``) runs end to end: its ``--dry-run`` (CPU,
float32, tiny presets, an eager call standing in for each CUDA graph) on the smallest parts writes a row for every
method in both executions and the per-block pieces, so a GPU session does not spend its time finding a bug."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = pytest.mark.cost_model  # the script runs with the measured bounds, as on the GPU
RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "results")


@pytest.fixture(scope="module")
def gpu_speed():
    sys.path.insert(0, RESULTS)
    try:
        import gpu_speed

        yield gpu_speed
    finally:
        sys.path.remove(RESULTS)


def _run(gpu_speed, tmp_path, monkeypatch, *argv):
    monkeypatch.setenv("OUT", str(tmp_path))
    gpu_speed.main(["--dry-run", *argv])
    with open(tmp_path / "gpu_speed.json") as f:
        return json.load(f)


def test_dry_run_writes_every_method_and_block(gpu_speed, tmp_path, monkeypatch):
    """SDXL (a UNet: tomesd, the UNet oracle at its level 2) and Flux at 4,096 tokens (a transformer the default
    merges on a CPU, so its oracle runs): every method has one row per execution, timed or naming the timed
    row it equals, none failed; outputs that merge differ from the unpatched one, others equal it."""
    import torch

    threads = torch.get_num_threads()
    result = _run(gpu_speed, tmp_path, monkeypatch, "sdxl", "flux")
    assert torch.get_num_threads() == threads  # the dry run gives the process back as it found it
    assert result["dry_run"] and result["parts"] == ["sdxl", "flux"]
    rows = result["rows"]
    assert not [row for row in rows if "error" in row or "skipped" in row]
    cases = {row["case"]: row for row in rows if row["row"] == "case"}
    assert set(cases) == {case.name for case in gpu_speed.CASES if case.part in ("sdxl", "flux")}
    for case in gpu_speed.CASES:
        if case.name not in cases:
            continue
        for execution in ("eager", "graph"):
            calls = {row["method"]: row for row in rows if row["row"] == "call" and row["case"] == case.name and row["execution"] == execution}
            assert list(calls) == gpu_speed.methods_of(case)
            timed = {name for name, row in calls.items() if "ms" in row}
            for name, row in calls.items():
                assert "ms" in row or row.get("same_as") in timed or (name == "tomesd 0.5" and execution == "graph"), row
            assert calls["unpatched"]["fid"] == 0.0 and calls["unpatched"]["speedup"] == 1.0
            forced = calls[gpu_speed.FORCED]
            assert forced.get("same_as") == "default" or forced["fid"] > 1e-4
            forced_oracle = calls["oracle of default, min_tokens=0"]
            assert forced_oracle.get("fid", 1.0) > 1e-4 and (forced_oracle.get("same_as") in (None, "oracle of default"))
            pieces = {row["piece"]: row for row in rows if row["row"] == "block" and row["case"] == case.name and row["execution"] == execution}
            assert {"block unpatched", "block merged", "block oracle", "match", "merge"} <= {p for p, row in pieces.items() if row["ms"] > 0}
            summary = [row for row in rows if row["row"] == "block summary" and row["case"] == case.name and row["execution"] == execution]
            assert len(summary) == 1 and summary[0]["kept"] < summary[0]["tokens"]
    sdxl = {row["method"]: row for row in rows if row["row"] == "call" and row["case"].startswith("SDXL") and row["execution"] == "eager"}
    assert sdxl["oracle of default"]["same_as"] == "unpatched"  # 64 tokens: the default merges nothing on a CPU
    assert sdxl["default"]["fid"] == 0.0 and sdxl["default"]["unmerged"]
    assert sdxl["tomesd 0.5"]["fid"] > 1e-4  # at SDXL's level 2, where it merges
    flux = {row["method"]: row for row in rows if row["row"] == "call" and row["case"].startswith("Flux") and row["execution"] == "eager"}
    assert flux["default"]["fid"] > 1e-4 and flux["oracle of default"]["fid"] > 1e-4
    assert flux[gpu_speed.FORCED]["same_as"] == "default" and flux["ratio 0.5"]["same_as"] == "default"
    assert [row["row"] for row in rows if row.get("part") == "flux"][-1] == "part"


def test_what_would_not_fit_is_skipped_with_a_row(gpu_speed, tmp_path, monkeypatch):
    rows = _run(gpu_speed, tmp_path, monkeypatch, "--memory-gib", "0.1", "--time-limit", "100", "sdxl", "hunyuan")["rows"]
    sdxl = [row for row in rows if row["part"] == "sdxl" and row["row"] == "case"]
    assert len(sdxl) == 1 and "needs about 0.5 GiB" in sdxl[0]["skipped"]
    hunyuan = [row for row in rows if row["part"] == "hunyuan"]
    assert len(hunyuan) == 1 and "--time-limit 100" in hunyuan[0]["skipped"]


def test_unknown_part_is_refused(gpu_speed, capsys):
    with pytest.raises(SystemExit):
        gpu_speed.main(["--dry-run", "sd14"])
    assert "PART must be among launches, sd15, sdxl, flux, wan480, wan720, hunyuan, got 'sd14'" in capsys.readouterr().err

