"""The README's PaddlePaddle snippet runs as written and does what its comments say."""

from __future__ import annotations


def test_quick_start_snippet_patches_and_restores_the_pipeline(readme_code):
    namespace: dict = {}
    exec(compile(readme_code("Quick start: PaddlePaddle / ppdiffusers"), "README.md", "exec"), namespace)
    pipe, image, tome = namespace["pipe"], namespace["image"], namespace["tome"]
    assert image.size == (64, 64)
    assert tome.patched_models(pipe) == []  # removed again
    pipe.apply_tome(ratio=0.5)
    [(model, state)] = tome.patched_models(pipe)
    assert model is pipe.unet and state.config.ratio == 0.5
