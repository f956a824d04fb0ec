"""Small trained models for fidelity you can trust: their data, where they ship, and sample-level metrics.

Random weights have no learned structure, so they cannot say which blocks tolerate merging or how an
arrangement changes an image. The repository ships three small class-conditional pixel-space diffusion models
trained here on photos that come with scikit-image (a UNet, a PixArt transformer and an SD3-style MM-DiT with
joint attention, ``models/``), and a small
classifier trained on real crops of the same photos, which judges generated samples. The training script is
``python -m tome_tools.train``; the benchmark runs them with ``--preset trained-unet`` / ``trained-dit`` and
then reports PSNR, SSIM and classifier accuracy of the samples (:class:`tome_tools.bench.SampleFidelity`).

Framework-free (numpy and scikit-image); the torch side is ``tome_tools.diffusers_trained``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

# The classes: one photo each from skimage.data (all ship inside scikit-image; nothing is downloaded).
CLASSES: Tuple[str, ...] = (
    "astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field", "retina", "brick",
)
IMAGE_SIZE = 32

# The folders under models/ in a checkout: the bench presets, then the classifier that judges their samples.
TRAINED_PRESETS = ("trained-unet", "trained-dit", "trained-mmdit")
SHIPPED = TRAINED_PRESETS + ("classifier",)


def models_dir() -> str:
    """Where the shipped models are: ``$TOME_CORE_MODELS`` if set, else the ``models/`` folder of the checkout
    this package is imported from (the weights are not part of the installed package)."""
    return os.environ.get("TOME_CORE_MODELS") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"
    )


def shipped(name: str) -> str:
    """The folder of shipped model ``name`` (``trained-unet``, ``trained-dit``, ``trained-mmdit`` or ``classifier``).

    Raises FileNotFoundError naming the folder when run from an install without the repository's ``models/``.
    """
    if name not in SHIPPED:
        raise ValueError(f"name must be one of {', '.join(SHIPPED)}, got {name!r}")
    folder = os.path.join(models_dir(), name)
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"the trained model {name!r} ships with the repository, not the package: {folder} does not exist; "
            "run from a checkout of tome_core, set TOME_CORE_MODELS to its models/ folder, or pass the model's "
            "folder as --model PATH"
        )
    return folder


def model_info(folder: str) -> Optional[Dict[str, Any]]:
    """A trained model folder's ``model_info.json`` (classes, image size, guidance, training record), or None
    when ``folder`` is not a trained model's."""
    path = os.path.join(folder, "model_info.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def photo(name: str) -> np.ndarray:
    """Photo ``name`` of skimage.data as float32 RGB in [0, 1] (grey photos repeated over three channels)."""
    import skimage.data

    image = np.asarray(getattr(skimage.data, name)(), dtype=np.float32)
    if image.max() > 1.0:
        image = image / 255.0
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=-1)
    return image[..., :3]


def crops(per_class: int, seed: int, size: int = IMAGE_SIZE) -> Tuple[np.ndarray, np.ndarray]:
    """``per_class`` random square crops of every class's photo, resized to ``size`` pixels.

    A crop's side is drawn between a quarter and two thirds of the photo's short side, its place uniformly,
    and it is flipped left-right with probability 1/2. Returns images ``(N, 3, size, size)`` float32 in
    [-1, 1] (the diffusion models' range) and labels ``(N,)`` int64, class by class.
    """
    from skimage.transform import resize

    rng = np.random.default_rng(seed)
    images: List[np.ndarray] = []
    labels: List[int] = []
    for label, name in enumerate(CLASSES):
        image = photo(name)
        height, width = image.shape[:2]
        short = min(height, width)
        for _ in range(per_class):
            side = int(rng.integers(short // 4, 2 * short // 3 + 1))
            top = int(rng.integers(0, height - side + 1))
            left = int(rng.integers(0, width - side + 1))
            crop = resize(image[top : top + side, left : left + side], (size, size), anti_aliasing=True)
            if rng.random() < 0.5:
                crop = crop[:, ::-1]
            images.append(crop.transpose(2, 0, 1))
            labels.append(label)
    return (np.stack(images).astype(np.float32) * 2 - 1), np.asarray(labels, dtype=np.int64)


def sample_labels(per_class: int) -> np.ndarray:
    """The benchmark's sample set: every class ``per_class`` times, class by class."""
    return np.repeat(np.arange(len(CLASSES)), per_class)


def to_unit(images: np.ndarray) -> np.ndarray:
    """Images in [-1, 1] as float64 in [0, 1], clipped (the range the metrics are computed in)."""
    return np.clip((np.asarray(images, dtype=np.float64) + 1) / 2, 0.0, 1.0)


def psnr(reference: np.ndarray, images: np.ndarray) -> float:
    """Mean PSNR in dB over a batch ``(N, 3, H, W)`` in [-1, 1] (scikit-image's, data range 1); inf when equal."""
    from skimage.metrics import peak_signal_noise_ratio

    reference, images = to_unit(reference), to_unit(images)
    values = [peak_signal_noise_ratio(r, i, data_range=1.0) for r, i in zip(reference, images)]
    return float(np.mean(values))


def ssim(reference: np.ndarray, images: np.ndarray) -> float:
    """Mean SSIM over a batch ``(N, 3, H, W)`` in [-1, 1] (scikit-image's, 7x7 window, channels averaged)."""
    from skimage.metrics import structural_similarity

    reference, images = to_unit(reference), to_unit(images)
    values = [structural_similarity(r, i, data_range=1.0, channel_axis=0) for r, i in zip(reference, images)]
    return float(np.mean(values))


def accuracy(predicted: Sequence[int], labels: Sequence[int]) -> float:
    """The share of ``predicted`` equal to ``labels``."""
    predicted, labels = np.asarray(predicted), np.asarray(labels)
    return float((predicted == labels).mean())
