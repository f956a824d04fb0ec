"""ToMe beside what diffusers users stack on a pipeline (issue 18), on tiny SD and SDXL pipelines with random
weights: every feature in both orders of set-up (feature then ``patch``, ``patch`` then feature).

Each case asserts that the pipeline runs, its output is finite and differs from the feature alone, the
self-attention of the finest level saw half its tokens, and ``remove`` gives exactly the feature-alone output.
Then size-aware attention through each attention processor (PAG's included) against attention over the
tokens repeated by size, a processor slicing the batch into SDPA calls, and the clear errors for a processor
that size-aware attention cannot reach and for T-GATE handing back an attention output merged at another step.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import (
    Attention,
    AttnProcessor,
    AttnProcessor2_0,
    FusedAttnProcessor2_0,
    PAGCFGIdentitySelfAttnProcessor2_0,
    PAGIdentitySelfAttnProcessor2_0,
    SlicedAttnProcessor,
)

import tome_core.torch as tome
from tome_core import bipartite_match, get_ops, merge, unmerge
from tome_core.adapters.diffusers import FRAMEWORK, MASK_PROCESSORS
from tome_tools.diffusers_models import build_pipeline
from tome_core.hooks.attention_bias import SizeBias
from tome_core.models.families import TEXT_NONE

SIZE = 32  # image pixels: the tiny VAE downsamples 2x, so 16x16 latents
# Tokens of the finest level with attention at that size: SD's is the latent grid, tiny SDXL's is 2x down.
FINEST_TOKENS = {"sd": 16 * 16, "sdxl": 8 * 8}

Run = Callable[..., np.ndarray]


def call_kwargs(**extra: Any) -> Dict[str, Any]:
    kwargs = dict(prompt="a photo of a cat", num_inference_steps=3, guidance_scale=5.0, output_type="np")
    return {**kwargs, "height": SIZE, "width": SIZE, **extra}


def runner(pipe: Any, method: str = "__call__", **extra: Any) -> Run:
    """``run()``: one seeded call of ``pipe`` (or of its ``method``) with ``extra`` arguments."""
    pipe.set_progress_bar_config(disable=True)
    call = getattr(pipe, method)
    return lambda: call(**call_kwargs(**extra), generator=torch.Generator().manual_seed(0)).images


# ------------------------------------------------------------------------------------------------- features
# Each feature sets itself up on a pipeline and returns (the pipeline the user then holds, its seeded call).


def lora(pipe):
    from peft import LoraConfig

    torch.manual_seed(5)  # init_lora_weights=False: random, non-zero lora_B
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False)
    pipe.unet.add_adapter(config)
    return pipe, runner(pipe, cross_attention_kwargs={"scale": 0.5})


def ip_adapter(pipe):
    """An IP-Adapter from a state dict of random weights (the layout ``load_ip_adapter`` reads), no download."""
    unet, embed = pipe.unet, 16
    dim = unet.config.cross_attention_dim
    generator = torch.Generator().manual_seed(7)
    randn = lambda *shape: torch.randn(*shape, generator=generator) * 0.1
    modules = dict(unet.named_modules())
    ip_layers = {}
    for index, name in enumerate(unet.attn_processors):
        if name.endswith("attn2.processor"):
            hidden = modules[name[: -len(".processor")]].to_k.out_features
            ip_layers.update({f"{index}.to_k_ip.weight": randn(hidden, dim), f"{index}.to_v_ip.weight": randn(hidden, dim)})
    image_proj = {"proj.weight": randn(4 * dim, embed), "proj.bias": randn(4 * dim), "norm.weight": torch.ones(dim), "norm.bias": torch.zeros(dim)}
    unet._load_ip_adapter_weights([{"image_proj": image_proj, "ip_adapter": ip_layers}])
    image_embeds = torch.randn(2, 1, embed, generator=generator)  # (negative, positive) for guidance
    return pipe, runner(pipe, ip_adapter_image_embeds=[image_embeds])


def attention_slicing(pipe):
    pipe.enable_attention_slicing("max")
    return pipe, runner(pipe)


def classic_processor(pipe):
    pipe.unet.set_attn_processor(AttnProcessor())
    return pipe, runner(pipe)


def fused_qkv(pipe):
    pipe.fuse_qkv_projections()
    return pipe, runner(pipe)


def freeu(pipe):
    pipe.enable_freeu(s1=0.9, s2=0.2, b1=1.5, b2=1.6)
    return pipe, runner(pipe)


def sag(pipe):
    from diffusers import StableDiffusionSAGPipeline

    sag_pipe = StableDiffusionSAGPipeline.from_pipe(pipe)
    return sag_pipe, runner(sag_pipe, sag_scale=0.75)


def layerwise_casting(pipe):
    pipe.unet.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
    return pipe, runner(pipe)


def deepcache(pipe):
    from DeepCache import DeepCacheSDHelper

    helper = DeepCacheSDHelper(pipe=pipe)
    helper.set_params(cache_interval=2, cache_branch_id=0)  # 3 steps: full, cached, full
    helper.enable()
    return pipe, runner(pipe)


def tgate(pipe):
    import tgate as tgate_package

    loader = tgate_package.TgateSDXLLoader if "XL" in type(pipe).__name__ else tgate_package.TgateSDLoader
    pipe = loader(pipe)
    # 5 steps: cross-attention cached at step 3 and reused at step 4
    return pipe, runner(pipe, "tgate", gate_step=4, num_inference_steps=5)


def pag(pipe):
    from diffusers import StableDiffusionPAGPipeline, StableDiffusionXLPAGPipeline

    cls = StableDiffusionXLPAGPipeline if "XL" in type(pipe).__name__ else StableDiffusionPAGPipeline
    pag_pipe = cls.from_pipe(pipe, pag_applied_layers=["down"])
    return pag_pipe, runner(pag_pipe, pag_scale=3.0)


FEATURES: Dict[str, Callable[[Any], Tuple[Any, Run]]] = {
    f.__name__: f
    for f in (lora, ip_adapter, attention_slicing, classic_processor, fused_qkv, freeu, sag, layerwise_casting, deepcache, tgate, pag)
}
SD_ONLY = {"sag"}  # diffusers has no SDXL SAG pipeline
CASES = [(kind, name) for kind in ("sd", "sdxl") for name in FEATURES if kind == "sd" or name not in SD_ONLY]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these models are tiny, and on a busy 2-core machine two threads wait on each other
    (a pipeline call takes ~0.1 s on one thread, up to ~1 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


PATCHES = {"ratio=0.5": {"ratio": 0.5}, "default": {}}  # ToMe for SD, and what patch(pipe) runs


@pytest.fixture(scope="module")
def matrices(compose_matrix):
    return {name: compose_matrix(build_pipeline, tome.patch, FEATURES, options) for name, options in PATCHES.items()}


def attn1_token_counts(unet: torch.nn.Module) -> Tuple[List[Tuple[str, int]], List[Any]]:
    """(processor class, token count) of every attn1 call, from pre-hooks registered now (after ToMe's: they see
    merged inputs)."""
    seen: List[Tuple[str, int]] = []

    def count(module, args, kwargs):
        hidden_states = args[0] if args else kwargs["hidden_states"]
        seen.append((type(module.processor).__name__, hidden_states.shape[1]))

    return seen, [m.register_forward_pre_hook(count, with_kwargs=True) for n, m in unet.named_modules() if n.endswith("attn1")]


def attn1_counts(unet: torch.nn.Module, seen: List[Tuple[str, int, int]]) -> List[Any]:
    """Appends (processor class, queries, keys) of every attn1 call to ``seen``, from pre-hooks registered now
    (after ToMe's: they see merged inputs; the ``kv`` arrangement hands the keys over as
    ``encoder_hidden_states``)."""

    def count(module, args, kwargs):
        hidden_states = args[0] if args else kwargs["hidden_states"]
        keys = kwargs.get("encoder_hidden_states")
        keys = hidden_states if keys is None else keys
        seen.append((type(module.processor).__name__, hidden_states.shape[1], keys.shape[1]))

    return [m.register_forward_pre_hook(count, with_kwargs=True) for n, m in unet.named_modules() if n.endswith("attn1")]


@pytest.mark.parametrize("patched", PATCHES)
@pytest.mark.parametrize("order", ["feature_then_patch", "patch_then_feature"])
@pytest.mark.parametrize("kind, name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_feature_composes_with_tome_in_either_order(kind, name, order, patched, matrices):
    """With ratio=0.5 the finest level's self-attention sees half its tokens; with the default, its keys and
    values pooled in 2x2 cells where the processor takes them apart from the queries, ToMe for SD's half
    elsewhere (PAG's processors, fused projections), as the summary says."""
    matrix = matrices[patched]
    target, run = matrix.set_up(kind, name, order)
    seen: List[Tuple[str, int, int]] = []
    handles = attn1_counts(target.unet, seen)
    both = run()
    for handle in handles:
        handle.remove()

    expected = matrix.reference(kind, name)
    assert np.isfinite(both).all()
    assert np.abs(both - expected["alone"]).max() > 1e-4
    np.testing.assert_array_equal(both, expected["with_tome"])  # the order of set-up does not matter
    full = FINEST_TOKENS[kind]
    pairs = {(queries, keys) for _, queries, keys in seen}
    (_, state), = tome.patched_models(target)
    level = 1 if kind == "sd" else 2
    if patched == "ratio=0.5":
        assert (full // 2, full // 2) in pairs and not {(full, full), (full, full // 4)} & pairs, sorted(set(seen))
        assert (state.ledger.stats[level].tokens, state.ledger.stats[level].kept) == (full, full // 2)
    else:
        fallback = name in ("pag", "fused_qkv")
        assert (full, full) not in pairs and (full // 2, full // 2) in pairs or not fallback, sorted(set(seen))
        assert ((full, full // 4) in pairs) == (name != "fused_qkv"), sorted(set(seen))
        counted = [*state.ledger.stats.items(), *((lv, stats) for (lv, _), stats in state.ledger.fallbacks.items())]
        assert {(lv, s.tokens, s.kept) for lv, s in counted} >= ({(level, full, full // 2)} if fallback else {(level, full, full // 4)})
        assert ("so ToMe for SD's arrangement runs there" in state.summary()) == fallback
    if name == "pag":  # PAG's own processor (set for the call) ran on the merged tokens
        assert ("PAGCFGIdentitySelfAttnProcessor2_0", full // 2, full // 2) in seen, sorted(set(seen))

    tome.remove(target)
    assert not tome.patched_models(target)
    np.testing.assert_array_equal(run(), expected["alone"])


# ------------------------------------------------------------------------------- processors, one by one


def fused(attn: Attention) -> FusedAttnProcessor2_0:
    attn.fuse_projections()
    return FusedAttnProcessor2_0()


# (processor factory, its route, how many equal parts of the batch attend; the last part of a PAG batch is
# the perturbed branch, which attends to nothing but itself)
PROCESSORS = {
    "sdpa": (lambda attn: AttnProcessor2_0(), "sdpa", 1),
    "classic": (lambda attn: AttnProcessor(), "mask", 1),
    "sliced": (lambda attn: SlicedAttnProcessor(slice_size=1), "mask", 1),
    "fused": (fused, "sdpa", 1),
    "pag": (lambda attn: PAGIdentitySelfAttnProcessor2_0(), "sdpa", 2),
    "pag-cfg": (lambda attn: PAGCFGIdentitySelfAttnProcessor2_0(), "sdpa", 3),
}


def merged_tokens(items: int, seed: int = 3):
    """``items`` random 8x8 token grids merged by half, each item by its own match; (merged, match, the merged
    tokens repeated by size: every original token holds its merged token)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(items, 64, 32, generator=generator)
    match = bipartite_match(get_ops(x), x, 8, 8, 2, 2, 32, None)
    assert len({tuple(s.flatten().tolist()) for s in match.sizes}) == items  # no two items share their sizes
    merged = merge(x, match)
    return merged, match, unmerge(merged, match)


def size_aware_call(attn: Attention, merged: torch.Tensor, match) -> torch.Tensor:
    """``attn`` on merged tokens, armed with their sizes as a patched self-attention is."""
    with torch.no_grad():
        args, kwargs = FRAMEWORK.size_aware(attn, (merged,), {}, SizeBias(match, TEXT_NONE, merged))
        try:
            out = attn(*args, **kwargs)
        finally:
            FRAMEWORK.size_aware_done(attn, computed=True)
    assert not torch.overrides._get_current_function_mode_stack()  # the SDPA mode is gone after the call
    return out


def attention_over(attn: Attention, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The oracle: diffusers' classic processor, no mask, queries attending over ``keys``."""
    processor = attn.processor
    attn.set_processor(AttnProcessor())
    try:
        with torch.no_grad():
            return attn(queries, encoder_hidden_states=keys)
    finally:
        attn.set_processor(processor)


@pytest.mark.parametrize("processor", PROCESSORS)
def test_size_aware_attention_through_each_processor_equals_attention_over_repeated_tokens(processor):
    """Merged queries attend over keys whose log sizes are added: equal to attention over the tokens repeated by
    size. PAG's processors attend over the leading parts of the batch only: the bias rows must be those items'
    own sizes (every item has its own match here), and the perturbed part stays PAG's identity attention
    (its value projection) over the same merged tokens."""
    make, route, parts = PROCESSORS[processor]
    torch.manual_seed(3)
    attn = Attention(query_dim=32, heads=2, dim_head=16).eval()
    attn.set_processor(make(attn))
    assert (type(attn.processor).__name__ in MASK_PROCESSORS) == (route == "mask")
    per_part = 2
    merged, match, repeated = merged_tokens(parts * per_part)
    out = size_aware_call(attn, merged, match)
    guided = len(merged) if parts == 1 else (parts - 1) * per_part
    torch.testing.assert_close(out[:guided], attention_over(attn, merged[:guided], repeated[:guided]), rtol=1e-4, atol=1e-5)
    plain = attention_over(attn, merged[:guided], merged[:guided])
    assert not torch.allclose(out[:guided], plain, atol=1e-4)  # the sizes made a difference
    if guided < len(merged):
        with torch.no_grad():
            identity = attn.to_out[0](attn.to_v(merged[guided:]))
        torch.testing.assert_close(out[guided:], identity, rtol=1e-5, atol=1e-6)


class PerItemSDPAProcessor:
    """Calls SDPA once per batch item (as a memory-saving processor slicing the batch would)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        outputs = []
        for item in hidden_states.split(1):
            q, k, v = (f(item).unflatten(-1, (attn.heads, -1)).transpose(1, 2) for f in (attn.to_q, attn.to_k, attn.to_v))
            outputs.append(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        return attn.to_out[1](attn.to_out[0](torch.cat(outputs)))


def test_a_processor_slicing_the_batch_into_sdpa_calls_gets_each_item_its_own_sizes():
    torch.manual_seed(3)
    attn = Attention(query_dim=32, heads=2, dim_head=16).eval()
    attn.set_processor(PerItemSDPAProcessor())
    merged, match, repeated = merged_tokens(3)
    out = size_aware_call(attn, merged, match)
    torch.testing.assert_close(out, attention_over(attn, merged, repeated), rtol=1e-4, atol=1e-5)


class ManualAttnProcessor:
    """Computes attention itself (no SDPA) and ignores ``attention_mask``: size-aware attention cannot reach it."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query, key, value = (attn.head_to_batch_dim(f(t)) for f, t in ((attn.to_q, hidden_states), (attn.to_k, context), (attn.to_v, context)))
        out = attn.batch_to_head_dim(torch.bmm(attn.get_attention_scores(query, key), value))
        return attn.to_out[1](attn.to_out[0](out))


def test_a_processor_size_aware_attention_cannot_reach_gets_a_clear_error_and_runs_without_it():
    pipe = build_pipeline("sd")
    target, run = classic_processor(pipe)
    alone = run()
    tome.patch(pipe, ratio=0.5)
    pipe.unet.set_attn_processor(ManualAttnProcessor())  # set after patch: the route is chosen per call
    assert "ManualAttnProcessor" not in MASK_PROCESSORS
    with pytest.raises(RuntimeError, match=r"proportional_attn=True: .*ManualAttnProcessor.*proportional_attn=False"):
        run()
    assert not torch.overrides._get_current_function_mode_stack()
    tome.patch(pipe, ratio=0.5, proportional_attn=False)
    seen, _ = attn1_token_counts(pipe.unet)
    merged = run()
    tokens = {count for _, count in seen}
    assert 128 in tokens and 256 not in tokens and np.abs(merged - alone).max() > 1e-4
    tome.remove(pipe)
    np.testing.assert_allclose(run(), alone, atol=1e-5)  # the same attention as the classic processor's


def test_the_clear_error_also_comes_when_the_pipeline_runs_inside_an_except_block():
    pipe = build_pipeline("sd")
    run = runner(pipe)
    tome.patch(pipe, ratio=0.5)
    pipe.unet.set_attn_processor(ManualAttnProcessor())
    try:
        raise KeyError("an error the caller is handling")
    except KeyError:
        with pytest.raises(RuntimeError, match=r"proportional_attn=True: .*ManualAttnProcessor"):
            run()


# ------------------------------------------------------------------------------------------ known limits

# T-GATE caches attention outputs inside the attention module, where ToMe's tokens are merged, and hands them
# back at later steps (whose matches differ). Each case: T-GATE's settings, the sub-layer, ToMe's options, and
# the step that hands back a cached output with the steps it was cached from (a mean over the CFG halves when
# T-GATE drops guidance after its gate step).
TGATE_REUSE = {
    # T-GATE's defaults (gate_step=10, sp_interval=5, warm_up=2) reuse self-attention in its first phase;
    # these do it in 5 steps: cached at step 2, handed back at step 3.
    "self-attention, size-aware": (dict(gate_step=5, warm_up=1, sp_interval=2), "attn1", {}, (3, 2)),
    "self-attention, proportional_attn=False": (dict(gate_step=5, warm_up=1, sp_interval=2), "attn1", {"proportional_attn": False}, (3, 2)),
    # cross-attention (merged only with merge_crossattn=True): cached at step 3 as the mean of the CFG halves
    "cross-attention, merge_crossattn=True": (dict(gate_step=4), "attn2", {"merge_crossattn": True}, (4, 3)),
}


def sublayer_outputs(unet: torch.nn.Module, child: str) -> Tuple[Dict[str, List[torch.Tensor]], List[Any]]:
    """Every ``child`` sub-layer's output per call, from forward hooks registered now (after ToMe's: they see
    it unmerged)."""
    outputs: Dict[str, List[torch.Tensor]] = {}
    handles = [
        module.register_forward_hook(lambda m, args, out, name=name: outputs.setdefault(name, []).append(out))
        for name, module in unet.named_modules()
        if name.endswith(child)
    ]
    return outputs, handles


def handed_back_and_cached(calls: List[torch.Tensor], steps: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
    reused, cached = calls[steps[0]], calls[steps[1]]
    if len(cached) != len(reused):  # T-GATE keeps the mean of the CFG halves
        cached = sum(cached.chunk(len(cached) // len(reused))) / (len(cached) // len(reused))
    return reused, cached


@pytest.mark.parametrize("case", TGATE_REUSE)
def test_tgate_handing_back_a_merged_cache_is_refused_clearly(case):
    import tgate as tgate_package

    settings, child, options, steps = TGATE_REUSE[case]
    pipe = tgate_package.TgateSDLoader(build_pipeline("sd"))
    run = runner(pipe, "tgate", num_inference_steps=5, **settings)
    unpatched, handles = sublayer_outputs(pipe.unet, child)
    run()
    for calls in unpatched.values():  # what T-GATE does to an unpatched model
        torch.testing.assert_close(*handed_back_and_cached(calls, steps), rtol=0, atol=1e-7)
    for handle in handles:
        handle.remove()
    # A cache merged by another step's match is refused clearly, by patch when T-GATE already holds one (its
    # cross-attention cache outlives the call), else at the step that would hand it back; never unmerged
    # by the wrong match.
    with pytest.raises(ValueError, match="T-GATE hands back its output cached at an earlier step"):
        tome.patch(pipe, ratio=0.5, **options)
        run()
