"""Tiny ``ldm`` UNets (Stability's and CompVis' latent-diffusion code, what A1111-style UIs and sdkit run) with
seeded random weights, and their diffusers twins through diffusers' own single-file conversion.

The ``ldm`` package comes from the ``stable-diffusion-sdkit`` wheel, installed ``--no-deps`` (its pins cannot
sit beside torch 2.13). Its ``LatentDiffusion`` needs pytorch-lightning, which cannot be installed here either:
:class:`LatentDiffusionShell` holds a UNet where a ``LatentDiffusion`` holds it (``model.diffusion_model``),
which is all that ``tomesd.apply_patch`` and ToMe read of one. Nothing is downloaded.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Tuple

import torch
from ldm.modules.diffusionmodules.openaimodel import UNetModel

# SD 1.x's layout (convolution projections, a head count) and SD 2.x's (linear projections, a head width), at
# model_channels 32: two levels, attention at both, cross-attention to 32-wide context tokens.
LAYOUTS: Dict[str, Dict[str, Any]] = {
    "sd1": dict(
        image_size=16, in_channels=4, out_channels=4, model_channels=32, attention_resolutions=[1, 2], num_res_blocks=1,
        channel_mult=[1, 2], num_heads=2, use_spatial_transformer=True, transformer_depth=1, context_dim=32,
        legacy=False, use_checkpoint=False,
    ),
    "sd2": dict(
        image_size=16, in_channels=4, out_channels=4, model_channels=32, attention_resolutions=[1, 2], num_res_blocks=1,
        channel_mult=[1, 2], num_head_channels=16, use_spatial_transformer=True, use_linear_in_transformer=True,
        transformer_depth=1, context_dim=32, legacy=False, use_checkpoint=False,
    ),
}


class LatentDiffusionShell(torch.nn.Module):
    """Where A1111's and sdkit's ``LatentDiffusion`` keeps its UNet: ``shell.model.diffusion_model``."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.diffusion_model = unet


def build_ldm_unet(layout: str = "sd1", seed: int = 0, **overrides: Any) -> UNetModel:
    """An ``ldm`` ``UNetModel`` of ``layout`` (:data:`LAYOUTS`) with weights drawn from ``seed``; its
    zero-initialised output layers (``zero_module``: the output convolution, each transformer's ``proj_out``)
    get small random values, so every block shows in the output."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    torch.manual_seed(seed)
    unet = UNetModel(**{**LAYOUTS[layout], **overrides}).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in unet.parameters():
            if not parameter.any():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return unet


def ldm_inputs(unet: UNetModel, height: int, width: int, batch: int = 2, text: int = 7, seed: int = 0) -> Tuple[torch.Tensor, ...]:
    """``(x, timesteps, context)`` of one call of ``unet`` on a ``height x width`` latent, at timestep 500."""
    generator = torch.Generator().manual_seed(seed)
    context_dim = next(m.to_k.in_features for m in unet.modules() if type(m).__name__ == "CrossAttention" and m.to_k.in_features != m.to_q.in_features)
    x = torch.randn(batch, unet.in_channels, height, width, generator=generator)
    return x, torch.full((batch,), 500, dtype=torch.long), torch.randn(batch, text, context_dim, generator=generator)


def _diffusers_config(unet_params: Dict[str, Any], checkpoint: Dict[str, Any]) -> Dict[str, Any]:
    """diffusers' UNet config for ``unet_params`` (its image size given: it cannot infer a tiny model's type)."""
    from diffusers.loaders.single_file_utils import create_unet_diffusers_config_from_ldm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the image_size argument's deprecation
        return create_unet_diffusers_config_from_ldm(original_config({"transformer_depth": 1, **unet_params}), checkpoint, image_size=128)


def original_config(unet_params: Dict[str, Any]) -> Dict[str, Any]:
    """The slice of an ldm ``.yaml`` config that diffusers' single-file conversion reads (a VAE that downsamples 8x)."""
    return {"model": {"params": {
        "unet_config": {"params": unet_params},
        "first_stage_config": {"params": {"ddconfig": {"ch_mult": [1, 2, 4, 4]}}},
    }}}


def to_diffusers(unet: UNetModel, unet_params: Dict[str, Any]) -> torch.nn.Module:
    """``unet``'s weights in a diffusers ``UNet2DConditionModel``, through diffusers' single-file conversion
    (``create_unet_diffusers_config_from_ldm``, ``convert_ldm_unet_checkpoint``)."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    checkpoint = {f"model.diffusion_model.{k}": v for k, v in unet.state_dict().items()}
    config = _diffusers_config(unet_params, checkpoint)
    model = UNet2DConditionModel(**config).eval()
    model.load_state_dict(convert_ldm_unet_checkpoint(checkpoint, config))
    return model


def from_diffusers(model: torch.nn.Module, unet_params: Dict[str, Any]) -> UNetModel:
    """A diffusers UNet's weights in an ``ldm`` ``UNetModel`` built from ``unet_params``: diffusers' conversion
    (:func:`to_diffusers`' direction) run on the ldm model's own keys tells which diffusers key each one becomes,
    and the diffusers weights are read back through that map. Every key must be mapped, in both directions."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    unet = UNetModel(**unet_params).eval()
    own = unet.state_dict()
    checkpoint = {f"model.diffusion_model.{k}": v for k, v in own.items()}
    config = _diffusers_config(unet_params, checkpoint)
    converted = convert_ldm_unet_checkpoint(checkpoint, config)
    by_tensor = {id(v): k for k, v in own.items()}
    renamed = {by_tensor[id(v)]: k for k, v in converted.items()}
    theirs = model.state_dict()
    if set(renamed) != set(own) or set(renamed.values()) != set(theirs):
        raise ValueError(f"{type(model).__name__}'s weights do not map one to one onto this ldm UNet's")
    unet.load_state_dict({k: theirs[renamed[k]].reshape(own[k].shape).to(own[k].dtype) for k in own})
    return unet


# The shipped trained UNet (models/trained-unet: SD 1.x's layout at 1/10 width, 32 wide heads) as an ldm config.
TRAINED_UNET = dict(
    image_size=32, in_channels=3, out_channels=3, model_channels=32, attention_resolutions=[1, 2], num_res_blocks=1,
    channel_mult=[1, 2, 2], num_head_channels=32, use_spatial_transformer=True, transformer_depth=1, context_dim=64,
    legacy=False, use_checkpoint=False,
)


class CalledAsDiffusers(torch.nn.Module):
    """An ldm UNet called as a diffusers UNet is (``model(sample, timestep, context).sample``), so that the trained
    models' sampling loop (:func:`tome_tools.diffusers_trained.generate`) runs it."""

    def __init__(self, unet: UNetModel):
        super().__init__()
        self.unet = unet

    def forward(self, sample: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor, **_: Any) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(sample=self.unet(sample, timestep, encoder_hidden_states))
