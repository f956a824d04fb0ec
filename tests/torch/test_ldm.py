"""The ``ldm`` UNets that A1111-style UIs and sdkit load (issue 60): ``patch`` and the tomesd drop-in take the bare
``UNetModel`` and what holds it at ``model.diffusion_model``, in SD 1.x's and SD 2.x's layouts. Oracles: the
unpatched model (``remove`` exact), tomesd's own patch of the same model, the same weights converted by
diffusers' single-file conversion and patched through the diffusers path, and the trained UNet's samples.

``ldm`` comes from the ``stable-diffusion-sdkit`` wheel (installed ``--no-deps`` in the torch nox session);
where it is absent, this file skips."""

from __future__ import annotations

import copy
import importlib
import math
import pathlib
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("ldm.modules.diffusionmodules.openaimodel")
tomesd = pytest.importorskip("tomesd")

import tome_core.torch as tome  # noqa: E402
from ldm.modules.attention import MemoryEfficientCrossAttention  # noqa: E402
from tome_core.adapters.diffusers import FRAMEWORK  # noqa: E402
from tome_core.config import ToMeConfig  # noqa: E402
from tome_core.models.plan import plan_model  # noqa: E402
from tome_tools.ldm_models import (  # noqa: E402
    LAYOUTS, TRAINED_UNET, CalledAsDiffusers, LatentDiffusionShell, build_ldm_unet, from_diffusers, ldm_inputs,
    to_diffusers,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the models are tiny, and two threads wait on each other on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


UNETS = {layout: build_ldm_unet(layout) for layout in LAYOUTS}
INPUTS = {layout: ldm_inputs(unet, 16, 16) for layout, unet in UNETS.items()}


def run(unet, inputs):
    with torch.no_grad():
        return unet(*inputs)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("entry", ["patch-unet", "patch-latent-diffusion", "apply_patch-latent-diffusion", "apply_patch-unet"])
def test_patch_and_the_drop_in_merge_ldm_unets_and_remove_is_exact(layout, entry):
    unet, inputs = copy.deepcopy(UNETS[layout]), INPUTS[layout]
    plain = run(unet, inputs)
    name, held = entry.split("-", 1)
    obj = LatentDiffusionShell(unet) if held == "latent-diffusion" else unet
    getattr(tome, name)(obj, ratio=0.5)
    [(model, state)] = tome.patched_models(obj)
    assert model is unet
    merged = run(unet, inputs)
    assert relative(merged, plain) > 1e-3  # it merged
    assert "1/1 scale: 3 blocks, 256 -> 128 tokens (50% merged" in state.summary()
    tome.remove(obj)
    assert not tome.patched_models(obj)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in unet.modules())
    torch.testing.assert_close(run(unet, inputs), plain, rtol=0, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_levels_and_blocks_are_those_of_the_diffusers_twin(layout):
    """The blocks, their levels and the finest level with attention, read from the ldm UNet's parts, are those
    read from the same weights in diffusers' UNet2DConditionModel, counted in the same order (down, up, middle)."""
    twin = to_diffusers(UNETS[layout], LAYOUTS[layout])
    ours, theirs = plan_model(FRAMEWORK, UNETS[layout], ToMeConfig()), plan_model(FRAMEWORK, twin, ToMeConfig())
    assert ours.levels == theirs.levels == (1, 2, 2, 2, 1, 1, 2)
    assert ours.finest == theirs.finest == 1
    assert [family.name for _, family in ours.blocks] == ["ldm-basic"] * len(theirs.blocks)


# ------------------------------------------------------------------------------------- parity with tomesd


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    size=st.sampled_from([(16, 16), (12, 16), (10, 14)]),
    cell=st.sampled_from([(2, 2), (3, 2), (2, 3), (3, 3)]),
    fraction=st.floats(0.1, 1.0),
    max_downsample=st.sampled_from([1, 2]),
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans()).filter(any),
)
def test_the_drop_in_equals_tomesd_on_ldm_unets(layout, size, cell, fraction, max_downsample, flags):
    """tomesd's own patch of the same LatentDiffusion-shaped object, use_rand=False, over ratio, max_downsample, the
    cell and the merge flags: the outputs agree to 1e-5 relative, and equal the unpatched output after remove."""
    sx, sy = cell
    ratio = math.floor(fraction * (1 - 1 / (sx * sy)) * 1000) / 1000  # at most the cell's bound
    options = dict(
        ratio=ratio, max_downsample=max_downsample, sx=sx, sy=sy, use_rand=False,
        merge_attn=flags[0], merge_crossattn=flags[1], merge_mlp=flags[2],
    )
    inputs = ldm_inputs(UNETS[layout], *size, seed=sum(size))
    plain = run(UNETS[layout], inputs)
    theirs, ours = LatentDiffusionShell(copy.deepcopy(UNETS[layout])), LatentDiffusionShell(copy.deepcopy(UNETS[layout]))
    tomesd.apply_patch(theirs, **options)
    tome.apply_patch(ours, **options)
    reference = run(theirs.model.diffusion_model, inputs)
    assert relative(run(ours.model.diffusion_model, inputs), reference) < 1e-5
    tome.remove_patch(ours)
    torch.testing.assert_close(run(ours.model.diffusion_model, inputs), plain, rtol=0, atol=0)


def test_a_unet_patched_by_tomesd_is_taken_over_and_remove_undoes_both():
    unet, inputs = copy.deepcopy(UNETS["sd1"]), INPUTS["sd1"]
    plain = run(unet, inputs)
    shell = LatentDiffusionShell(unet)
    tomesd.apply_patch(shell, ratio=0.5)
    tome.patch(shell, ratio=0.5)
    assert not any(type(m).__name__ == "ToMeBlock" or "_tome_info" in m.__dict__ for m in unet.modules())
    fresh = tome.patch(copy.deepcopy(UNETS["sd1"]), ratio=0.5)
    torch.testing.assert_close(run(unet, inputs), run(fresh, inputs), rtol=0, atol=0)
    tomesd.apply_patch(shell, ratio=0.5)  # and remove alone undoes tomesd's patch too
    tome.remove(shell)
    assert not unet._forward_pre_hooks and not any(type(m).__name__ == "ToMeBlock" for m in unet.modules())
    torch.testing.assert_close(run(unet, inputs), plain, rtol=0, atol=0)


# ----------------------------------------------------------------------- parity with the diffusers path


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("options", [{}, {"ratio": 0.5}, {"ratio": 0.5, "mode": "kv"}, {"prefer": "speed"}], ids=repr)
def test_ldm_and_diffusers_paths_agree_on_the_same_weights(layout, options):
    """diffusers' single-file conversion of the ldm UNet, patched with the same options through the diffusers path:
    the default (keys and values in cells), ratio=0.5 (ToMe for SD with size-aware attention: the bias added to the
    ldm attention's own softmax, to SDPA's mask in diffusers) and the others agree to 1e-5 relative."""
    unet, inputs = copy.deepcopy(UNETS[layout]), INPUTS[layout]
    twin = to_diffusers(unet, LAYOUTS[layout])
    with torch.no_grad():
        assert relative(twin(*inputs).sample, run(unet, inputs)) < 1e-5  # the conversion itself
    plain = run(unet, inputs)
    tome.patch(unet, **options)
    tome.patch(twin, **options)
    ours = run(unet, inputs)
    with torch.no_grad():
        theirs = twin(*inputs).sample
    assert relative(ours, plain) > 1e-3  # it merged
    assert relative(ours, theirs) < 1e-5
    assert tome.patched_models(unet)[0].state.summary() == tome.patched_models(twin)[0].state.summary()


def test_size_aware_attention_reaches_the_ldm_softmax():
    """With proportional_attn the ldm attention's scores get the merged keys' log sizes: its output differs from
    the plain softmax's and equals the diffusers path's (above); each merged self-attention's softmax saw the bias."""
    unet, inputs = copy.deepcopy(UNETS["sd1"]), INPUTS["sd1"]
    tome.patch(unet, ratio=0.5, proportional_attn=False)
    plain_softmax = run(unet, inputs)
    tome.patch(unet, ratio=0.5)
    seen = []
    for block in (m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"):
        block.attn1.register_forward_pre_hook(lambda m, a: seen.append(m.__dict__.get("_tome_size_bias")))  # after ToMe's
    sized = run(unet, inputs)
    assert relative(sized, plain_softmax) > 1e-4
    seen = [mode for mode in seen if mode is not None]  # the blocks at 1/1 scale merge (max_downsample=1)
    assert len(seen) == 3 and all(mode.softmax and mode.calls == 1 for mode in seen)


def test_ldm_xformers_attention_refuses_size_aware_attention_at_patch_and_runs_the_default():
    """ldm builds MemoryEfficientCrossAttention where xformers imports: its kernel takes no bias, so size-aware
    attention is refused at patch, naming it; the default (cells, no bias) and proportional_attn=False patch."""
    unet = copy.deepcopy(UNETS["sd1"])
    for block in (m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"):
        attn = block.attn1
        block.attn1 = MemoryEfficientCrossAttention(attn.to_q.in_features, heads=attn.heads, dim_head=attn.to_q.out_features // attn.heads)
    with pytest.raises(ValueError, match="proportional_attn=True .*BasicTransformerBlock.attn1's MemoryEfficientCrossAttention computes attention through xformers.ops.memory_efficient_attention, which takes no bias"):
        tome.patch(unet, ratio=0.5)
    assert not tome.patched_models(unet)
    tome.patch(unet)
    tome.patch(unet, ratio=0.5, proportional_attn=False)
    assert tome.patched_models(unet)


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("held, message", [
    (torch.nn.Linear(4, 4), r"LatentDiffusionShell\.model\.diffusion_model is torch\.nn\.modules\.linear\.Linear Linear\(in_features=4.*holds no UNet"),
    ("unet", r"LatentDiffusionShell\.model\.diffusion_model is str 'unet'"),
], ids=["linear", "str"])
def test_a_latent_diffusion_holding_something_else_is_refused_naming_it(held, message):
    shell = LatentDiffusionShell(held)
    for entry in (tome.patch, tome.apply_patch):
        with pytest.raises(ValueError, match=message):
            entry(shell)


# --------------------------------------------------------------------------------- fidelity, trained UNet


def test_the_default_on_the_trained_unet_as_ldm_has_the_diffusers_paths_fidelity():
    """The shipped trained UNet (diffusers) read into an ldm UNetModel through diffusers' conversion run backwards:
    unpatched, the two give the same samples; under the default (min_tokens=0: 1024 tokens), the ldm path's samples
    are those of the diffusers path, so their PSNR against the unpatched samples is the same."""
    from tome_tools import trained
    from tome_tools.diffusers_trained import generate, load

    model = load(trained.shipped("trained-unet"))
    ldm = copy.deepcopy(model)
    ldm.model = CalledAsDiffusers(from_diffusers(model.model, TRAINED_UNET))
    labels = trained.sample_labels(1)[:4]
    reference = generate(model, labels, steps=4)
    assert abs(generate(ldm, labels, steps=4) - reference).max() < 1e-4
    tome.patch(model.model, min_tokens=0)
    tome.patch(ldm.model, min_tokens=0)
    merged, merged_ldm = generate(model, labels, steps=4), generate(ldm, labels, steps=4)
    assert abs(merged_ldm - merged).max() < 1e-4
    psnr, psnr_ldm = trained.psnr(reference, merged), trained.psnr(reference, merged_ldm)
    assert psnr < float("inf") and abs(psnr - psnr_ldm) < 0.01


# ------------------------------------------------------------------------------------------------ docs


def test_a1111_page_snippet_runs_outside_the_clone(guide_code, tmp_path, monkeypatch, capsys):
    """docs/a1111.md's snippet, as a user runs it: from a directory outside the clone, tome_tools unimportable."""
    code, path = guide_code("a1111")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and pathlib.Path(p).resolve() != ROOT])
    for name in [m for m in sys.modules if m == "tome_tools" or m.startswith("tome_tools.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tome_tools")
    namespace: dict = {}
    exec(compile(code, path, "exec"), namespace)
    printed = capsys.readouterr().out
    assert "1/1 scale: 3 blocks" in printed
    assert not namespace["tome"].patched_models(namespace["sd_model"])
