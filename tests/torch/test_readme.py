"""The PyTorch snippets of the README and of the guides (docs/) run as written and do what their comments say,
as a user runs them: from a directory outside the clone, with the library and diffusers alone (``tome_tools``
cannot be imported there). The models a snippet loads by id are tiny stand-ins with random weights, saved by the
test under that id in the snippet's working directory, where ``from_pretrained`` reads a local folder of that
name before it would ask the Hub."""

from __future__ import annotations

import contextlib
import importlib
import os
import pathlib
import re
import sys
from typing import Any, Dict, Iterator, Tuple

import pytest
import torch

from tome_tools.diffusers_models import build_pipeline, build_transformer, build_transformer_pipeline, build_video_pipeline

# the snippets run as a user runs them: with the measured bounds of tome_core.models.cost (tiny models pass min_tokens=0)
pytestmark = pytest.mark.cost_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
SD = "stable-diffusion-v1-5/stable-diffusion-v1-5"
SDXL = "stabilityai/stable-diffusion-xl-base-1.0"


FLUX = "black-forest-labs/FLUX.1-dev"
SD35 = "stabilityai/stable-diffusion-3.5-medium"
MOTION = "guoyww/animatediff-motion-adapter-v1-5-2"
# the guides whose snippets a user copies: the library and diffusers alone (fidelity's loads the clone's trained models)
USER_GUIDES = ("index", "compile", "high-resolution", "training", "models", "parallel", "transformers", "video")


@contextlib.contextmanager
def outside_the_clone(directory: pathlib.Path, models: Dict[str, Any]) -> Iterator[None]:
    """Within it: each of ``models`` (id -> pipeline or model; an id may end in a subfolder) saved at its id under
    ``directory``, the working directory; the clone's root off ``sys.path`` and ``tome_tools`` not importable (also
    in a spawned process, which has no pytest fixtures). Everything is restored after."""
    for name, model in models.items():
        model.save_pretrained(directory / name)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(directory)
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and pathlib.Path(p).resolve() != ROOT])
        for name in [m for m in sys.modules if m == "tome_tools" or m.startswith("tome_tools.")]:
            monkeypatch.delitem(sys.modules, name)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("tome_tools")
        yield


@pytest.fixture
def outside_clone(tmp_path):
    """``run(code, path, models)``: exec ``code`` (from the file ``path``) in a fresh namespace, returned,
    :func:`outside_the_clone` in a temporary directory."""

    def run(code: str, path: str, models: dict) -> dict:
        namespace: dict = {}
        with outside_the_clone(tmp_path, models):
            exec(compile(code, path, "exec"), namespace)
        return namespace

    return run


def flux_pipeline() -> Any:
    """The tiny Flux pipeline with tiny text encoders and tokenizers of their kinds (CLIP's with its byte-level
    vocabulary, T5's a unigram over letters), so that it takes a prompt as FLUX.1 does; random weights."""
    from diffusers import FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

    from tome_tools.presets import TINY_TEXT_ENCODER, write_clip_tokenizer_files

    pipe, _ = build_transformer_pipeline("flux")
    config = pipe.transformer.config
    torch.manual_seed(1)
    clip = CLIPTextModel(CLIPTextConfig(**{**TINY_TEXT_ENCODER, "hidden_size": config.pooled_projection_dim})).eval()
    files = write_clip_tokenizer_files()
    vocabulary = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)] + [(c, -1.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(vocabulary), d_model=config.joint_attention_dim, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
    )).eval()
    return FluxPipeline(
        transformer=pipe.transformer, vae=pipe.vae, scheduler=pipe.scheduler, text_encoder=clip,
        tokenizer=CLIPTokenizer(files["vocab_file"], files["merges_file"], model_max_length=77),
        text_encoder_2=t5, tokenizer_2=T5Tokenizer(vocab=vocabulary, extra_ids=0),
    )


def animatediff_parts() -> Tuple[Any, Any]:
    """An SD pipeline holding the tiny AnimateDiff's image UNet, and its motion adapter: what AnimateDiff's
    ``from_pretrained(sd_id, motion_adapter=...)`` joins into a video pipeline."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    from tome_tools.presets import video_unet_config

    video, _ = build_video_pipeline("animatediff")
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**video_unet_config("tiny-video-sd")[1]).eval()
    image = StableDiffusionPipeline(
        vae=video.vae, text_encoder=video.text_encoder, tokenizer=video.tokenizer, unet=unet, scheduler=video.scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    return image, video.motion_adapter


def printed_as_commented(comment: str, printed: str) -> bool:
    """Whether ``printed`` holds a line the snippet's ``comment`` describes, each "..." standing for any text."""
    pattern = ".*".join(re.escape(part) for part in comment.strip().split("..."))
    return re.search(pattern, printed) is not None


def test_snippets_import_only_the_library_and_what_users_install(readme_code, guide_code):
    """No snippet of the README or of a guide imports the clone's tools."""
    codes = [readme_code(title) for title in ("Quick start: PyTorch / diffusers", "Quick start: PaddlePaddle / ppdiffusers",
                                              "Quick start: JAX / Flax diffusers")]
    codes += [guide_code(page)[0] for page in USER_GUIDES]
    assert all(code and "tome_tools" not in code for code in codes)


def test_quick_start_snippet_patches_and_restores_the_pipeline(readme_code, outside_clone, capsys):
    namespace = outside_clone(
        readme_code("Quick start: PyTorch / diffusers"), "README.md", {SD: build_pipeline("sd"), SDXL: build_pipeline("sdxl")}
    )
    printed = capsys.readouterr().out
    assert "1/1 scale: 3 blocks unmerged: 1024 tokens, fewer than the 4096 " in printed  # the toy, below the bound
    assert "1/2 scale: 6 blocks, 256 -> 64 keys/values (75% merged; kv, 2x2 cells)" in printed  # SDXL, min_tokens=0
    assert not namespace["tome"].patched_models(namespace["xl"])
    pipe, image = namespace["pipe"], namespace["image"]
    assert image.size == (64, 64)
    assert not any("_tome_patch" in m.__dict__ for m in pipe.unet.modules())  # removed again
    tome = namespace["tome"]
    tome.patch(pipe, ratio=0.5)
    [(model, state)] = tome.patched_models(pipe)
    assert model is pipe.unet and state.config.ratio == 0.5


def test_home_page_snippet_patches_runs_and_removes(guide_code, outside_clone, capsys):
    namespace = outside_clone(*guide_code("index"), {SD: build_pipeline("sd")})
    assert "1/1 scale: 3 blocks unmerged: 1024 tokens" in capsys.readouterr().out
    pipe = namespace["pipe"]
    assert not any("_tome_patch" in m.__dict__ for m in pipe.unet.modules())


def test_transformer_snippet_merges_image_tokens_and_restores(guide_code, outside_clone, capsys):
    namespace = outside_clone(*guide_code("transformers"), {FLUX: flux_pipeline()})
    pipe, latents = namespace["pipe"], namespace["latents"]
    assert latents.shape == (1, 64, 16)  # the stand-in's packed latents of a 32 px image
    assert printed_as_commented("1/1 scale: ... blocks, ... tokens (50% merged; tokens, similarity)", capsys.readouterr().out)
    assert not namespace["tome"].patched_models(pipe)  # removed again


def test_high_resolution_snippet_runs_every_arrangement(guide_code, outside_clone, capsys):
    namespace = outside_clone(*guide_code("high-resolution"), {SD: build_pipeline("sd")})
    lines = capsys.readouterr().out.splitlines()
    printed = [line for line in lines if line.startswith("{")]
    assert len(printed) == 5
    assert "keys/values (75% merged; kv, 2x2 cells)" in printed[0]  # auto
    assert "tokens (50% merged; tokens, similarity)" in printed[1]
    assert "keys/values (94% merged; kv, 4x4 cells)" in printed[2]
    assert "kv, 2x2 cells" in " ".join(lines[lines.index(printed[3]):lines.index(printed[4])])  # level 2 of 4x4 + 2x2
    assert "queries (50% merged; queries, similarity)" in printed[4]
    assert not namespace["tome"].patched_models(namespace["pipe"])


def test_trained_models_snippet_compares_samples(guide_code, capsys, monkeypatch):
    import os

    monkeypatch.setenv("TOME_CORE_MODELS", os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "models"))
    namespace: dict = {}
    exec(compile(*guide_code("fidelity"), "exec"), namespace)
    psnr, ssim = namespace["psnr"], namespace["ssim"]
    assert 10 < psnr < float("inf") and 0 < ssim < 1
    assert capsys.readouterr().out.strip() == f"PSNR {psnr:.1f} dB, SSIM {ssim:.3f}"
    assert not namespace["tome"].patched_models(namespace["model"].model)  # removed again


def test_compiled_models_snippet_patch_and_remove_take_effect(guide_code, outside_clone):
    """Compiled with dynamo's graph run as captured (backend="eager"): inductor compiles this UNet in minutes on
    two CPU cores; tests/torch/test_compile.py runs inductor on a smaller model."""
    import numpy as np

    code, path = guide_code("compile")
    assert "torch.compile(pipe.unet, fullgraph=True)" in code
    namespace = outside_clone(code.replace("fullgraph=True)", 'fullgraph=True, backend="eager")'), path, {SD: build_pipeline("sd")})
    plain, merged, again = namespace["plain"], namespace["merged"], namespace["again"]
    assert np.abs(merged - plain).max() > 1e-4
    np.testing.assert_allclose(again, plain, rtol=1e-5, atol=1e-5)
    pipe, tome = namespace["pipe"], namespace["tome"]
    eager = pipe.unet._orig_mod
    tome.patch(eager, ratio=0.5)
    pipe.unet = eager
    eager_merged = pipe(**namespace["prompt"], generator=namespace["torch"].manual_seed(0)).images  # the oracle
    np.testing.assert_allclose(eager_merged, merged, rtol=1e-4, atol=1e-4)


def test_video_snippet_merges_per_frame_then_across_frames(guide_code, outside_clone, capsys):
    image, adapter = animatediff_parts()
    namespace = outside_clone(*guide_code("video"), {SD: image, MOTION: adapter})
    printed = [line.strip() for line in capsys.readouterr().out.splitlines() if "scale:" in line]
    assert printed == [
        "1/1 scale: 3 blocks, 64 -> 32 tokens (50% merged; tokens, similarity)",
        "1/1 scale: 3 blocks, 256 -> 52 tokens (chunks of 4 frames) (80% merged; tokens, similarity)",
    ]
    assert namespace["video"].shape[:2] == (1, 8)
    assert not namespace["tome"].patched_models(namespace["pipe"])


def test_training_snippet_trains_lora_and_leaves_an_unpatched_lora_unet(guide_code, outside_clone):
    namespace = outside_clone(*guide_code("training"), {SD: build_pipeline("sd")})
    unet, lora = namespace["unet"], namespace["lora"]
    assert lora and all("lora" in key for key in lora)
    assert not namespace["tome"].patched_models(unet)
    assert bool(namespace["loss"].isfinite())
    assert all(("lora" in name) == p.requires_grad for name, p in unet.named_parameters())


def test_every_guide_with_python_has_its_snippets_run():
    """The guides whose snippets the tests run (here, test_zoo.py, test_parallel.py and test_ldm.py): any other
    page with a python block would go unchecked."""
    import pathlib

    docs = pathlib.Path(__file__).resolve().parents[2] / "docs"
    with_code = {path.stem for path in docs.glob("*.md") if "```python" in path.read_text()}
    assert with_code == {
        "a1111", "compile", "fidelity", "high-resolution", "index", "models", "parallel", "training", "transformers",
        "video",
    }
