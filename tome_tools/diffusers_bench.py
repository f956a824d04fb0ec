"""The torch side of ``python -m tome_tools.bench``: a diffusers UNet or diffusion transformer (SD3, Flux,
PixArt) and each method's patch.

Inputs, method dispatch, the sampling loop and the oracle are
:class:`tome_tools.bench_runner.BenchRunner`'s; the peer is tomesd (when installed; UNets only).

``--stack`` (:data:`tome_tools.bench.STACKS`) runs whole loops of a diffusers pipeline built around the bench's
model (:meth:`Runner.stack_pipeline`): a ``StableDiffusionPipeline`` for UNets, a ``FluxPipeline`` for Flux,
with no text encoder or VAE (the embeddings are passed in, ``output_type="latent"``), and sets up DeepCache,
T-GATE and diffusers' caching hooks as their own READMEs do (:meth:`Runner.apply_stack`).

``--train`` (:mod:`tome_tools.bench_train`) times :meth:`Runner.train_step`, one forward + backward of the UNet.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any, Callable, Dict, List, Tuple

import diffusers
import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from diffusers import DDIMScheduler, UNet2DConditionModel

import tome_core.torch as tome
from tome_core.adapters.diffusers import FRAMEWORK
from tome_tools import diffusers_trained as trained_models
from tome_tools.diffusers_models import build_transformer, build_unet
from tome_core.models import model_tree
from tome_core.hooks.block_hooks import family_argument_position, family_in_call
from tome_core.hooks.call_hooks import CallStart
from tome_core.framework import argument
from tome_tools import bench_train
from tome_tools.bench_core import serve_peak_request
from tome_tools.bench_runner import DDIM_CONFIG, MID_TIMESTEP, BenchRunner, Undo, hook_oracle, median_ms
from tome_core.models.families import child_at
from tome_core.models.plan import plan_model
from tome_tools.presets import TRANSFORMERS, transformer_config
from tome_tools.trained import model_info, sample_labels, shipped

try:
    import tomesd
except ImportError:  # the peer is optional
    tomesd = None


# The stacked loop's guidance scale per pipeline (their defaults; Flux's is the distilled guidance embedding).
STACK_GUIDANCE = {"StableDiffusionPipeline": 7.5, "FluxPipeline": 3.5}
# The pipelines the stacked loop builds around a diffusion transformer, by the transformer's class.
STACK_PIPELINES = {"FluxTransformer2DModel": "FluxPipeline"}


def _transformer_class(args: Any) -> str:
    """The diffusers class name of the transformer ``--preset`` / ``--model`` names (read, not built)."""
    if not args.model:
        return transformer_config(args.preset)[0]
    import json

    with open(os.path.join(args.model, "transformer", "config.json")) as f:
        return json.load(f)["_class_name"]


def stack_refusal(args: Any, name: str) -> str:
    """Why ``--stack name`` cannot run on this diffusion transformer ('' when it can): diffusers' caching hooks
    need the model's ``enable_cache`` (CacheMixin), and the loop a pipeline of :data:`STACK_PIPELINES`."""
    if args.preset not in TRANSFORMERS and not (args.model and os.path.isdir(os.path.join(args.model, "transformer"))):
        return ""
    cls = _transformer_class(args)
    model = getattr(diffusers, cls, None)
    fits = [preset for preset, (kind, _) in TRANSFORMERS.items() if kind in STACK_PIPELINES]
    if model is None or not hasattr(model, "enable_cache"):
        return (
            f"--stack {name}: {cls} has no enable_cache in diffusers {diffusers.__version__} (diffusers' caching "
            f"hooks serve the models with CacheMixin); allowed: the presets {', '.join(fits)}"
        )
    if cls not in STACK_PIPELINES:
        return f"--stack {name}: the stacked loop has no pipeline for {cls}; allowed: the presets {', '.join(fits)}"
    return ""


def _strip_tgate(pipe: Any) -> None:
    """Take T-GATE (tgate 1.0) off a pipeline: ``TgateSDLoader`` adds ``pipe.tgate``, and each ``pipe.tgate``
    call replaces every ``Attention`` module's ``forward`` with its own (left in place after the call, set to
    the last step's reuse) and keeps a ``cache`` on it. tgate has no undo of its own."""
    pipe.__dict__.pop("tgate", None)
    for module in pipe.unet.modules():
        if type(module).__name__ == "Attention":
            module.__dict__.pop("forward", None)
            module.__dict__.pop("cache", None)


def classifier_folder(model: str) -> str:
    """The classifier beside a trained model's folder (``../classifier``), else the shipped one."""
    beside = os.path.join(os.path.dirname(os.path.abspath(model)), "classifier")
    return beside if os.path.isdir(beside) else shipped("classifier")


def hook_default_oracle(model: torch.nn.Module) -> Undo:
    """Hook into ``model`` the oracle of its default patch (``patch(model)``'s resolved options): free removal of
    the tokens the default removes (:func:`~tome_tools.bench_runner.hook_oracle`); returns what removes it."""
    tome.patch(model)
    (_, state), = tome.patched_models(model)
    config = state.active
    tome.remove(model)
    return hook_oracle(FRAMEWORK, model, config)


def tensor_peak_mib(call: Callable[[], Any]) -> Tuple[float, float]:
    """``(peak, retained)``: the most MiB of CPU tensor memory that ``call``'s own allocations hold at once, and
    what they still hold when it returns (a cache it filled; its output, if it returns it).

    Exact and deterministic, from the profiler's allocation events: on the CPU it counts what CUDA's
    ``max_memory_allocated`` counts on a GPU (without that allocator's rounding), where the resident set also
    moves with the allocator's arenas and pages of code, by several MiB between runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        call()
    events = [
        e for e in profiled.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak / 2**20, live / 2**20


class Runner(BenchRunner):
    """A diffusers UNet or diffusion transformer; the peer is tomesd (when installed)."""

    has_peer = tomesd is not None
    scheduler_class = DDIMScheduler
    train_inputs: Any = None  # --train: the fixed batch of every step (bench_train.train_batch, as tensors)

    def __init__(self, args: Any):
        super().__init__(args)
        if getattr(args, "train", None):
            self.prepare_training()

    # -- training steps (--train) --------------------------------------------------------------------------
    def prepare_training(self) -> None:
        """The training batch as tensors, the UNet's gradient checkpointing with ``--gradient-checkpointing``
        and, with ``--train lora``, the LoRA adapter (peft, rank :data:`bench_train.LORA_RANK` on the attention
        projections), added once: every method trains it."""
        batch = bench_train.train_batch(self)
        self.train_inputs = bench_train.TrainBatch(
            sample=torch.from_numpy(batch.sample), target=torch.from_numpy(batch.target),
            timesteps=torch.from_numpy(batch.timesteps),
        )
        if self.args.gradient_checkpointing:
            self.unet.enable_gradient_checkpointing()
        if self.args.train == "lora":
            from peft import LoraConfig

            self.unet.add_adapter(LoraConfig(r=bench_train.LORA_RANK, lora_alpha=bench_train.LORA_RANK,
                                             target_modules=list(bench_train.LORA_TARGETS)))

    def trains(self, name: str) -> bool:
        """Whether the weight ``name`` trains: every weight in a full fine-tune, the adapters' with LoRA."""
        return self.args.train != "lora" or "lora_" in name

    def train_step(self, keep_grads: bool = False) -> torch.Tensor:
        """One training step with the current method: the UNet in training mode, the weights of :meth:`trains`
        requiring gradients, ``mse(unet(x_t, t, text).sample, noise)`` and its backward. Returns the gradient
        of the loss with respect to ``x_t``. Afterwards the training mode and every ``requires_grad`` are as
        they were and the weights' gradients are dropped (kept with ``keep_grads``)."""
        batch = self.train_inputs
        device = next(self.unet.parameters()).device
        params = list(self.unet.named_parameters())
        flags, training = [p.requires_grad for _, p in params], self.unet.training
        sample = batch.sample.to(device, copy=True).requires_grad_(True)  # a fresh leaf: its own gradient
        try:
            for name, p in params:
                p.requires_grad_(self.trains(name))
            self.unet.train()
            out = self.unet(sample, batch.timesteps.to(device), self.text.to(device), added_cond_kwargs=self.added).sample
            torch.nn.functional.mse_loss(out.float(), batch.target.to(device)).backward()
        finally:
            self.unet.train(training)
            for (_, p), flag in zip(params, flags):
                p.requires_grad_(flag)
                if not keep_grads:
                    p.grad = None
        return sample.grad.cpu()

    def peak_memory_mb(self, name: str, ratio: float) -> float:
        """A training step's extra peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over the step,
        in this process; else (and for inference calls) the extra peak resident memory of a fresh process."""
        device = next(self.unet.parameters()).device
        if not getattr(self.args, "train", None) or device.type != "cuda":
            return super().peak_memory_mb(name, ratio)
        with self.method(name, ratio):
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            self.train_step()
            torch.cuda.synchronize(device)
            return (torch.cuda.max_memory_allocated(device) - before) / 2**20

    def set_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)

    def load_unet(self) -> torch.nn.Module:
        """The UNet, or with a transformer preset (or a folder holding ``transformer/``) the transformer; a
        trained model's folder (``tome_tools.trained``) in pixel space, with its classes and scheduler."""
        model = self.args.model
        if model and model_info(model) is not None:
            self.trained = trained_models.load(model)
            self.classifier = trained_models.load_classifier(classifier_folder(model))
            self.latent_scale = 1
            return self.trained.model
        if not model:
            preset = self.args.preset
            return build_transformer(preset) if preset in TRANSFORMERS else build_unet(preset)
        if os.path.isdir(os.path.join(model, "transformer")):
            return diffusers.AutoModel.from_pretrained(model, subfolder="transformer", local_files_only=True).eval()
        try:
            return UNet2DConditionModel.from_pretrained(model, subfolder="unet", local_files_only=True).eval()
        except (OSError, EnvironmentError):
            return UNet2DConditionModel.from_pretrained(model, local_files_only=True).eval()

    def finest_level(self) -> int:
        return model_tree.finest_level(FRAMEWORK, self.unet)

    def to_tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array)

    def normal_draws(self, seed: int) -> Callable[[Tuple[int, ...]], torch.Tensor]:
        """Drawn by torch's generator (the inputs the README's measured tables came from)."""
        generator = torch.Generator().manual_seed(seed)
        return lambda shape: torch.randn(*shape, generator=generator)

    def unet_call(self, sample: torch.Tensor, timestep: Any) -> torch.Tensor:
        with torch.no_grad():
            return self.unet(sample, timestep, self.text, added_cond_kwargs=self.added).sample

    def transformer_call(self, kwargs: Dict[str, Any]) -> torch.Tensor:
        with torch.no_grad():
            return self.unet(**kwargs).sample

    def make_scheduler(self, name: str, config: Dict[str, Any]) -> Any:
        return getattr(diffusers, name)(**config)

    def own_scheduler(self) -> Any:
        return None if self.trained is None else DDIMScheduler.from_config(self.trained.scheduler_config)

    def text_embeddings(self, draw: Callable[[Tuple[int, ...]], torch.Tensor], shape: Tuple[int, ...]) -> torch.Tensor:
        """A trained model's timed calls: half the batch conditioned on classes 0, 1, ..., half on the null
        class (as classifier-free guidance calls it)."""
        if self.trained is None:
            return draw(shape)
        batch, classes = shape[0], len(self.trained.info["classes"])
        labels = [i % classes for i in range((batch + 1) // 2)] + [classes] * (batch // 2)
        return self.trained.condition(torch.tensor(labels))

    def class_samples(self, name: str, ratio: float) -> np.ndarray:
        """A trained model's sample set (every class ``--samples-per-class`` times, fixed seeds, a full
        ``--sample-steps`` DDIM loop with guidance) with method ``name``."""
        labels = sample_labels(self.args.samples_per_class)
        with self.method(name, ratio):
            return trained_models.generate(self.trained, labels, self.args.sample_steps)

    def classify(self, images: np.ndarray) -> np.ndarray:
        """The shipped classifier's predictions for ``images``."""
        return trained_models.predict(self.classifier, images)

    def framework(self) -> Any:
        return FRAMEWORK

    def patch_ours(self, options: Dict[str, Any]) -> Undo:
        tome.patch(self.unet, **options)
        return lambda: tome.remove(self.unet)

    def patch_peer(self, ratio: float, max_downsample: int, options: Dict[str, Any]) -> Undo:
        tomesd.apply_patch(self.unet, ratio=ratio, max_downsample=max_downsample, **options)
        return lambda: tomesd.remove_patch(self.unet)

    def peer_note(self) -> str:
        return f"tomesd {getattr(tomesd, '__version__', '0.1.3')}" if self.has_peer else "tomesd is not installed"

    # -- stacked speed-ups (--stack) ---------------------------------------------------------------------
    _pipeline: Any = None
    _loop_kwargs: Dict[str, Any] = {}

    def stack_pipeline(self) -> Any:
        """The pipeline of the stacked loops, built once around the bench's model, and the keyword arguments of
        its call (in ``_loop_kwargs``).

        UNets: a ``StableDiffusionPipeline`` with no text encoder, tokenizer or VAE (``vae_scale_factor`` 8),
        ``max(1, --batch // 2)`` images with guidance 7.5, the bench's text embeddings as ``prompt_embeds``
        (seeded normals as ``negative_prompt_embeds``) and its loop noise as ``latents``; the scheduler is DDIM
        with SD 1.5's schedule. A trained UNet: its class sample set (every class ``--samples-per-class``
        times, sample ``i`` from noise seeded ``i``, as :func:`diffusers_trained.generate`), its class tokens,
        its guidance and its own DDIM scheduler. Flux: a ``FluxPipeline`` with the bench's packed noise, text
        and pooled embeddings, guidance 3.5, its flow-matching scheduler."""
        if self._pipeline is not None:
            return self._pipeline
        steps = self.args.steps
        images = max(1, self.args.batch // 2)
        if self.spec is not None:
            pipe_name = STACK_PIPELINES[type(self.unet).__name__]
            scheduler = self.make_scheduler(self.spec.scheduler, self.spec.scheduler_config)
            pipe = getattr(diffusers, pipe_name)(
                scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                tokenizer_2=None, transformer=self.unet,
            )
            size = self.latent_hw[0] * pipe.vae_scale_factor
            kwargs = dict(
                prompt_embeds=self.text[:images], pooled_prompt_embeds=self.extra["pooled_projections"][:images],
                latents=self.noise[:images], guidance_scale=STACK_GUIDANCE[pipe_name],
            )
        else:
            config = DDIMScheduler.from_config(self.scheduler.config, clip_sample=False, steps_offset=1).config
            pipe = diffusers.StableDiffusionPipeline(
                vae=None, text_encoder=None, tokenizer=None, unet=self.unet, scheduler=DDIMScheduler.from_config(config),
                safety_checker=None, feature_extractor=None, requires_safety_checker=False,
            )
            size = self.latent_hw[0] * pipe.vae_scale_factor
            if self.trained is not None:  # its own schedule (the constructor would turn its clipping off)
                pipe.scheduler = DDIMScheduler.from_config(self.trained.scheduler_config)
                labels = torch.as_tensor(sample_labels(self.args.samples_per_class), dtype=torch.long)
                channels, side = self.unet.config.in_channels, self.latent_hw[0]
                noise = [torch.randn((channels, side, side), generator=torch.Generator().manual_seed(i)) for i in range(len(labels))]
                kwargs = dict(
                    prompt_embeds=self.trained.condition(labels),
                    negative_prompt_embeds=self.trained.condition(torch.full_like(labels, len(self.trained.info["classes"]))),
                    latents=torch.stack(noise), guidance_scale=float(self.trained.info["guidance"]),
                )
            else:  # SD 1.5's DDIM schedule
                pipe.scheduler = DDIMScheduler(**DDIM_CONFIG, clip_sample=False, set_alpha_to_one=False, steps_offset=1)
                negative = self.normal_draws(seed=3)((images,) + tuple(self.text.shape[1:]))
                kwargs = dict(
                    prompt_embeds=self.text[:images], negative_prompt_embeds=negative, latents=self.noise[:images],
                    guidance_scale=STACK_GUIDANCE["StableDiffusionPipeline"],
                )
        pipe.set_progress_bar_config(disable=True)
        self._loop_kwargs = dict(
            kwargs, num_inference_steps=steps, height=size, width=size, output_type="latent", return_dict=False
        )
        self._pipeline = pipe
        return pipe

    def apply_stack(self, name: str, settings: Dict[str, Any]) -> Undo:
        """Each speed-up as its README sets it up: ``DeepCacheSDHelper(pipe=pipe)``, ``set_params``, ``enable``
        (undone by ``disable``); ``TgateSDLoader(pipe)`` (its loop is ``pipe.tgate``; undone by
        :func:`_strip_tgate`); ``transformer.enable_cache(FirstBlockCacheConfig(...))`` or
        ``PyramidAttentionBroadcastConfig(..., current_timestep_callback=lambda: pipe.current_timestep)``
        (undone by ``disable_cache``)."""
        pipe = self.stack_pipeline()
        if name == "deepcache":
            from DeepCache import DeepCacheSDHelper

            helper = DeepCacheSDHelper(pipe=pipe)
            helper.set_params(**settings)
            helper.enable()
            return helper.disable
        if name == "tgate":
            import tgate

            tgate.TgateSDLoader(pipe)
            return lambda: _strip_tgate(pipe)
        if name == "first-block-cache":
            self.unet.enable_cache(diffusers.FirstBlockCacheConfig(**settings))
        elif name == "pab":
            self.unet.enable_cache(
                diffusers.PyramidAttentionBroadcastConfig(**settings, current_timestep_callback=lambda: pipe.current_timestep)
            )
        else:
            raise ValueError(f"unknown --stack speed-up {name!r}")
        return self.unet.disable_cache

    def run_loop(self, stack: Any) -> torch.Tensor:
        """One loop of the pipeline from the fixed noise (T-GATE's through ``pipe.tgate`` with its settings);
        the final latents, a trained model's samples clipped to [-1, 1] as its sampler clips them."""
        pipe = self.stack_pipeline()
        kwargs = dict(self._loop_kwargs, latents=self._loop_kwargs["latents"].clone())
        with torch.no_grad():
            if stack == "tgate":
                out = pipe.tgate(**kwargs, **self.stacks["tgate"])[0]
            else:
                out = pipe(**kwargs)[0]
        return out.clamp(-1, 1) if self.trained is not None else out


# -- per-block microbenchmark ------------------------------------------------------------------------
def count_ops(fn) -> int:
    """Number of aten operations ``fn`` dispatches (views included)."""
    with torch.no_grad(), Launches(views=True) as counted:
        fn()
    return sum(counted.ops.values())


# aten operations that make a view of their input: they launch no kernel
VIEWS = frozenset({
    "view", "_unsafe_view", "unsqueeze", "squeeze", "expand", "t", "permute", "transpose", "slice", "select",
    "as_strided", "alias", "detach", "split", "unbind", "split_with_sizes", "view_as", "unflatten", "flatten",
    "narrow", "expand_as", "reshape", "_reshape_alias", "chunk", "lift_fresh",
})


class Launches(TorchDispatchMode):
    """While active, ``ops`` counts by name the aten operations that launch a kernel (:data:`VIEWS` left out unless
    ``views``): an eager GPU call at image sizes is bound by its launches, and they are the same on a CPU, so they
    can be counted exactly here."""

    def __init__(self, views: bool = False) -> None:
        super().__init__()
        self.views = views
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.views or name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def warm_launches(model: Any, *args: Any, **kwargs: Any) -> Counter:
    """The launches of a warm call of ``model`` (the third: the first two fill caches), by operation."""
    with torch.no_grad():
        model(*args, **kwargs)
        model(*args, **kwargs)
        with Launches() as counted:
            model(*args, **kwargs)
    return counted.ops


def patched_launches(model: Any, options: Dict[str, Any], *args: Any, **kwargs: Any) -> Tuple[Counter, int, str]:
    """:func:`warm_launches` of ``model`` patched with ``options`` (removed after), the blocks whose merged sub-layer
    ran in its last call (its summary's counts) and that summary."""
    tome.patch(model, **options)
    try:
        launched = warm_launches(model, *args, **kwargs)
        summary = tome.patched_models(model)[0].state.summary()
    finally:
        tome.remove(model)
    return launched, sum(int(count) for count in re.findall(r"(\d+) blocks,", summary)), summary


class SdpaCalls(TorchFunctionMode):
    """What attention really sees: while active, ``shapes`` gathers ``(query shape, key shape)`` of every
    ``F.scaled_dot_product_attention`` call in call order, ``lengths`` their token counts ``(queries, keys)``.
    Entered around a model call, it sits below the function modes that ToMe's hooks enter later, so it sees the
    tensors after they merged (an attention that merges its keys inside the kernel call needs a dispatch mode
    entered per call: ``tests/torch/test_contracts.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            named = dict(zip(("query", "key"), args), **kwargs)
            self.shapes.append((tuple(named["query"].shape), tuple(named["key"].shape)))
        return func(*args, **kwargs)

    @property
    def lengths(self) -> List[Tuple[int, int]]:
        return [(query[-2], key[-2]) for query, key in self.shapes]


def micro(batch: int = 2, height: int = 64, width: int = 64, channels: int = 320, ratio: float = 0.5, repeats: int = 20) -> Dict[str, Any]:
    """One block's match + merge + unmerge (use_rand=False), ours vs tomesd: medians, op counts, equality.

    Also ``matching='cell'`` with 2x2 cells (ratio 0.75, its match built once per shape and cached, so a call
    pays the pooling only): ``cell_merge`` is what ``mode='kv'`` pays (keys/values pooled, nothing unmerged),
    ``cell_merge_unmerge`` what ``mode='tokens'`` pays; ``cell_match_build`` is the one-off cost of building the
    match for a new shape; ``cell_vs_tomesd`` are their times over tomesd's match + merge + unmerge."""
    from tome_core import bipartite_match, get_ops, merge, unmerge
    from tome_core.algorithm.match import build_cell_match, cell_match

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, height * width, channels, generator=generator)
    r = int(height * width * ratio)
    ops = get_ops(x)

    def ours():
        match = bipartite_match(ops, x, height, width, 2, 2, r, None)
        return unmerge(merge(x, match), match)

    def theirs():
        m, u = tomesd.merge.bipartite_soft_matching_random2d(x, width, height, 2, 2, r, no_rand=True)
        return u(m(x))

    def cell_merge():
        return merge(x, cell_match(ops, x, batch, height, width, 2, 2))

    def cell_merge_unmerge():
        match = cell_match(ops, x, batch, height, width, 2, 2)
        return unmerge(merge(x, match), match)

    functions = {"ours": ours, "cell_merge": cell_merge, "cell_merge_unmerge": cell_merge_unmerge,
                 "cell_match_build": lambda: build_cell_match(ops, x, batch, height, width, 2, 2)}
    if tomesd is not None:
        functions["tomesd"] = theirs
    with torch.no_grad():
        medians = median_ms(functions, repeats)
        same = torch.allclose(ours(), theirs(), rtol=1e-5, atol=1e-6) if tomesd is not None else None
        pooled = torch.nn.functional.avg_pool2d(x.transpose(1, 2).reshape(batch, channels, height, width), 2)
        cell_is_pooling = torch.allclose(cell_merge(), pooled.flatten(2).transpose(1, 2), rtol=1e-5, atol=1e-6)
    result = {
        "shape": [batch, height * width, channels],
        "median_ms": medians,
        "time_ratio": medians["ours"] / medians["tomesd"] if tomesd is not None else None,
        "ops": {"ours": count_ops(ours), "cell_merge": count_ops(cell_merge), "cell_merge_unmerge": count_ops(cell_merge_unmerge)},
        "identical_outputs": None if same is None else bool(same),
        "cell_equals_avg_pool2d": bool(cell_is_pooling),
    }
    if tomesd is not None:
        result["ops"]["tomesd"] = count_ops(theirs)
        result["cell_vs_tomesd"] = {
            name: medians[name] / medians["tomesd"] for name in ("cell_merge", "cell_merge_unmerge", "ours")
        }
    return result


if __name__ == "__main__":
    serve_peak_request(Runner)


# -- per-block overhead in a diffusion transformer ---------------------------------------------------
class _Captured(Exception):
    """Stops the capturing call once every block of interest has shown its inputs."""


MICRO_ROWS = ("unpatched", "ours", "ours_reused_match", "ours_plain_softmax", "oracle")


def paired_ratios(unpatched: List[float], ours: List[float], oracle: List[float]) -> Dict[str, float]:
    """Ratios within each round (the three calls of one round run back to back, so a machine whose load
    drifts slows them alike), then their medians over the rounds: ``ours/unpatched``, ``oracle/unpatched`` and
    the share of the oracle's saving that ours gets, ``(unpatched - ours) / (unpatched - oracle)`` (the ratio
    of the two medians' savings)."""
    import statistics

    mine = statistics.median(o / u for o, u in zip(ours, unpatched))
    free = statistics.median(f / u for f, u in zip(oracle, unpatched))
    return {"ours/unpatched": mine, "oracle/unpatched": free, "share_of_oracle_saving": (1 - mine) / (1 - free) if free != 1 else float("nan")}


def _block_kinds(model: Any, blocks: List[Tuple[Any, Any]]) -> Dict[str, Tuple[int, Any, Any]]:
    """The first block of each kind: ``{name: (stream index, block, family)}``, a kind being a family in one
    container of the model (Flux's ``transformer_blocks`` and ``single_transformer_blocks``; Z-Image's
    ``noise_refiner``, on the image alone, apart from its ``layers`` on ``[image; text]``), named by the family
    and, where one family sits in several containers, the container too."""
    names = {id(module): name for name, module in model.named_modules()}
    container = lambda block: names.get(id(block), "").rpartition(".")[0].rstrip("0123456789").rstrip(".")  # noqa: E731
    seen: Dict[Tuple[str, str], Tuple[int, Any, Any]] = {}
    for stream, (block, family) in enumerate(blocks):
        seen.setdefault((family.name, container(block)), (stream, block, family))
    families = [family for family, _ in seen]
    return {
        (family if families.count(family) == 1 else f"{family} ({where})"): entry for (family, where), entry in seen.items()
    }


def micro_transformer(args: Any) -> Dict[str, Any]:
    r"""Per-block cost of ToMe in a diffusion transformer preset at ``--resolution`` / ``--batch`` / ratio
    ``--ratio[0]`` (``--option``\ s apply; ``blocks`` and the reuse options are set here).

    The first block of each kind (:func:`_block_kinds`; SD3: joint; Flux, Flux.2, HunyuanVideo: double- and
    single-stream; PixArt: basic; Z-Image: its noise refiner and its main blocks) is run on the inputs it gets in
    an unpatched model call, timed alternately (medians of ``--repeats`` rounds after ``--warmup``), the rows of
    ``--micro-methods`` (default all): unpatched; with ours and a fresh match (``reuse_blocks=1``); with ours and
    a reused match (the match is already there, as in every block of a ``reuse_blocks`` run but the first); with
    ours, a fresh match and plain softmax (``proportional_attn=False``: what size-aware attention costs); with the
    oracle. Then the pieces alone: the block's match (``ToMeState.block_matches`` on its image tokens) and a
    merge + unmerge of its image tokens per merged sub-layer. ``share_of_block`` is ``(match / k + merge +
    unmerge) / block time`` with one match per ``k`` blocks (``reuse_blocks=k``; ``reuse_steps=s`` divides the
    match by ``s`` again). The call's token grid and tail (reference tokens) are read from the captured call as
    the patch reads them.
    """
    import contextlib

    from tome_core import merge, unmerge
    from tome_tools.bench_runner import image_part, overhead_shares
    from tome_core.config import ToMeConfig
    from tome_core.hooks.call import CallFacts
    from tome_core.hooks.state import ToMeState

    args.options = getattr(args, "options", {})
    args.variants = getattr(args, "variants", {})
    rows = list(getattr(args, "micro_methods", None) or MICRO_ROWS)
    runner = Runner(args)
    model = runner.unet
    ratio = args.ratio[0]
    base = {k: v for k, v in runner.options.items() if k not in ("blocks", "reuse_blocks", "reuse_steps")}
    options = {**base, "ratio": ratio}
    config = ToMeConfig.from_options(options)
    blocks = model_tree.blocks_of(FRAMEWORK, model)
    firsts = _block_kinds(model, blocks)
    captured: Dict[str, Tuple[tuple, dict]] = {}
    seen = ToMeState(config=config)
    model_hook = model.register_forward_pre_hook(CallStart(FRAMEWORK, plan_model(FRAMEWORK, model, config), seen), with_kwargs=True)

    def capture(name):
        def hook(module, hook_args, hook_kwargs):
            captured.setdefault(name, (hook_args, hook_kwargs))
            if len(captured) == len(firsts):
                raise _Captured
        return hook

    handles = [block.register_forward_pre_hook(capture(name), with_kwargs=True) for name, (_, block, _) in firsts.items()]
    try:
        runner.call()
    except _Captured:
        pass
    finally:
        model_hook.remove()
        for handle in handles:
            handle.remove()
    grid, tail, grid_last = seen.grid_hw, seen.call.tail, seen.call.grid_last
    if grid is None:
        raise SystemExit(f"--micro: ToMe places no token grid on this call of {type(model).__name__} ({seen.call.why})")

    results = []
    for name, (stream, block, family) in firsts.items():
        block_args, block_kwargs = captured[name]
        family = family_in_call(family, family_argument_position(family, block), block_args, block_kwargs)
        hidden = image_part(argument(block_args, block_kwargs, "hidden_states", 0), family, grid, tail, grid_last)
        shared = family.rotary is not None or any(s.masks for s in family.sublayers)
        sublayers = [s for s in family.sublayers if child_at(block, s.child) is not None and config.sublayers[s.kind]]

        @contextlib.contextmanager
        def ours(reused: bool, stream=stream, hidden=hidden, shared=shared, **extra):
            tome.patch(model, **{**options, **extra}, reuse_blocks=10**6 if reused else 1)
            state = tome.patched_models(model)[0][1]
            state.begin_call(CallFacts(grid, MID_TIMESTEP, tail=tail, grid_last=grid_last))
            state.enter_grid(grid)
            if reused:  # the match a run of blocks shares is there already
                state.block_matches(hidden, stream, shared=shared)
            try:
                yield
            finally:
                tome.remove(model)

        @contextlib.contextmanager
        def oracle():
            undo = hook_oracle(FRAMEWORK, model, config, call=(grid, tail, grid_last))
            try:
                yield
            finally:
                undo()

        state = ToMeState(config=config)
        state.begin_call(CallFacts(grid, MID_TIMESTEP, tail=tail, grid_last=grid_last))
        state.enter_grid(grid)
        match = state.block_matches(hidden, stream, shared=shared)["attn"]
        run_block = lambda block=block, a=block_args, k=block_kwargs: block(*a, **k)
        timed = {f"block_{row}": run_block for row in rows}
        contexts = {
            "block_ours": lambda: ours(False),
            "block_ours_reused_match": lambda: ours(True),
            "block_ours_plain_softmax": lambda: ours(False, proportional_attn=False),
            "block_oracle": oracle,
        }
        raw: Dict[str, List[float]] = {}
        with torch.no_grad():
            medians = median_ms(
                {
                    **timed,
                    "match": lambda stream=stream, hidden=hidden, shared=shared: state.block_matches(hidden, stream, shared=shared),
                    "merge_unmerge": lambda hidden=hidden, match=match: unmerge(merge(hidden, match), match),
                },
                args.repeats,
                args.warmup,
                contexts={k: v for k, v in contexts.items() if k in timed},
                raw=raw,
            )
        merge_unmerge = medians["merge_unmerge"] * len(sublayers)
        entry = {
            "block": type(block).__name__,
            "kind": name,
            "index": stream,
            "image_tokens": [args.batch, match.tokens, int(hidden.shape[-1])],
            "stream_tokens": int(argument(block_args, block_kwargs, "hidden_states", 0).shape[1]),
            "kept": match.kept,
            "merged_sublayers": [s.child for s in sublayers],
            "median_ms": medians,
            "times_ms": {k: [round(x, 1) for x in v] for k, v in raw.items() if k.startswith("block_")},
            "overhead_ms": {"match": medians["match"], "merge_unmerge": merge_unmerge},
        }
        unpatched, mine, free = (medians.get(f"block_{row}") for row in ("unpatched", "ours", "oracle"))
        if unpatched is not None:
            entry["share_of_block"] = overhead_shares(unpatched, medians["match"], merge_unmerge)
        if mine is not None:
            entry["share_of_merged_block"] = overhead_shares(mine, medians["match"], merge_unmerge)
        if None not in (unpatched, mine, free):
            entry["ratios"] = {
                "ours/unpatched": mine / unpatched,
                "oracle/unpatched": free / unpatched,
                "share_of_oracle_saving": (unpatched - mine) / (unpatched - free) if unpatched != free else float("nan"),
            }
        if all(f"block_{row}" in raw for row in ("unpatched", "ours", "oracle")):
            entry["paired_ratios"] = paired_ratios(raw["block_unpatched"], raw["block_ours"], raw["block_oracle"])
        results.append(entry)
    return {
        "preset": args.preset, "resolution": args.resolution, "batch": args.batch, "ratio": ratio,
        "grid": list(grid), "tail": tail, "latent": list(runner.latent_hw),
        "video": runner.video_latent_size(), "text_tokens": int(runner.text[0].shape[-2]) if runner.text is not None else None,
        "repeats": args.repeats, "warmup": args.warmup, "torch_threads": torch.get_num_threads(), "blocks": results,
    }
