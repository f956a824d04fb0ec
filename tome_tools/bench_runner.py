"""The framework-free half of a benchmark runner: inputs, method dispatch, sampling loop, the oracle.

``python -m tome_tools.bench`` drives one runner per framework (``tome_core.adapters.<framework>_bench``).
Everything the frameworks share lives here, written once: the UNet inputs (image-like latents noised to the
mid timestep, seeded text embeddings, SDXL's added conditions), which ToMe options each method uses, the
level bound the peer copies from 'ours', and the DDIM loop. The oracle is the library's own hooks with a
match that keeps the first tokens (:func:`hook_oracle`, :func:`tome_tools.oracle.attach_oracle`; Flax's bench
keeps a table of token counts, :class:`tome_tools.flax_bench.OraclePlan`). Diffusion transformers (SD3, Flux,
PixArt, and Wan's video transformer: :data:`TRANSFORMER_SPECS`) get their own inputs (flow-matching or DDPM
noising, Flux's packed tokens and ids) and their own scheduler.
A subclass supplies the framework: building the model, moving numpy arrays in, calling the UNet, and
patching and unpatching each method. No framework is imported here (numpy only).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from tome_core.algorithm.backend import get_ops
from tome_core.hooks.block_hooks import around_grid, image_tokens
from tome_tools.bench_core import image_like_latents, noised, peak_memory_in_fresh_process, video_latents
from tome_tools.oracle import attach_oracle
from tome_core.config import ToMeConfig
from tome_core.models.families import BlockFamily
from tome_core.framework import Framework
from tome_core.hooks.call import CallFacts
from tome_core.hooks.state import ToMeState

MID_TIMESTEP = 500
# Stable Diffusion's noise schedule; every framework's DDIM scheduler takes these keyword arguments.
DDIM_CONFIG = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
# The ToMe options tomesd and its ports understand: the peer gets these from --option, nothing else.
PEER_OPTIONS = ("sx", "sy", "use_rand", "merge_attn", "merge_crossattn", "merge_mlp")
Undo = Callable[[], None]


@dataclass(frozen=True)
class TransformerSpec:
    """How the bench feeds one diffusion transformer family, by diffusers' class name and call API (ppdiffusers
    keeps both).

    flow: flow matching (``x_t = (1 - s) x_0 + s noise`` at ``s = t / 1000``, SD3 and Flux), else DDPM noising
        with the scheduler's cumulative alphas (PixArt).
    packed: 2x2 latent patches are packed into one token, placed by ``img_ids`` (Flux).
    text_dim, pooled_dim: config fields giving the width of the text embeddings and of the pooled projection.
    text_tokens: the released pipelines' prompt length (SD3: 77 CLIP + 256 T5; Flux dev: 512 T5; PixArt: 120;
        Wan: 512 umT5).
    timestep_scale: the model's timestep per scheduler timestep (Flux takes ``t / 1000``).
    scheduler, scheduler_config: the released pipelines' scheduler (class name and config).
    dynamic_shift: the loop's sigmas are shifted by the image token count (Flux's ``mu``).
    added_cond: the call takes PixArt's ``added_cond_kwargs``.
    separate_kv: its self-attention takes keys and values apart from queries (``mode='auto'`` can choose kv).
    layout: how the noised latent reaches the model: ``grid`` (as it is, ``[B, C, H, W]`` or a video's ``[B, C, F,
        H, W]``), ``flat`` (a video's latent pixels as tokens ``[B, F*H*W, C]``, LTX), ``list`` (one ``[C, F, H,
        W]`` per batch item, and the text one ``[T, C]`` per item, Z-Image). ``packed`` tokens are 2-D latents.
    ids_columns: the columns of packed tokens' ids (Flux: ``(index, row, col)``; Flux.2: ``(index, row, col,
        layer)``, its text ids ``(0, 0, 0, position)``).
    img_shapes: the call takes Qwen-Image's ``img_shapes`` (per item, the ``(frames, rows, cols)`` of its tokens).
    text_mask: the call's argument taking a mask over the text tokens (all valid), if any.
    guidance: the distilled guidance the pipeline passes (``guidance``), if any (Flux: from ``guidance_embeds``).
    names: the call's names for the latent, the timestep and the text.
    timesteps_rise: the model's timestep is ``(1000 - t) / 1000`` of the scheduler's ``t`` (Z-Image), which it
        predicts the negated velocity for (its pipeline negates it).
    sizes: the call takes the latent's ``num_frames``, ``height``, ``width`` (LTX's packed tokens), and LTX's
        ``rope_interpolation_scale`` (its VAE's compression over the frame rate, 25).
    shift: the parameters of the loop's sigma shift by the image token count (``dynamic_shift``).
    """

    flow: bool
    text_dim: str
    text_tokens: int
    scheduler: str
    scheduler_config: Dict[str, Any] = field(default_factory=dict)
    packed: bool = False
    pooled_dim: Optional[str] = None
    timestep_scale: float = 1.0
    dynamic_shift: bool = False
    added_cond: bool = False
    separate_kv: bool = False
    layout: str = "grid"
    ids_columns: int = 3
    img_shapes: bool = False
    text_mask: Optional[str] = None
    guidance: Optional[float] = None
    names: Tuple[str, str, str] = ("hidden_states", "timestep", "encoder_hidden_states")
    timesteps_rise: bool = False
    sizes: bool = False
    shift: Optional[Dict[str, float]] = None


FLOW_SHIFT = dict(base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
TRANSFORMER_SPECS: Dict[str, TransformerSpec] = {
    "SD3Transformer2DModel": TransformerSpec(
        flow=True, text_dim="joint_attention_dim", pooled_dim="pooled_projection_dim", text_tokens=333,
        scheduler="FlowMatchEulerDiscreteScheduler", scheduler_config=dict(shift=3.0),
    ),
    "FluxTransformer2DModel": TransformerSpec(
        flow=True, text_dim="joint_attention_dim", pooled_dim="pooled_projection_dim", text_tokens=512,
        scheduler="FlowMatchEulerDiscreteScheduler",
        scheduler_config=dict(shift=3.0, use_dynamic_shifting=True, **FLOW_SHIFT),
        packed=True, timestep_scale=1e-3, dynamic_shift=True,
    ),
    "PixArtTransformer2DModel": TransformerSpec(
        flow=False, text_dim="caption_channels", text_tokens=120, scheduler="DPMSolverMultistepScheduler",
        scheduler_config=dict(beta_schedule="linear", beta_start=0.0001, beta_end=0.02),
        added_cond=True, separate_kv=True,
    ),
    # Wan 2.1 (a video transformer: :mod:`tome_tools.bench_video` feeds it panning videos ``[B, C, F, H, W]``); the
    # released 480p pipeline's scheduler, UniPC on flow-matching sigmas shifted by 3 (5 at 720p).
    "WanTransformer3DModel": TransformerSpec(
        flow=True, text_dim="text_dim", text_tokens=512, scheduler="UniPCMultistepScheduler",
        scheduler_config=dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
    ),
    # The newer ones, as their released pipelines call them (diffusers 0.42): prompt lengths of Flux.2's Mistral
    # (512, padded), of HunyuanVideo's Llama (256, padded) and LTX's T5 (128, padded); Qwen-Image and Z-Image pass
    # the prompt's own tokens (128 here); flow-matching Euler with each release's shift.
    "Flux2Transformer2DModel": TransformerSpec(
        flow=True, text_dim="joint_attention_dim", text_tokens=512, scheduler="FlowMatchEulerDiscreteScheduler",
        scheduler_config=dict(shift=3.0, use_dynamic_shifting=True, **FLOW_SHIFT), packed=True, timestep_scale=1e-3,
        dynamic_shift=True, ids_columns=4, guidance=4.0,
    ),
    "QwenImageTransformer2DModel": TransformerSpec(
        flow=True, text_dim="joint_attention_dim", text_tokens=128, scheduler="FlowMatchEulerDiscreteScheduler",
        scheduler_config=dict(shift=1.0, use_dynamic_shifting=True, **FLOW_SHIFT), packed=True, timestep_scale=1e-3,
        dynamic_shift=True, img_shapes=True,
        shift=dict(base_image_seq_len=256, max_image_seq_len=8192, base_shift=0.5, max_shift=0.9),
    ),
    "ZImageTransformer2DModel": TransformerSpec(
        flow=True, text_dim="cap_feat_dim", text_tokens=128, scheduler="FlowMatchEulerDiscreteScheduler",
        scheduler_config=dict(shift=3.0), layout="list", timestep_scale=1e-3, names=("x", "t", "cap_feats"),
        timesteps_rise=True,
    ),
    "HunyuanVideoTransformer3DModel": TransformerSpec(
        flow=True, text_dim="text_embed_dim", pooled_dim="pooled_projection_dim", text_tokens=256,
        scheduler="FlowMatchEulerDiscreteScheduler", scheduler_config=dict(shift=7.0),
        text_mask="encoder_attention_mask", guidance=6000.0,
    ),
    "LTXVideoTransformer3DModel": TransformerSpec(
        flow=True, text_dim="caption_channels", text_tokens=128, scheduler="FlowMatchEulerDiscreteScheduler",
        scheduler_config=dict(shift=1.0, use_dynamic_shifting=True, **FLOW_SHIFT), layout="flat",
        dynamic_shift=True, text_mask="encoder_attention_mask", sizes=True,
        shift=dict(base_image_seq_len=1024, max_image_seq_len=4096, base_shift=0.95, max_shift=2.05),
    ),
}
NO_TRANSFORMER_PEER = (
    "no other ToMe implementation exists for diffusion transformers (tomesd, ComfyUI, A1111/Forge and SD.Next "
    "merge UNets only)"
)


def transformer_spec(model: Any) -> Optional[TransformerSpec]:
    """The :class:`TransformerSpec` of ``model``'s class (or of the nearest base named in the table), or None."""
    for cls in type(model).__mro__:
        if cls.__name__ in TRANSFORMER_SPECS:
            return TRANSFORMER_SPECS[cls.__name__]
    return None


def pack_latents(latents: np.ndarray) -> np.ndarray:
    """``[B, C, H, W]`` -> ``[B, H/2 * W/2, 4C]``: Flux's packing of 2x2 latent patches into tokens."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(patches.reshape(b, (h // 2) * (w // 2), c * 4))


def packed_ids(height: int, width: int, columns: int = 3) -> np.ndarray:
    """Flux's ``img_ids`` ``[height * width, 3]``: (0, row, column) of each packed token (Flux.2's, ``columns=4``:
    (0, row, column, 0))."""
    ids = np.zeros((height, width, columns), dtype="float32")
    ids[..., 1] = np.arange(height)[:, None]
    ids[..., 2] = np.arange(width)[None, :]
    return ids.reshape(-1, columns)


def flux_mu(image_tokens: int, shift: Optional[Dict[str, float]] = None) -> float:
    """Flux's sigma shift for ``image_tokens`` (diffusers' ``calculate_shift`` with its defaults, or with
    ``shift``'s parameters)."""
    shift = shift or FLOW_SHIFT
    slope = (shift["max_shift"] - shift["base_shift"]) / (shift["max_image_seq_len"] - shift["base_image_seq_len"])
    return image_tokens * slope + shift["base_shift"] - slope * shift["base_image_seq_len"]


def draw_latents(args: Any, shape: Tuple[int, ...], image_like: Callable[..., np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """The clean latents of ``shape`` (``image_like(*shape, seed=0)`` under ``--latents image``, else Gaussian
    from seed 0) and the noise drawn for them (Gaussian from seed 1), float32 numpy."""
    if getattr(args, "latents", "image") == "image":
        clean = image_like(*shape, seed=0)
    else:
        clean = np.random.default_rng(0).standard_normal(shape).astype("float32")
    return clean, np.random.default_rng(1).standard_normal(shape).astype("float32")


def image_part(x: Any, family: BlockFamily, grid: Tuple[int, int], tail: int = 0, grid_last: bool = False) -> Any:
    """The image tokens of a block's input ``x`` ``[B, L, C]``, what the patch matches on, for a call whose grid,
    tail and ``grid_last`` are given (:func:`tome_core.hooks.block_hooks.image_tokens`)."""
    ops = get_ops(x)
    head, tail = around_grid(ops, x, family.stream, grid, tail, grid_last)
    return image_tokens(ops, x, family.stream, grid, head, tail)


def hook_oracle(
    fw: Framework, model: Any, config: ToMeConfig, call: Optional[Tuple[Tuple[int, int], int, bool]] = None,
) -> Undo:
    """Hook the oracle of ``config`` into ``model`` (:func:`tome_tools.oracle.attach_oracle`: the patch's own
    hooks, each match keeping the first tokens); returns what removes it. The call's grid and tail are read from
    each model call as the patch reads them; ``call=(grid, tail, grid_last)`` gives them instead (blocks run on
    their own, as ``--micro`` runs them)."""
    patch = attach_oracle(fw, model, config)
    if call is not None:
        grid, tail, grid_last = call
        patch.state.begin_call(CallFacts(grid, MID_TIMESTEP, tail=tail, grid_last=grid_last))
        patch.state.enter_grid(grid)
    return patch.remove


def median_ms(
    functions: Dict[str, Callable[[], Any]], repeats: int, warmup: int = 2,
    contexts: Optional[Dict[str, Callable[[], Any]]] = None, raw: Optional[Dict[str, List[float]]] = None,
) -> Dict[str, float]:
    """Median milliseconds of each function, called in turn (A B A B ...) ``repeats`` times after ``warmup``
    untimed rounds (the micro benchmarks' timing). ``contexts[name]()`` (if given) is a context manager each
    call of ``name`` runs inside, entered and left outside the timed part (e.g. a patch). ``raw`` (if given)
    receives every timed call's milliseconds, in round order."""
    times: Dict[str, List[float]] = {name: [] for name in functions}
    for round_index in range(warmup + repeats):
        for name, function in functions.items():
            with (contexts or {}).get(name, contextlib.nullcontext)():
                start = time.perf_counter()
                function()
                elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(elapsed)
    if raw is not None:
        raw.update({name: [x * 1000 for x in t] for name, t in times.items()})
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def overhead_shares(block_ms: float, match_ms: float, merge_unmerge_ms: float, reuse: Iterable[int] = (1, 2, 4)) -> Dict[str, float]:
    """Match + merge + unmerge as a share of a block's time when one match serves ``k`` blocks (or steps):
    ``(match / k + merge_unmerge) / block``, for each ``k`` in ``reuse``."""
    return {f"reuse_{k}": (match_ms / k + merge_unmerge_ms) / block_ms for k in reuse}


class BenchRunner:
    """One UNet (or diffusion transformer) and fixed inputs; ``method(name, ratio)`` patches it for one of the
    bench's methods.

    Methods: ``unpatched``, ``ours`` and ``ours:VARIANT`` (tome_core with the bench's options), ``peer``
    (another ToMe implementation in the same framework) and ``oracle`` (free token reduction). Subclasses
    implement the hooks below; the defaults of :meth:`timesteps` and :meth:`scheduler_step` speak the
    diffusers scheduler API (torch diffusers and ppdiffusers share it).
    """

    has_peer = False
    scheduler_class: Any = None  # the framework's DDIM scheduler, built with DDIM_CONFIG
    latent_scale = 8  # pixels per latent position (1 for a pixel-space model)
    trained: Any = None  # a trained model (tome_tools.trained) when ``--model`` is one: sample fidelity applies
    active_stack: Optional[str] = None  # the speed-up of the current method (``--stack``), set up by apply_stack

    def __init__(self, args: Any):
        if getattr(args, "threads", None):
            self.set_threads(args.threads)
        if isinstance(args.resolution, (list, tuple)):  # a runner serves one resolution (bench.run loops)
            if len(args.resolution) != 1:
                raise ValueError(f"a runner takes one resolution, got {args.resolution}")
            args.resolution = args.resolution[0]
        self.args = args
        self.options = dict(getattr(args, "options", {}))
        args.variants = getattr(args, "variants", {})
        self.stacks: Dict[str, Dict[str, Any]] = dict(getattr(args, "stacks", None) or {})
        self.unet = self.load_unet()
        self.spec = transformer_spec(self.unet)
        self.description = f"{args.model or args.preset} {args.resolution}px batch {args.batch}"
        own = self.own_scheduler()
        if self.spec is None:
            self.scheduler = own or self.scheduler_class(**DDIM_CONFIG)
            self._build_inputs(self.unet.config)
        else:
            self.has_peer = False
            self.scheduler = own or self.make_scheduler(self.spec.scheduler, self.spec.scheduler_config)
            self._build_transformer_inputs(self.unet.config)

    def clean_latents(self, channels: int) -> Tuple[np.ndarray, np.ndarray]:
        """The clean latents of the timed calls and the noise drawn for them (also the loop's starting noise),
        numpy in the model's layout, seeded: image-like (``--latents image``) or Gaussian latents ``[batch,
        channels, latent, latent]`` at ``--resolution``. Sets ``latent_hw``, the grid ToMe and the oracle see
        (a video runner gives videos, :class:`tome_tools.bench_video.VideoBench`). A video transformer of
        :data:`~tome_tools.presets.TRANSFORMER_VIDEOS` gets panning videos ``[batch, channels, frames, h, w]``
        (its frames' grids stacked in rows as ``latent_hw``)."""
        args = self.args
        video = self.video_latent_size()
        if video is not None:
            frames, height, width = video
            self.latent_hw = (frames * height, width)
            clean, noise = draw_latents(args, (args.batch, frames, channels, height, width), video_latents)
            layout = lambda x: np.ascontiguousarray(np.moveaxis(x, 1, 2))  # noqa: E731
            return layout(clean), layout(noise)
        latent = args.resolution // self.latent_scale
        self.latent_hw = (latent, latent)
        return draw_latents(args, (args.batch, channels, latent, latent), image_like_latents)

    def video_latent_size(self) -> Optional[Tuple[int, int, int]]:
        """``(frames, height, width)`` of a video transformer preset's latent
        (:data:`~tome_tools.presets.TRANSFORMER_VIDEOS`; ``--resolution`` is its frame height, the width keeps the
        preset's aspect ratio), else None."""
        from tome_tools.presets import TRANSFORMER_VIDEOS

        entry = None if getattr(self.args, "model", None) else TRANSFORMER_VIDEOS.get(self.args.preset)
        if entry is None:
            return None
        height, width = entry["size"]
        resolution = self.args.resolution or height
        width = round(resolution * width / height / entry["space"]) * entry["space"]
        return (entry["frames"] - 1) // entry["time"] + 1, resolution // entry["space"], width // entry["space"]

    def _build_inputs(self, config: Any) -> None:
        """Noised image-like (or noise) latents at the mid timestep, the starting noise of the sampling
        loop, text embeddings and, for SDXL-style UNets, the added text and time conditions."""
        args = self.args
        clean, noise = self.clean_latents(config.in_channels)
        self.sample_in = self.to_tensor(noised(clean, noise, self.alpha_bar(MID_TIMESTEP)))
        self.noise = self.to_tensor(noise)
        self.timestep = self.as_timestep(MID_TIMESTEP)
        draw = self.normal_draws(seed=2)
        self.text = self.text_embeddings(draw, (args.batch, 77, config.cross_attention_dim))
        self.added = None
        if config.addition_embed_type == "text_time":
            pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            size = self.latent_hw[0] * 8
            self.added = {
                "text_embeds": draw((args.batch, pooled)),
                "time_ids": self.to_tensor(np.array([[size, size, 0, 0, size, size]] * args.batch, dtype="float32")),
            }

    def _build_transformer_inputs(self, config: Any) -> None:
        """A diffusion transformer's inputs: image-like (or noise) latents (:meth:`clean_latents`; a video
        transformer's are videos) noised to the mid timestep (flow matching or DDPM, :class:`TransformerSpec`),
        packed into tokens with their ids for Flux; the loop's starting noise; seeded text embeddings of the
        released prompt length (``--text-tokens`` overrides it), the pooled projection and Flux's guidance."""
        args, spec = self.args, self.spec
        channels = config.in_channels // 4 if spec.packed else config.in_channels
        self.latent_channels = channels
        clean, noise = self.clean_latents(channels)
        if spec.flow:
            sigma = MID_TIMESTEP / 1000
            start = ((1 - sigma) * clean + sigma * noise).astype("float32")
        else:
            start = noised(clean, noise, self.alpha_bar(MID_TIMESTEP))
        video = self.video_latent_size()
        if spec.packed:
            start, noise = pack_latents(start), pack_latents(noise)
        elif spec.layout == "flat":  # [B, C, F, H, W] -> [B, F*H*W, C], as LTX's pipeline packs (patch 1)
            flat = lambda x: np.ascontiguousarray(x.reshape(x.shape[0], x.shape[1], -1).transpose(0, 2, 1))  # noqa: E731
            start, noise = flat(start), flat(noise)
        elif spec.layout == "list" and start.ndim == 4:  # Z-Image: [C, F, H, W] per item
            start, noise = start[:, :, None], noise[:, :, None]
        self.sample_in = self.to_tensor(start)
        self.noise = self.to_tensor(noise)
        self.timestep = MID_TIMESTEP
        draw = self.normal_draws(seed=2)
        text_tokens = getattr(args, "text_tokens", None) or spec.text_tokens
        self.text = self.text_embeddings(draw, (args.batch, text_tokens, config[spec.text_dim]))
        self.extra: Dict[str, Any] = {}
        patch = config.get("patch_size") or 2  # Z-Image's (all_patch_size) is 2
        patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
        self.image_tokens = self.latent_hw[0] * self.latent_hw[1] // patch**2  # for the loop's sigma shift
        if spec.pooled_dim:
            self.extra["pooled_projections"] = draw((args.batch, config[spec.pooled_dim]))
        if spec.packed:
            rows, cols = self.latent_hw[0] // 2, self.latent_hw[1] // 2
            self.image_tokens = rows * cols
            if spec.img_shapes:
                self.extra["img_shapes"] = [[(1, rows, cols)]] * args.batch
            else:
                columns = spec.ids_columns
                self.extra["img_ids"] = self.to_tensor(packed_ids(rows, cols, columns))
                text_ids = np.zeros((text_tokens, columns), dtype="float32")
                if columns == 4:  # Flux.2: (0, 0, 0, position)
                    text_ids[:, 3] = np.arange(text_tokens)
                self.extra["txt_ids"] = self.to_tensor(text_ids)
        guidance = spec.guidance if spec.guidance is not None else (3.5 if config.get("guidance_embeds") else None)
        if guidance is not None and config.get("guidance_embeds", True):
            self.extra["guidance"] = self.to_tensor(np.full((args.batch,), guidance, dtype="float32"))
        if spec.text_mask:
            self.extra[spec.text_mask] = self.to_tensor(np.ones((args.batch, text_tokens), dtype="int64"))
        if spec.sizes:
            frames, height, width = video
            self.extra.update(num_frames=frames, height=height, width=width, rope_interpolation_scale=(8 / 25, 32, 32))
        if spec.added_cond:
            self.extra["added_cond_kwargs"] = {"resolution": None, "aspect_ratio": None}

    def transformer_kwargs(self, sample: Any, timestep: Any) -> Dict[str, Any]:
        """Keyword arguments of one transformer call on ``sample`` at scheduler timestep ``timestep`` (a list of
        items where the model takes one: :attr:`TransformerSpec.layout` ``list``)."""
        spec = self.spec
        value = (1000 - float(timestep) if spec.timesteps_rise else float(timestep)) * spec.timestep_scale
        latent_name, time_name, text_name = spec.names
        text = self.text
        if spec.layout == "list":
            sample = [sample[i] for i in range(self.args.batch)]
            text = [text[i] for i in range(self.args.batch)]
        return {
            latent_name: sample,
            text_name: text,
            time_name: self.to_tensor(np.full((self.args.batch,), value, dtype="float32")),
            **self.extra,
        }

    def forward(self, sample: Any, timestep: Any) -> Any:
        """The model's prediction for ``sample`` at ``timestep`` with the current method (a transformer's
        learned-variance channels dropped, as its pipeline drops them; a list of items stacked; Z-Image's
        negated velocity turned back, as its pipeline turns it)."""
        if self.spec is None:
            return self.unet_call(sample, timestep)
        out = self.transformer_call(self.transformer_kwargs(sample, timestep))
        if isinstance(out, (list, tuple)):
            out = get_ops(out[0]).concat([item[None] for item in out], axis=0)
        if self.spec.timesteps_rise:
            out = -out
        if self.spec.layout == "grid" and not self.spec.packed and get_ops(out).shape(out)[1] == 2 * self.latent_channels:
            out = out[:, : self.latent_channels]
        return out

    # -- framework hooks ---------------------------------------------------------------------------------
    def set_threads(self, threads: int) -> None:
        """Use ``threads`` intra-op threads (``--threads``); called before the model is built."""
        raise NotImplementedError

    def load_unet(self) -> Any:
        """The UNet of ``--model`` (a local folder) or of ``--preset`` (random weights)."""
        raise NotImplementedError

    def own_scheduler(self) -> Any:
        """The model's own scheduler for the mid timestep and the loop (a trained model's), or None for the
        defaults (DDIM for UNets, the released pipeline's for transformers)."""
        return None

    def text_embeddings(self, draw: Callable[[Tuple[int, ...]], Any], shape: Tuple[int, ...]) -> Any:
        """The text-like conditioning of the timed calls: seeded normals of ``shape`` (a trained model gives
        its classes' learned tokens instead)."""
        return draw(shape)

    def finest_level(self) -> int:
        """The finest downsample level with attention, as 'ours' resolves ``max_downsample=None``."""
        raise NotImplementedError

    def to_tensor(self, array: np.ndarray) -> Any:
        """A numpy array as the framework's array."""
        raise NotImplementedError

    def as_timestep(self, timestep: int) -> Any:
        """The UNet's timestep argument for the mid-timestep call (a Python int unless overridden)."""
        return timestep

    def normal_draws(self, seed: int) -> Callable[[Tuple[int, ...]], Any]:
        """A function drawing float32 standard normals of a given shape, in sequence from ``seed``."""
        rng = np.random.default_rng(seed)
        return lambda shape: self.to_tensor(rng.standard_normal(shape).astype("float32"))

    def unet_call(self, sample: Any, timestep: Any) -> Any:
        """The UNet's output (``.sample``) for ``sample`` at ``timestep``, with the current method."""
        raise NotImplementedError

    def transformer_call(self, kwargs: Dict[str, Any]) -> Any:
        """A diffusion transformer's output (``.sample``) for these keyword arguments, with the current method."""
        raise NotImplementedError

    def make_scheduler(self, name: str, config: Dict[str, Any]) -> Any:
        """The framework's scheduler class ``name`` (diffusers' names) built with ``config``."""
        raise NotImplementedError

    def framework(self) -> Framework:
        """The patch driver's :class:`~tome_core.framework.Framework` of this framework (the transformer oracle's
        hooks go through it)."""
        raise NotImplementedError

    def done(self, output: Any) -> Any:
        """``output``, computed to the end (the timed part of a call ends here)."""
        return output

    def alpha_bar(self, timestep: int) -> float:
        """The scheduler's cumulative alpha at ``timestep``."""
        return float(self.scheduler.alphas_cumprod[timestep])

    def timesteps(self, steps: int) -> Iterable[Any]:
        """The timesteps of a ``steps``-step loop (DDIM for UNets, the transformer's own scheduler)."""
        if self.spec is not None and self.spec.dynamic_shift:  # as FluxPipeline sets them
            sigmas = np.linspace(1.0, 1 / steps, steps)
            self.scheduler.set_timesteps(steps, sigmas=sigmas, mu=flux_mu(self.image_tokens, self.spec.shift))
        else:
            self.scheduler.set_timesteps(steps)
        return self.scheduler.timesteps

    def scheduler_step(self, model_output: Any, timestep: Any, latents: Any) -> Any:
        """One DDIM step: the latents at the previous timestep."""
        return self.scheduler.step(model_output, timestep, latents).prev_sample

    def patch_ours(self, options: Dict[str, Any]) -> Undo:
        """Patch the UNet with tome_core and these options; returns what unpatches it."""
        raise NotImplementedError

    def patch_peer(self, ratio: float, max_downsample: int, options: Dict[str, Any]) -> Undo:
        """Patch the UNet with the peer implementation; returns what unpatches it."""
        raise ValueError(f"no peer to run: {self.peer_note()}")

    def install_oracle(self, name: str, ratio: float) -> Undo:
        """Hook in the oracle of method ``ours`` or ``ours:NAME`` (``oracle`` / ``oracle:NAME``): free removal of
        the tokens it merges, at the same blocks, levels and sizes and in the same arrangement, by the library's
        own hooks (:func:`hook_oracle`); returns what removes it."""
        config = ToMeConfig.from_options(self.options_for(name, ratio))
        return hook_oracle(self.framework(), self.unet, config)

    def peer_note(self) -> str:
        """What the peer is, or why there is none."""
        return ""

    def apply_stack(self, name: str, settings: Dict[str, Any]) -> Undo:
        """Set up speed-up ``name`` (``--stack``, :data:`tome_tools.bench.STACKS`) with these settings on the loop's
        pipeline; returns what takes it off again."""
        raise NotImplementedError(f"--stack runs on the torch backend only, not {type(self).__module__}")

    def run_loop(self, stack: Optional[str]) -> Any:
        """One whole sampling loop of the pipeline (``--steps`` steps, fixed starting noise and conditioning),
        through speed-up ``stack``'s own entry point when it has one; its final output (latents, or a trained
        model's samples)."""
        raise NotImplementedError(f"--stack runs on the torch backend only, not {type(self).__module__}")

    # -- methods -------------------------------------------------------------------------------------------
    def max_downsample(self) -> int:
        """The level bound 'ours' resolves to; the peer and the oracle merge the same levels."""
        chosen = self.options.get("max_downsample")
        return chosen if chosen is not None else self.finest_level()

    def options_for(self, name: str, ratio: float) -> Dict[str, Any]:
        """ToMe options of method ``ours`` or ``ours:VARIANT`` (and of the oracle ``oracle`` / ``oracle:VARIANT``
        copies). ``ratio`` (the bench's ``--ratio``) is left out with ``matching='cell'``, where the cell fixes
        the reduction, and with ``mode='auto'``, which chooses it; a ratio the options name themselves stays (and
        ToMeConfig checks it)."""
        variant = name.partition(":")[2]
        chosen = {**self.options, **(self.args.variants[variant] if variant else {})}
        if chosen.get("matching") == "cell" or chosen.get("mode") == "auto":
            return chosen
        return {"ratio": ratio, **chosen}

    def config_for(self, name: str, ratio: float) -> ToMeConfig:
        """The options of method ``name`` at this run's size, ``mode='auto'`` resolved as the patch resolves it
        (by the finest merged level's token count; a transformer's tokens are its 2x2 latent patches)."""
        config = ToMeConfig.from_options(self.options_for(name, ratio))
        if config.mode != "auto":
            return config
        if self.spec is None:
            latent_hw, finest = self.latent_hw, self.finest_level()
        else:  # the patch sees a transformer's grid of 2x2 latent patches as its latent
            latent_hw, finest = (self.latent_hw[0] // 2, self.latent_hw[1] // 2), 1
        choices = config.auto_choices(self.spec is None or self.spec.separate_kv, self.spec is None)
        return ToMeState(config=config, finest_level=finest, call=CallFacts(latent_hw), choices=choices).active

    def effective(self, name: str, ratio: float) -> Tuple[float, str]:
        """The ratio a row of method ``name`` shows, and a note: 'ours' and the oracle with cell matching show
        the reduction of the finest merged level's cell (``cell 4x4 (L1), 2x2 (L2)``); other options they set
        are noted too (``mode=kv``)."""
        stack, base = self.split_stack(name)
        if stack is not None:
            settings = ", ".join(f"{k}={v}" for k, v in self.stacks[stack].items())
            shown, note = self.effective(base, ratio)
            return shown, f"{stack} {settings}" + (f"; {note}" if note else "")
        if not (name.startswith("ours") or name.startswith("oracle")):
            return ratio, self.note(name)
        config = self.config_for(name, ratio)
        notes = [] if config.mode == "tokens" else [f"mode={config.mode}"]
        finest = self.finest_level() if self.spec is None else 1
        deepest = self.max_downsample_of(config) if self.spec is None else 1
        if config.matching == "cell":
            levels = [level for level in (1, 2, 4, 8) if finest <= level <= deepest]
            cells = ", ".join("{}x{} (L{})".format(*config.cell_at(level), level) for level in levels)
            notes.append(f"cell {cells}")
            return config.max_ratio_at(finest), " ".join(notes)
        if self.spec is None and config.level_cells:
            notes.append("cells " + ", ".join("{}x{} (L{})".format(*cell, level) for level, cell in config.level_cells.items()))
        return config.ratio, " ".join(notes)

    def max_downsample_of(self, config: ToMeConfig) -> int:
        return config.max_downsample if config.max_downsample is not None else self.finest_level()

    def peer_options(self) -> Dict[str, Any]:
        """The bench's options the peer understands."""
        return {k: v for k, v in self.options.items() if k in PEER_OPTIONS}

    def split_stack(self, name: str) -> Tuple[Optional[str], str]:
        """``deepcache+ours:plain`` -> ``("deepcache", "ours:plain")``, ``tgate`` -> ``("tgate", "unpatched")``,
        ``ours`` -> ``(None, "ours")``: a ``--stack`` method's speed-up and the bench method beside it."""
        head, sep, rest = name.partition("+")
        if head in self.stacks:
            return head, rest if sep else "unpatched"
        return None, name

    def _apply(self, name: str, ratio: float) -> Undo:
        stack, base = self.split_stack(name)
        if stack is not None:  # the speed-up first, then ToMe (README: either order works), undone in reverse
            undo_stack = self.apply_stack(stack, self.stacks[stack])
            self.active_stack = stack
            try:
                undo_base = self._apply(base, ratio)
            except BaseException:
                self.active_stack = None
                undo_stack()
                raise

            def undo() -> None:
                try:
                    undo_base()
                finally:
                    self.active_stack = None
                    undo_stack()

            return undo
        if name.startswith("ours"):
            return self.patch_ours(self.options_for(name, ratio))
        if name == "peer":
            return self.patch_peer(ratio, self.max_downsample(), self.peer_options())
        if name.startswith("oracle"):
            return self.install_oracle(name, ratio)
        if name != "unpatched":
            raise ValueError(f"unknown bench method {name!r}")
        return lambda: None

    @contextlib.contextmanager
    def method(self, name: str, ratio: float) -> Iterator[None]:
        """The UNet patched for method ``name`` at ``ratio`` inside the block, unpatched after it."""
        undo = self._apply(name, ratio)
        try:
            yield
        finally:
            undo()

    def note(self, name: str) -> str:
        if name != "peer":
            return ""
        return NO_TRANSFORMER_PEER if self.spec is not None else self.peer_note()

    # -- calls ---------------------------------------------------------------------------------------------
    def call(self) -> Any:
        """One UNet call on the fixed inputs at the mid timestep: what the bench times."""
        return self.done(self.forward(self.sample_in, self.timestep))

    def loop(self) -> Any:
        """One whole pipeline loop with the current method (``--stack``): what a stacked run times."""
        return self.done(self.run_loop(self.active_stack))

    def loop_output(self, name: str, ratio: float) -> np.ndarray:
        """Method ``name``'s final output of :meth:`loop`, as numpy."""
        with self.method(name, ratio):
            return np.asarray(self.loop())

    def output(self, name: str, ratio: float) -> np.ndarray:
        """Method ``name``'s output of :meth:`call`, as numpy."""
        with self.method(name, ratio):
            return np.asarray(self.call())

    def sample(self, name: str, ratio: float, steps: int) -> np.ndarray:
        """A short DDIM loop from fixed noise; the final latents."""
        latents = self.noise
        with self.method(name, ratio):
            for t in self.timesteps(steps):
                latents = self.scheduler_step(self.forward(latents, t), t, latents)
        return np.asarray(latents)

    def peak_memory_mb(self, name: str, ratio: float) -> float:
        """Extra peak resident memory of one call, measured in a fresh process."""
        return peak_memory_in_fresh_process(type(self).__module__, self.args, name, ratio)
