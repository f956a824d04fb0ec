"""The torch side of the trained models (:mod:`tome_tools.trained`): architectures, training, loading, sampling.

A trained model's folder holds what diffusers' ``from_pretrained`` reads (``unet/`` or ``transformer/`` and
``scheduler/``, weights stored in float16 to keep the repository small), the learned class conditioning
(``conditioning.safetensors``: one sequence of text-like tokens per class, plus a null class for
classifier-free guidance) and ``model_info.json`` (classes, image size, guidance, the training run and its loss
curve). The classifier's folder holds ``classifier.safetensors`` and ``classifier.json``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from diffusers import DDIMScheduler, DDPMScheduler, PixArtTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel
from safetensors.torch import load_file, save_file
from torch import nn

from tome_tools.trained import CLASSES, IMAGE_SIZE, crops, model_info

CONDITION_TOKENS = 4
CONDITION_DIM = 64
GUIDANCE = 3.0
SCHEDULER = dict(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", prediction_type="epsilon", clip_sample=True)

# SD 1.x's layout at 1/10 the width: cross-attention at the 32x32 = 1024-token finest level and at 16x16,
# one head at the finest level (where attention costs most to train on a CPU).
UNET = dict(
    sample_size=IMAGE_SIZE, in_channels=3, out_channels=3, block_out_channels=(32, 64, 64),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=1, cross_attention_dim=CONDITION_DIM, attention_head_dim=(1, 2, 2), norm_num_groups=32,
)
# PixArt-alpha's block at patch size 2: 16x16 = 256 image tokens, six blocks of width 128.
DIT = dict(
    sample_size=IMAGE_SIZE, num_layers=6, patch_size=2, attention_head_dim=32, num_attention_heads=4,
    caption_channels=CONDITION_DIM, in_channels=3, out_channels=3, cross_attention_dim=128, attention_bias=True,
    activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
    norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None, use_additional_conditions=False,
)
# SD3's MM-DiT block (joint attention over [image; text], each stream with its own projections) at patch size
# 2: 256 image tokens beside the class's 4 conditioning tokens, width 128. The pooled projection is the mean of
# the conditioning tokens.
MMDIT = dict(
    sample_size=IMAGE_SIZE, patch_size=2, in_channels=3, out_channels=3, num_layers=4, attention_head_dim=32,
    num_attention_heads=4, joint_attention_dim=CONDITION_DIM, caption_projection_dim=128,
    pooled_projection_dim=CONDITION_DIM, pos_embed_max_size=IMAGE_SIZE // 2,
)
SUBFOLDER = {"unet": "unet", "dit": "transformer", "mmdit": "transformer"}
MODEL_CLASSES = {"unet": UNet2DConditionModel, "dit": PixArtTransformer2DModel, "mmdit": SD3Transformer2DModel}
CONFIGS = {"unet": UNET, "dit": DIT, "mmdit": MMDIT}


class Classifier(nn.Module):
    """A small CNN over 32x32 crops: three conv stages, global average pooling, one linear layer."""

    def __init__(self, classes: int = len(CLASSES), width: int = 32):
        super().__init__()
        layers: List[nn.Module] = []
        channels = 3
        for out in (width, 2 * width, 2 * width):
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.GroupNorm(8, out), nn.SiLU(), nn.MaxPool2d(2)]
            channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean(dim=(2, 3)))


@dataclass
class TrainedModel:
    """A loaded trained model: the diffusers model, its class conditioning and scheduler, and its info."""

    model: torch.nn.Module
    conditioning: torch.Tensor  # (classes + 1, tokens, dim); the last row is the null class
    scheduler_config: Dict[str, Any]
    info: Dict[str, Any]

    @property
    def is_transformer(self) -> bool:
        return self.info["kind"] != "unet"

    def condition(self, labels: torch.Tensor) -> torch.Tensor:
        """The text-like conditioning tokens of class ``labels`` (``len(CLASSES)`` is the null class)."""
        return self.conditioning[labels]

    def predict(self, sample: torch.Tensor, timestep: Any, labels: torch.Tensor) -> torch.Tensor:
        """The model's noise prediction for ``sample`` at ``timestep`` conditioned on ``labels``."""
        return call_model(self.model, sample, timestep, self.condition(labels))


def call_model(model: torch.nn.Module, sample: torch.Tensor, timestep: Any, context: torch.Tensor) -> torch.Tensor:
    """One call of a UNet or PixArt transformer on ``sample`` with conditioning tokens ``context``."""
    if not torch.is_tensor(timestep) or timestep.ndim == 0:
        timestep = torch.full((sample.shape[0],), int(timestep), dtype=torch.long)
    if isinstance(model, UNet2DConditionModel):
        return model(sample, timestep, context).sample
    if isinstance(model, SD3Transformer2DModel):
        return model(
            hidden_states=sample, encoder_hidden_states=context, pooled_projections=context.mean(1), timestep=timestep
        ).sample
    kwargs = {"resolution": None, "aspect_ratio": None}
    return model(sample, encoder_hidden_states=context, timestep=timestep, added_cond_kwargs=kwargs).sample


def build(kind: str) -> torch.nn.Module:
    """A fresh model of ``kind`` (``unet``, ``dit`` or ``mmdit``) with the current torch seed."""
    if kind not in MODEL_CLASSES:
        raise ValueError(f"kind must be one of {', '.join(map(repr, MODEL_CLASSES))}, got {kind!r}")
    return MODEL_CLASSES[kind](**CONFIGS[kind])


def _log(step: int, steps: int, loss: float, start: float) -> None:
    print(f"step {step:5d}/{steps}  loss {loss:.4f}  {time.perf_counter() - start:6.0f}s", flush=True)


def train_diffusion(
    kind: str, out: str, steps: int, batch: int = 32, seed: int = 0, lr: float = 1e-3, per_class: int = 512,
    log_every: int = 25, ema_decay: float = 0.995, drop_class: float = 0.1,
) -> Dict[str, Any]:
    """Train a class-conditional pixel-space diffusion model of ``kind`` and save it to ``out``.

    Epsilon prediction under the cosine schedule, AdamW with a linear warm-up and cosine decay, an exponential
    moving average of the weights (what is saved), and the class dropped to the null class with probability
    ``drop_class`` so classifier-free guidance works. Prints the loss curve (the mean over every ``log_every``
    steps) and returns the run's record, which is also written into ``model_info.json``.
    """
    torch.manual_seed(seed)
    images, labels = crops(per_class, seed=seed)
    images, labels = torch.from_numpy(images), torch.from_numpy(labels)
    model = build(kind).train()
    conditioning = nn.Parameter(torch.randn(len(CLASSES) + 1, CONDITION_TOKENS, CONDITION_DIM))
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}
    ema_conditioning = conditioning.detach().clone()
    parameters = list(model.parameters()) + [conditioning]
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * min(s, steps) / steps))
    )
    scheduler = DDPMScheduler(**SCHEDULER)
    generator = torch.Generator().manual_seed(seed)
    curve: List[List[float]] = []
    window: List[float] = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        index = torch.randint(0, len(images), (batch,), generator=generator)
        clean, label = images[index], labels[index].clone()
        flip = torch.rand(batch, generator=generator) < 0.5
        clean = torch.where(flip[:, None, None, None], clean.flip(-1), clean)
        label[torch.rand(batch, generator=generator) < drop_class] = len(CLASSES)
        noise = torch.randn(clean.shape, generator=generator)
        timestep = torch.randint(0, SCHEDULER["num_train_timesteps"], (batch,), generator=generator)
        noisy = scheduler.add_noise(clean, noise, timestep)
        loss = torch.nn.functional.mse_loss(call_model(model, noisy, timestep, conditioning[label]), noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            decay = min(ema_decay, (1 + step) / (10 + step))
            for name, p in model.named_parameters():
                ema[name].lerp_(p.detach(), 1 - decay)
            ema_conditioning.lerp_(conditioning.detach(), 1 - decay)
        window.append(loss.item())
        if step % log_every == 0 or step == steps:
            curve.append([step, float(np.mean(window))])
            _log(step, steps, curve[-1][1], start)
            window = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(ema[name])
    record = dict(
        kind=kind, steps=steps, batch=batch, seed=seed, lr=lr, per_class=per_class, ema_decay=ema_decay,
        drop_class=drop_class, seconds=round(time.perf_counter() - start), threads=torch.get_num_threads(),
        loss_curve=curve,
    )
    save(model.eval(), ema_conditioning, kind, out, record)
    return record


def save(model: torch.nn.Module, conditioning: torch.Tensor, kind: str, out: str, record: Dict[str, Any]) -> None:
    """Write a trained model's folder (float16 weights; see the module docstring)."""
    os.makedirs(out, exist_ok=True)
    model.to(torch.float16).save_pretrained(os.path.join(out, SUBFOLDER[kind]))
    model.to(torch.float32)
    DDPMScheduler(**SCHEDULER).save_pretrained(os.path.join(out, "scheduler"))
    save_file({"embeddings": conditioning.detach().to(torch.float16).contiguous()}, os.path.join(out, "conditioning.safetensors"))
    info = dict(kind=kind, classes=list(CLASSES), image_size=IMAGE_SIZE, guidance=GUIDANCE, training=record)
    with open(os.path.join(out, "model_info.json"), "w") as f:
        json.dump(info, f, indent=1)


def load(folder: str) -> TrainedModel:
    """A trained model from its folder, in float32 and eval mode (diffusers' ``from_pretrained``, local only)."""
    info = model_info(folder)
    if info is None:
        raise FileNotFoundError(f"{folder} is not a trained model's folder: it has no model_info.json")
    cls = MODEL_CLASSES[info["kind"]]
    model = cls.from_pretrained(
        folder, subfolder=SUBFOLDER[info["kind"]], torch_dtype=torch.float32, local_files_only=True
    ).eval()
    conditioning = load_file(os.path.join(folder, "conditioning.safetensors"))["embeddings"].float()
    scheduler_config = dict(DDPMScheduler.from_pretrained(folder, subfolder="scheduler").config)
    return TrainedModel(model, conditioning, scheduler_config, info)


def generate(
    trained: TrainedModel, labels: Sequence[int], steps: int, guidance: Optional[float] = None, seed: int = 0
) -> np.ndarray:
    """Samples of class ``labels`` by a full DDIM loop of ``steps`` steps with classifier-free guidance.

    Sample ``i`` starts from noise seeded with ``seed + i``, so a sample does not depend on the batch it is
    in. Returns ``(N, 3, H, W)`` float32 in [-1, 1] (the scheduler clips the predicted clean image).
    """
    guidance = trained.info["guidance"] if guidance is None else guidance
    size = trained.info["image_size"]
    labels_t = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    noise = [torch.randn((3, size, size), generator=torch.Generator().manual_seed(seed + i)) for i in range(len(labels_t))]
    latents = torch.stack(noise)
    scheduler = DDIMScheduler.from_config(trained.scheduler_config)
    scheduler.set_timesteps(steps)
    null = torch.full_like(labels_t, len(trained.info["classes"]))
    with torch.no_grad():
        for t in scheduler.timesteps:
            both = trained.predict(torch.cat([latents, latents]), t, torch.cat([labels_t, null]))
            conditional, unconditional = both.chunk(2)
            eps = unconditional + guidance * (conditional - unconditional)
            latents = scheduler.step(eps, t, latents).prev_sample
    return latents.clamp(-1, 1).numpy()


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The classifier's augmentations, so that it judges a sample by structure more than by exact colour (small
    diffusion models get textures right before colours): left-right flips, shuffled colour channels, grey
    versions, per-channel gain and offset, and pixel noise."""
    n = images.shape[0]
    draw = lambda *shape: torch.rand(*shape, generator=generator)
    images = torch.where((draw(n) < 0.5)[:, None, None, None], images.flip(-1), images)
    order = torch.argsort(draw(n, 3), dim=1)
    shuffled = torch.gather(images, 1, order[:, :, None, None].expand_as(images))
    images = torch.where((draw(n) < 0.5)[:, None, None, None], shuffled, images)
    grey = images.mean(dim=1, keepdim=True).expand_as(images)
    images = torch.where((draw(n) < 0.2)[:, None, None, None], grey, images)
    images = images * (0.7 + 0.6 * draw(n, 3, 1, 1)) + 0.4 * (draw(n, 3, 1, 1) - 0.5)
    images = images + 0.1 * draw(n, 1, 1, 1) * torch.randn(images.shape, generator=generator)
    return images.clamp(-1, 1)


def train_classifier(out: str, steps: int = 1000, batch: int = 64, seed: int = 0, per_class: int = 512) -> Dict[str, Any]:
    """Train :class:`Classifier` on real crops (seed ``seed``) under :func:`augment`, measure it on fresh crops,
    save it to ``out``."""
    torch.manual_seed(seed)
    images, labels = crops(per_class, seed=seed)
    images, labels = torch.from_numpy(images), torch.from_numpy(labels)
    model = Classifier().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    curve = []
    for step in range(1, steps + 1):
        index = torch.randint(0, len(images), (batch,), generator=generator)
        x = augment(images[index], generator)
        loss = torch.nn.functional.cross_entropy(model(x), labels[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps:
            curve.append([step, loss.item()])
            _log(step, steps, loss.item(), start)
    model.eval()
    held_images, held_labels = crops(64, seed=seed + 1000)
    record = dict(
        steps=steps, batch=batch, seed=seed, per_class=per_class, loss_curve=curve,
        held_out_accuracy=float((predict(model, held_images) == held_labels).mean()), classes=list(CLASSES),
    )
    os.makedirs(out, exist_ok=True)
    save_file(dict(model.state_dict()), os.path.join(out, "classifier.safetensors"))
    with open(os.path.join(out, "classifier.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


def load_classifier(folder: str) -> Classifier:
    """The shipped classifier, in eval mode."""
    model = Classifier()
    model.load_state_dict(load_file(os.path.join(folder, "classifier.safetensors")))
    return model.eval()


def predict(model: Classifier, images: np.ndarray) -> np.ndarray:
    """Class predictions for images ``(N, 3, H, W)`` in [-1, 1]."""
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(images, dtype=np.float32))).argmax(-1).numpy()
