"""The newer families' pipelines (issue #33) patch and run end to end from tiny components, nothing downloaded:
Flux.2 (and its edit call, Klein), Qwen-Image (edit, ControlNet), Z-Image, Chroma, HunyuanVideo, LTX, CogVideoX...

Oracle: the unpatched pipeline. At ratio 0.5 the attention modules see fewer image tokens than unpatched (never
more), the output is finite and differs; after ``remove`` the output is bit-identical to the unpatched one.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

import tome_core.torch as tome
from tome_tools.diffusers_zoo_pipelines import ZOO_PIPELINES, build_zoo_pipeline


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: these models are tiny, and on a busy 2-core machine two threads wait on each other (the
    file takes several times longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _models(pipe) -> List[torch.nn.Module]:
    """The pipeline's transformer and ControlNet, the modules ToMe patches."""
    return [m for m in (getattr(pipe, "transformer", None), getattr(pipe, "controlnet", None)) if m is not None]


def _run(pipe, call: Dict[str, Any]) -> Tuple[torch.Tensor, List[Tuple[str, int]]]:
    """The pipeline's output latents and, per attention call in its models, (module name, tokens it was given).
    The hooks are registered now, after any of ToMe's: they see what the attention really gets."""
    seen: List[Tuple[str, int]] = []

    def record(module, args, kwargs, name):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        seen.append((name, hidden.shape[1] if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else -1))

    handles = [
        module.register_forward_pre_hook(lambda m, a, k, n=f"{i}.{name}": record(m, a, k, n), with_kwargs=True)
        for i, model in enumerate(_models(pipe))
        for name, module in model.named_modules()
        if type(module).__name__.endswith("Attention")
    ]
    torch.manual_seed(0)  # CogView4 Control samples its control image's latents from torch's global generator
    try:
        with torch.no_grad():
            output = pipe(num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent", **call)[0]
    finally:
        for handle in handles:
            handle.remove()
    return torch.as_tensor(output), seen  # DiT's pipeline always decodes: a numpy image


# Pipelines whose patched call fails today: a driver gap, each with its reproduction in the reason.
KNOWN_FAILURES = {
}


def _kinds():
    for kind in sorted(ZOO_PIPELINES):
        if kind in KNOWN_FAILURES:
            raises, reason = KNOWN_FAILURES[kind]
            yield pytest.param(kind, marks=pytest.mark.xfail(strict=True, raises=raises, reason=reason))
        else:
            yield kind


@pytest.mark.parametrize("kind", list(_kinds()))
def test_pipeline_patches_runs_and_removes_against_the_unpatched_pipeline(kind):
    pipe, call = build_zoo_pipeline(kind)
    pipe.set_progress_bar_config(disable=True)
    reference, plain = _run(pipe, call)
    assert plain and torch.isfinite(reference).all()

    tome.patch(pipe, ratio=0.5)
    patched = tome.patched_models(pipe)
    assert {id(m) for m, _ in patched} == {id(m) for m in _models(pipe)}
    output, merged = _run(pipe, call)
    assert [n for n, _ in merged] == [n for n, _ in plain]
    fewer = [n for (n, tokens), (_, before) in zip(merged, plain) if tokens < before]
    more = [n for (n, tokens), (_, before) in zip(merged, plain) if tokens > before]
    assert fewer and not more, (fewer, more)
    for index in range(len(_models(pipe))):  # every model merges (the ControlNet too)
        assert any(n.startswith(f"{index}.") for n in fewer), (index, fewer)
    assert torch.isfinite(output).all() and float((output - reference).abs().max()) > 1e-6

    tome.patch(pipe)  # the default options
    assert torch.isfinite(_run(pipe, call)[0]).all()

    tome.remove(pipe)
    assert not tome.patched_models(pipe)
    assert torch.equal(_run(pipe, call)[0], reference)
