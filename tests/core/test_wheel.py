"""The installed wheel holds only the library (issue #36): built from a copy of the project's build inputs, its
file list is ``tome_core`` (core, backends, framework integrations, their type stubs) and metadata, nothing of
the tools."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_wheel_holds_the_library_alone(tmp_path):
    pytest.importorskip("setuptools")
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("tome_core-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    code = sorted(name for name in names if ".dist-info/" not in name)
    expected = sorted(  # with the type stubs of the entry modules and the marker that the package is typed
        path.relative_to(ROOT / "src").as_posix()
        for pattern in ("*.py", "*.pyi", "py.typed") for path in (ROOT / "src" / "tome_core").rglob(pattern)
    )
    assert code == expected
    assert {name.split("/")[0].split("/")[0] for name in code} == {"tome_core"}
    assert not any(part in name for name in code for part in ("bench", "presets", "train", "_models"))


def test_the_paddle_extra_pins_what_ppdiffusers_imports_with():
    """``pip install ".[paddle]"`` alone resolved huggingface_hub 2.x, which ppdiffusers 0.29 cannot import
    (``repo_type_and_id_from_hf_id``): the extra pins the releases the paddle test sessions install (noxfile.py),
    and the README's install line says what it installs."""
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["paddle"]
    pins = dict(requirement.split("==") for requirement in extra if "==" in requirement)
    assert set(pins) == {"ppdiffusers", "paddlenlp", "huggingface_hub", "aistudio-sdk"}, extra
    sessions = (ROOT / "noxfile.py").read_text()
    for name, version in pins.items():
        assert f'"{name}=={version}"' in sessions, (name, version)
    assert "huggingface_hub 0.25.2" in (ROOT / "README.md").read_text()
