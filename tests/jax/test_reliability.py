"""Reliability of the jax adapter (issue 6), item by item, where test_unet.py / test_pipelines.py /
test_backend.py do not already cover it (see the audit in the module-level comments below).

Oracles: the unpatched module (exact equality where nothing may change), token counts computed here from
the grid each transformer really sees (``N - int(N * ratio)`` when the grid holds a full cell), the float32
model for half precision, the files an unpatched model saves, and the RNG states before the call.

Compiling a UNet costs seconds on CPU: shape questions use ``jax.eval_shape`` (a trace, no compilation),
values use the 2-level ``small`` model and the shared jitted ``apply`` (one compilation per module and
input shapes, shared with test_unet.py).
"""

from __future__ import annotations

import copy
import random
import threading
import warnings
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from diffusers import FlaxAutoencoderKL, FlaxDDIMScheduler, FlaxStableDiffusionPipeline, FlaxUNet2DConditionModel
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import tome_core.jax as tome
from tome_core.adapters import flax as tome_flax
from tome_tools.flax_models import build_unet, param_shapes
from tome_tools.presets import TINY_VAE

# The 2-level "small" UNet: 3 blocks at 1/1 (down 0, up 1 x2) and 1 in the middle (1/2); its ControlNet:
# down 0 (1/1) and the middle (1/2).
SMALL_BLOCKS = {1: 3, 2: 1}
CONTROLNET_BLOCKS = {1: 1, 2: 1}
FEW = settings(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))  # + max_examples


def halved(n: int, factor: int) -> int:
    """A side after the UNet's stride-2 convolutions (padding 1): ceil(n / 2) per halving."""
    while factor > 1:
        n, factor = -(-n // 2), factor // 2
    return n


def expected_tokens(h, w, levels_blocks, ratio, sx=2, sy=2, merged_levels=(1, 2)):
    """``Counter`` of the tokens each attn1 runs on for an ``h x w`` latent."""
    counts = Counter()
    for factor, blocks in levels_blocks.items():
        gh, gw = halved(h, factor), halved(w, factor)
        n = gh * gw
        full_cell = (gh // sy) * (gw // sx) > 0
        counts[n - int(n * ratio) if factor in merged_levels and full_cell else n] += blocks
    return counts


def quiet_patch(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nothing-merges warnings are tested below
        return tome.patch(model, **options)


def with_dtype(unet, dtype):
    config = {k: v for k, v in dict(unet.config).items() if not k.startswith("_")}
    return unet if dtype == jnp.float32 else type(unet)(**config, dtype=dtype)


@pytest.fixture(scope="module")
def pipe(small):
    """A FlaxStableDiffusionPipeline holding the 2-level UNet. Never run here (test_pipelines.py runs full
    ones), so it goes without text encoder and VAE: ToMe patches only its ``unet`` (and ``controlnet``)."""
    parts = dict(vae=None, text_encoder=None, tokenizer=None, safety_checker=None, feature_extractor=None)
    return FlaxStableDiffusionPipeline(unet=small[0], scheduler=FlaxDDIMScheduler(), **parts)


# ------------------------------------------------------------------------------------------------ errors
# test_unet.py: ratio above 1 - 1/(sx*sy), max_downsample=3, use_rand=1, an unknown name, reuse_steps=2,
# objects without a UNet, seed=1.5; test_pipelines.py: a pipeline without models. Here: the rest of the
# list, through the model and the pipeline entry points, and nothing patched after an error.


def test_bad_options_raise_through_every_entry_point_and_patch_nothing(small, pipe, bad_option):
    options, error, message = bad_option
    unet, _ = small
    for entry in (tome.patch, tome.apply_tome):
        with pytest.raises(error, match=message):
            entry(unet, **options)
    pipe_unet, pipe_class = pipe.unet, type(pipe)
    with pytest.raises(error, match=message):
        tome.patch(pipe, **options)
    assert pipe.unet is pipe_unet and type(pipe) is pipe_class and "_tome_key" not in pipe.__dict__
    assert tome.patched_models(pipe) == []


def test_a_traced_key_as_seed_and_models_without_attention_are_refused(small):
    unet, _ = small
    with pytest.raises(TypeError, match="seed= must be an int or a concrete jax.random key"):
        jax.jit(lambda key: tome.patch(unet, seed=key) and 0)(jax.random.key(0))
    with pytest.raises(TypeError, match=r"(?s)got diffusers\S*FlaxAutoencoderKL.*It takes .* or a FlaxControlNetModel"):
        tome.patch(FlaxAutoencoderKL(**TINY_VAE))


def test_a_patch_that_merges_nothing_warns_and_indeed_merges_nothing(small, attn1_tokens, nothing_merges):
    options, reason = nothing_merges
    unet, params = small
    with pytest.warns(UserWarning, match=f"ToMe patch on FlaxUNet2DConditionModel merges no tokens: {reason}"):
        patched = tome.patch(unet, **options)
    sample, context = jnp.zeros((2, 4, 16, 16)), jnp.zeros((2, 7, 32))
    seen = attn1_tokens(patched.apply, {"params": params}, sample, jnp.ones((2,)), context)
    assert Counter(n for _, _, n in seen) == expected_tokens(16, 16, SMALL_BLOCKS, 0.5, merged_levels=())


def test_patches_that_merge_something_do_not_warn(small):
    unet, _ = small
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tome.patch(unet)
        tome.patch(unet, max_downsample=2, level_ratios={2: 0.0})
        tome.patch(unet, ratio=0.0, max_downsample=2, level_ratios={2: 0.5})


# ------------------------------------------------------------------------------------------------ shapes
# test_unet.py: batch 1 and 3 (token counts), 16x24 and 20x28 latents (a 5x7 grid), ratio 0 exact, bfloat16.
# Here: property tests over batch, size, aspect, cell size and ratio (the Flax UNet upsamples without
# cropping, so it needs even sides at two levels; its ControlNet, a down path only, takes any size, e.g.
# 63x65: odd at every level), then values for float16, odd sizes and CFG batches.


@st.composite
def cells_and_ratio(draw):
    sx, sy = draw(st.integers(1, 3), label="sx"), draw(st.integers(1, 3), label="sy")
    fraction = draw(st.sampled_from([0.0, 0.3, 0.5, 1.0]), label="fraction of the reachable ratio")
    return sx, sy, fraction * (1 - 1 / (sx * sy))


@settings(FEW, max_examples=3)
@given(batch=st.integers(1, 3), half_h=st.integers(1, 16), half_w=st.integers(1, 16), cells=cells_and_ratio(),
       use_rand=st.booleans())
@example(batch=1, half_h=16, half_w=4, cells=(2, 2, 0.5), use_rand=True)  # 4:1
@example(batch=3, half_h=1, half_w=8, cells=(2, 2, 0.75), use_rand=True)  # a 1x8 grid at 1/2
def test_any_even_latent_merges_the_unet_exactly_and_keeps_its_shape(small, attn1_tokens, batch, half_h, half_w,
                                                                     cells, use_rand):
    unet, params = small
    sx, sy, ratio = cells
    h, w = 2 * half_h, 2 * half_w
    model = quiet_patch(unet, ratio=ratio, sx=sx, sy=sy, max_downsample=2, use_rand=use_rand, seed=h * w)
    sample, context = jnp.zeros((batch, 4, h, w)), jnp.zeros((batch, 7, 32))
    outputs = []
    seen = attn1_tokens(lambda: outputs.append(model.apply({"params": params}, sample, jnp.ones((batch,)), context)))
    assert Counter(n for _, _, n in seen) == expected_tokens(h, w, SMALL_BLOCKS, ratio, sx, sy)
    assert outputs[0].sample.shape == sample.shape and outputs[0].sample.dtype == jnp.float32


@settings(FEW, max_examples=5)
@given(batch=st.integers(1, 3), h=st.integers(1, 40), w=st.integers(1, 40), cells=cells_and_ratio(),
       use_rand=st.booleans())
@example(batch=1, h=63, w=65, cells=(2, 2, 0.5), use_rand=True)  # odd at every level
@example(batch=2, h=40, w=10, cells=(2, 2, 0.75), use_rand=True)  # 4:1, 5 columns at 1/2
@example(batch=1, h=1, w=3, cells=(2, 1, 0.5), use_rand=True)  # one token high
def test_any_latent_merges_the_controlnet_exactly(small_controlnet, attn1_tokens, batch, h, w, cells, use_rand):
    controlnet, params = small_controlnet
    sx, sy, ratio = cells
    model = quiet_patch(controlnet, ratio=ratio, sx=sx, sy=sy, max_downsample=2, use_rand=use_rand)
    sample, context = jnp.zeros((batch, 4, h, w)), jnp.zeros((batch, 7, 32))
    cond = jnp.zeros((batch, 3, 2 * h, 2 * w))  # its conditioning embedding halves once
    outputs = []
    seen = attn1_tokens(lambda: outputs.append(
        model.apply({"params": params}, sample, jnp.ones((batch,)), context, cond, return_dict=False)))
    assert Counter(n for _, _, n in seen) == expected_tokens(h, w, CONTROLNET_BLOCKS, ratio, sx, sy)
    down, mid = outputs[0]
    grids = {(h, w), (halved(h, 2), halved(w, 2))}
    assert all(r.shape[0] == batch and r.shape[1:3] in grids for r in down)
    assert mid.shape == (batch, halved(h, 2), halved(w, 2), 64)


def test_float16_model_keeps_its_dtype_and_its_output_is_finite_and_close_to_float32(small, inputs, apply, rel):
    """(bfloat16: test_unet.py, with the same oracle.)"""
    unet, params = small
    sample, timesteps, context = inputs
    model = tome.patch(with_dtype(unet, jnp.float16), ratio=0.5, seed=1)
    seen = []

    def spy(next_fun, args, kwargs, ctx):  # what reaches attn1's query projection, in which dtype
        if ctx.method_name == "__call__" and ctx.module.name == "to_q" and ctx.module.parent.name == "attn1":
            seen.append((int(args[0].shape[1]), args[0].dtype))
        return next_fun(*args, **kwargs)

    half_inputs = (sample.astype(jnp.float16), timesteps, context.astype(jnp.float16))
    with nn.intercept_methods(spy):  # merged tokens reach attn1 in float16
        jax.eval_shape(lambda: model.apply({"params": params}, *half_inputs))
    assert Counter(seen) == Counter({(128, jnp.dtype(jnp.float16)): 3, (64, jnp.dtype(jnp.float16)): 1})
    out = apply(model, params, *half_inputs)
    assert out.dtype == jnp.float16 and out.shape == sample.shape
    assert np.isfinite(np.asarray(out, np.float32)).all()
    reference = apply(tome.patch(unet, ratio=0.5, seed=1), params, *inputs)
    merged_away = rel(reference, apply(unet, params, *inputs))  # what merging changes
    assert rel(out, reference) < min(0.05, merged_away / 4)  # rounding (~0.02) only: the same tokens merged


def test_latent_odd_at_every_level_runs_merged_and_finite(small_controlnet):
    """63x65 latents give 63x65 and 32x33 grids: leftover rows and columns at both merged levels."""
    controlnet, params = small_controlnet
    rng = np.random.default_rng(7)
    sample = jnp.asarray(rng.standard_normal((1, 4, 63, 65)), jnp.float32)
    context = jnp.asarray(rng.standard_normal((1, 7, 32)), jnp.float32)
    cond = jnp.asarray(rng.random((1, 3, 126, 130)), jnp.float32)
    args = (sample, jnp.array([500]), context, cond)
    model = tome.patch(controlnet, ratio=0.5, max_downsample=2)
    plain = jax.eval_shape(lambda: controlnet.apply({"params": params}, *args, return_dict=False))
    seen = []

    def spy(next_fun, call_args, call_kwargs, ctx):
        if ctx.method_name == "__call__" and ctx.module.name == "to_q" and ctx.module.parent.name == "attn1":
            seen.append(int(call_args[0].shape[1]))
        return next_fun(*call_args, **call_kwargs)

    with nn.intercept_methods(spy):  # active while jit traces
        down, mid = jax.jit(lambda p: model.apply({"params": p}, *args, return_dict=False))(params)
    assert sorted(seen) == [32 * 33 - int(32 * 33 * 0.5), 63 * 65 - int(63 * 65 * 0.5)]
    assert [d.shape for d in down] == [d.shape for d in plain[0]] and mid.shape == plain[1].shape
    assert all(np.isfinite(np.asarray(d)).all() for d in (*down, mid))


def test_cfg_halves_share_one_partition(small, inputs, apply, rel):
    """Identical items merge identically only if every item of the batch uses the same partition (an odd
    batch: the test after the next section)."""
    unet, params = small
    repeated = (jnp.repeat(inputs[0][:1], 2, axis=0), inputs[1], jnp.repeat(inputs[2][:1], 2, axis=0))
    cfg = np.asarray(apply(tome.patch(unet, ratio=0.5, seed=1), params, *repeated))
    np.testing.assert_array_equal(cfg[1], cfg[0])
    assert rel(cfg, apply(unet, params, *repeated)) > 1e-3  # and merging changed the output


# ------------------------------------------------------------------------------------------------ lifecycle
# test_unet.py: patch twice = patch once with the newer options, remove gives the original (also on an
# unpatched model), patched init has the same parameter tree; test_pipelines.py: a pipeline comes back bit
# for bit after remove. Here: saving, copies, and pipelines.


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_save_pretrained_writes_the_unpatched_files_and_they_load_unpatched(small, attn1_tokens, tmp_path):
    unet, params = small
    patched = tome.patch(unet, ratio=0.5, merge_mlp=True)
    unet.save_pretrained(tmp_path / "plain", params=params)
    patched.save_pretrained(tmp_path / "patched", params=params)
    plain_files = _files(tmp_path / "plain")
    assert sorted(plain_files) == ["config.json", "diffusion_flax_model.msgpack"]
    assert _files(tmp_path / "patched") == plain_files  # byte for byte, config.json included
    # A clone (flax re-runs __init__ with every field) writes what a clone of the original writes.
    unet.clone().save_pretrained(tmp_path / "plain-clone", params=params)
    patched.clone().save_pretrained(tmp_path / "patched-clone", params=params)
    assert _files(tmp_path / "patched-clone") == _files(tmp_path / "plain-clone")

    loaded, loaded_params = FlaxUNet2DConditionModel.from_pretrained(tmp_path / "patched")
    assert type(loaded) is FlaxUNet2DConditionModel and not tome.is_patched(loaded)
    assert tome.patched_models(loaded) == []
    assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.array_equal, loaded_params, params)))
    sample, context = jnp.zeros((2, 4, 16, 16)), jnp.zeros((2, 7, 32))
    seen = attn1_tokens(loaded.apply, {"params": loaded_params}, sample, jnp.ones((2,)), context)
    assert Counter(n for _, _, n in seen) == expected_tokens(16, 16, SMALL_BLOCKS, 0.5, merged_levels=())


def test_params_never_change_and_the_patched_init_builds_the_same_tree(small):
    unet, params = small
    before = jax.tree_util.tree_map(np.array, params)
    patched = tome.patch(unet, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    tome.remove(patched)
    assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.array_equal, params, before)))
    plain_shapes, patched_shapes = param_shapes(unet), param_shapes(patched)
    assert jax.tree_util.tree_structure(patched_shapes) == jax.tree_util.tree_structure(plain_shapes)
    same = jax.tree_util.tree_map(lambda a, b: a.shape == b.shape and a.dtype == b.dtype, patched_shapes, plain_shapes)
    assert all(jax.tree_util.tree_leaves(same))


@pytest.mark.parametrize("how", ["copy", "deepcopy", "clone"])
def test_copies_of_a_patched_module_stay_patched_independently(small, attn1_tokens, how):
    unet, params = small
    patched = tome.patch(unet, ratio=0.5, seed=3)
    copier = {"copy": copy.copy, "deepcopy": copy.deepcopy, "clone": lambda m: m.clone()}[how]
    duplicate = copier(patched)
    # Equal and of equal hash: under jax.jit (static module) it runs the patched module's compilation.
    assert duplicate == patched and hash(duplicate) == hash(patched) and duplicate.tome == patched.tome
    # Its diffusers config is that of the same copy of the original (no "tome" entry to save).
    assert tome.is_patched(duplicate) and dict(duplicate.config) == dict(copier(unet).config)
    sample, context = jnp.zeros((2, 4, 16, 16)), jnp.zeros((2, 7, 32))

    def counts(model):
        return Counter(n for _, _, n in attn1_tokens(model.apply, {"params": params}, sample, jnp.ones((2,)), context))

    assert counts(duplicate) == expected_tokens(16, 16, SMALL_BLOCKS, 0.5, merged_levels=(1,))
    restored = tome.remove(duplicate)
    assert type(restored) is FlaxUNet2DConditionModel and restored == unet
    assert counts(restored) == expected_tokens(16, 16, SMALL_BLOCKS, 0.5, merged_levels=())
    assert tome.is_patched(patched) and tome.is_patched(duplicate)  # removing gives a new module; both stay
    # Re-patching a copy starts from the original (no patch on top of a patch).
    assert tome.patch(duplicate, ratio=0.25) == tome.patch(unet, ratio=0.25)
    assert type(tome.patch(duplicate, ratio=0.25)) is type(patched)


def test_removing_from_an_unpatched_pipeline_changes_nothing(pipe):
    unet, cls, key = pipe.unet, type(pipe), hash(pipe)
    assert tome.remove(pipe) is pipe
    assert pipe.unet is unet and type(pipe) is cls and hash(pipe) == key and "_tome_key" not in pipe.__dict__


def test_two_pipelines_sharing_a_unet_patched_differently_share_no_state_also_from_two_threads(pipe, small,
                                                                                               attn1_tokens):
    _, params = small
    components = {name: getattr(pipe, name) for name in pipe.components}
    first, second = FlaxStableDiffusionPipeline(**components), FlaxStableDiffusionPipeline(**components)
    shared = first.unet
    assert second.unet is shared
    tome.patch(first, ratio=0.5)
    tome.patch(second, ratio=0.25, max_downsample=2)
    assert not tome.is_patched(shared)  # the module both were built from is untouched
    assert first.unet.tome.ratio == 0.5 and second.unet.tome.ratio == 0.25 and hash(first) != hash(second)
    sample, context = jnp.zeros((2, 4, 16, 16)), jnp.zeros((2, 7, 32))
    expected = {
        "first": expected_tokens(16, 16, SMALL_BLOCKS, 0.5, merged_levels=(1,)),
        "second": expected_tokens(16, 16, SMALL_BLOCKS, 0.25, merged_levels=(1, 2)),
    }
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def trace(name, p):
        try:
            barrier.wait()
            for _ in range(2):
                seen = attn1_tokens(p.unet.apply, {"params": params}, sample, jnp.ones((2,)), context)
                results.setdefault(name, []).append(Counter(n for _, _, n in seen))
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=trace, args=item) for item in (("first", first), ("second", second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert results == {name: [counts] * 2 for name, counts in expected.items()}
    tome.remove(first)
    assert first.unet is shared and second.unet.tome.ratio == 0.25  # removing one leaves the other patched


def test_deepcopy_of_a_patched_pipeline_stays_patched_independently(pipe):
    unet = pipe.unet
    tome.patch(pipe, ratio=0.5, seed=4)
    try:
        duplicate = copy.deepcopy(pipe)
        assert type(duplicate) is type(pipe) and hash(duplicate) != hash(pipe)  # its own jit cache entry
        assert [name for name, _ in tome.patched_models(duplicate)] == ["unet"] and duplicate.unet == pipe.unet
        tome.remove(duplicate)
        assert tome.patched_models(duplicate) == [] and duplicate.unet == unet
        assert tome.patched_models(pipe)[0][1].tome.seed == 4
    finally:
        tome.remove(pipe)
    assert pipe.unet is unet


# ------------------------------------------------------------------------------------------------ randomness
# test_unet.py: seed= as a jax.random key, jit equals eager, a second call does not retrace and gives the
# same output. Here (with CFG halves above): global RNG states, no key needed, odd batches, and an
# independent trace giving the same partition.

JAX_RANDOM = ("PRNGKey", "key", "split", "fold_in", "randint", "uniform", "normal", "bits", "choice", "permutation")


def test_an_independent_trace_of_an_odd_batch_needs_no_key_touches_no_global_rng_and_shares_the_partition(
    small, inputs, apply, rel, monkeypatch
):
    unet, params = small
    model = tome.patch(unet, ratio=0.5, seed=1)
    sample, context = inputs[0][:1], inputs[2][:1]
    cfg = np.asarray(apply(model, params, jnp.repeat(sample, 2, 0), inputs[1], jnp.repeat(context, 2, 0)))
    odd = (jnp.repeat(sample, 3, 0), jnp.full((3,), 500, jnp.int32), jnp.repeat(context, 3, 0))

    used = Counter()

    def counting(name, function):
        def wrapper(*args, **kwargs):
            used[name] += 1
            return function(*args, **kwargs)

        return wrapper

    for name in JAX_RANDOM:
        monkeypatch.setattr(jax.random, name, counting(name, getattr(jax.random, name)))
    jax.eval_shape(lambda: unet.apply({"params": params}, *odd))
    flax_own = Counter(used)  # what flax itself does with keys while applying the unpatched model
    used.clear()
    np.random.seed(5)
    random.seed(5)
    numpy_state, python_state = np.random.get_state(), random.getstate()
    # A new function, traced and compiled afresh, called without any rngs.
    out = np.asarray(jax.jit(lambda p, x, t, c: model.apply({"params": p}, x, t, c).sample)(params, *odd))
    after = np.random.get_state()
    assert after[0] == numpy_state[0] and np.array_equal(after[1], numpy_state[1]) and after[2:] == numpy_state[2:]
    assert random.getstate() == python_state
    assert used == flax_own  # ToMe adds no jax.random call
    assert out.shape == odd[0].shape and np.isfinite(out).all()
    np.testing.assert_array_equal(out[1], out[0])  # every item of an odd batch: one partition
    np.testing.assert_array_equal(out[2], out[0])
    # Same seed, independent trace, another batch size: the CFG batch's partition (float batching noise only).
    assert rel(out[:1], cfg[:1]) < 1e-5


def test_a_patched_model_with_list_fields_hashes_and_jits_as_a_static_argument(apply, small, inputs, rel):
    """``from_pretrained`` gives list-valued fields (config JSON); the patched module still hashes."""
    unet, params = small
    listed = type(unet)(**{k: list(v) if isinstance(v, tuple) else v for k, v in tome_flax.module_fields(unet).items()})
    patched = tome.patch(listed, ratio=0.5)
    assert hash(patched) == hash(tome.patch(unet, ratio=0.5))
    sample, timesteps, context = inputs
    expected = np.asarray(apply(tome.patch(unet, ratio=0.5), params, sample, timesteps, context))
    np.testing.assert_array_equal(np.asarray(apply(patched, params, sample, timesteps, context)), expected)


def test_patched_models_print_briefly():
    unet, _ = build_unet("tiny")
    patched = tome.patch(unet, ratio=0.5)
    assert repr(tome.patched_models(patched)) == "[PatchedModel(name='FlaxUNet2DConditionModel', model=FlaxUNet2DConditionModel)]"
    [(name, model)] = tome.patched_models(patched)
    assert model is patched and name == "FlaxUNet2DConditionModel"
