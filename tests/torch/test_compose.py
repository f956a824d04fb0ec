"""ToMe beside what diffusers users stack on a pipeline (issue 18), on tiny SD and SDXL pipelines with random
weights: every feature in both orders of set-up (feature then ``patch``, ``patch`` then feature).

Each case asserts that the pipeline runs, its output is finite and differs from the feature alone, the
self-attention of the finest level saw half its tokens, and ``remove`` gives exactly the feature-alone output.
Then size-aware attention through each attention processor (PAG's included) against attention over the
tokens repeated by size, and the clear error for a processor that size-aware attention cannot reach.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch
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
from tome_core.adapters.diffusers_models import build_pipeline
from tome_core.driver import SizeBias
from tome_core.families import TEXT_NONE

SIZE = 32  # image pixels: the tiny VAE downsamples 2x, so 16x16 latents
# Tokens of the finest level with attention at that size: SD's is the latent grid, tiny SDXL's is 2x down.
FINEST_TOKENS = {"sd": 16 * 16, "sdxl": 8 * 8}

Run = Callable[..., np.ndarray]


def call_kwargs(**extra: Any) -> Dict[str, Any]:
    kwargs = dict(prompt="a photo of a cat", num_inference_steps=3, guidance_scale=5.0, output_type="np")
    return {**kwargs, "height": SIZE, "width": SIZE, **extra}


def runner(pipe: Any, method: str = "__call__", **extra: Any) -> Run:
    """``run()``: one seeded call of ``pipe`` (or of its ``method``) with ``extra`` arguments."""
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


def fresh_pipeline(kind: str):
    pipe = build_pipeline(kind)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def feature_alone():
    """``feature_alone(kind, name)``: the output of the feature on a never-patched pipeline (computed once)."""
    cache: Dict[Tuple[str, str], np.ndarray] = {}

    def get(kind: str, name: str) -> np.ndarray:
        if (kind, name) not in cache:
            _, run = FEATURES[name](fresh_pipeline(kind))
            cache[kind, name] = run()
        return cache[kind, name]

    return get


def attn1_token_counts(unet: torch.nn.Module) -> Tuple[List[int], List[Any]]:
    """Token counts every attn1 receives, from pre-hooks registered now (after ToMe's: they see merged inputs)."""
    seen: List[int] = []

    def count(module, args, kwargs):
        hidden_states = args[0] if args else kwargs["hidden_states"]
        seen.append(hidden_states.shape[1])

    handles = [m.register_forward_pre_hook(count, with_kwargs=True) for n, m in unet.named_modules() if n.endswith("attn1")]
    return seen, handles


@pytest.mark.parametrize("order", ["feature_then_patch", "patch_then_feature"])
@pytest.mark.parametrize("kind, name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_feature_composes_with_tome_in_either_order(kind, name, order, feature_alone):
    pipe = fresh_pipeline(kind)
    if order == "feature_then_patch":
        target, run = FEATURES[name](pipe)
        tome.patch(target, ratio=0.5)
    else:
        tome.patch(pipe, ratio=0.5)
        target, run = FEATURES[name](pipe)
    seen, handles = attn1_token_counts(target.unet)
    both = run()
    for handle in handles:
        handle.remove()

    alone = feature_alone(kind, name)
    assert np.isfinite(both).all()
    assert np.abs(both - alone).max() > 1e-4
    full = FINEST_TOKENS[kind]
    assert full // 2 in seen and full not in seen, sorted(set(seen))
    (_, state), = tome.patched_models(target)
    level = state.stats[1 if kind == "sd" else 2]
    assert (level.tokens, level.kept) == (full, full // 2)

    tome.remove(target)
    assert not tome.patched_models(target)
    np.testing.assert_array_equal(run(), alone)
