"""The README's PaddlePaddle snippet runs as written and does what its comments say."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def section_code(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    return "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S))


def test_quick_start_snippet_patches_and_restores_the_pipeline():
    namespace: dict = {}
    exec(compile(section_code("Quick start: PaddlePaddle / ppdiffusers"), "README.md", "exec"), namespace)
    pipe, image, tome = namespace["pipe"], namespace["image"], namespace["tome"]
    assert image.size == (64, 64)
    assert tome.patched_models(pipe) == []  # removed again
    pipe.apply_tome(ratio=0.5)
    [(model, state)] = tome.patched_models(pipe)
    assert model is pipe.unet and state.config.ratio == 0.5
