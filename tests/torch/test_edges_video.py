"""Edges of issue 59 on video transformers whose frames share one sequence: MiniMax-H3, whose video a per-token
tag places among text, condition frames and audio (``RolesGrid``), gets the frame window as Wan does.

Oracles: the unpatched block's inputs, merged by a numpy brute force of the bipartite match in which each source
may meet only the destinations of the frames the window allows (the full similarity, the rest masked).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, Optional, Tuple

import numpy as np
import pytest
import torch

import tome_core.torch as tome
from tome_tools.diffusers_models import random_transformer

FRAMES, ROWS, COLS = 3, 4, 6  # the video's tokens after the (1, 2, 2) patch
VIDEO = FRAMES * ROWS * COLS
HEAD = 4 + ROWS * COLS + 6  # text, the keyframe's condition frame (tagged video too), audio


@pytest.fixture(scope="module")
def minimax() -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """A tiny MiniMax-H3 on its pipeline's packed layout (its own ``build_packed_sequence``), shared by a batch of
    two: [text (4); a condition frame (4x6); audio (2 channels x 3); video (3 frames of 4x6)]."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    config = dict(
        num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2, num_refiner_layers=1, ffn_dim=32,
        in_channels=4, audio_in_channels=6, patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=24,
        time_embed_dim=16, rope_freq_dim=2,
    )
    ids, tags, video, audio, text, conditions, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(4, dtype=torch.long), FRAMES, 2 * ROWS, 2 * COLS, 3, (1, 2, 2), 2, audio_tag=2, video_tag=0,
        keyframe_anchors=("first",),
    )
    steps = torch.zeros(ids.shape[0], dtype=torch.long)
    steps[video[:conditions]] = 1
    generator = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(2, video.numel(), 16, generator=generator),
        audio_hidden_states=torch.randn(2, 6, 6, generator=generator),
        encoder_hidden_states=torch.randn(2, 4, 8, generator=generator), timestep=torch.tensor([0.5, 1.0]),
        timestep_indices=steps, token_tags=tags, position_ids=ids, video_indices=video, audio_indices=audio,
        text_indices=text,
    )
    return random_transformer("MiniMaxH3Transformer3DModel", config, 0), inputs


def _run(model: torch.nn.Module, inputs: Dict[str, Any]) -> Tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """The model's video output, and block 0's input and what its attention gets (hooks after ToMe's), as numpy."""
    block, seen = model.transformer_blocks[0], {}

    def keep(name):
        def hook(module, args):
            seen[name] = args[0].numpy()
        return hook

    handles = [block.register_forward_pre_hook(keep("block")), block.attn.register_forward_pre_hook(keep("attn"))]
    with torch.no_grad():
        output = model(**inputs, return_dict=False)[0]
    for handle in handles:
        handle.remove()
    return output, seen["block"], seen["attn"]


def _brute_force(metric: np.ndarray, window: Optional[int]) -> np.ndarray:
    """The destination token of each video token (itself for destinations and kept sources) under ``ratio=0.5``
    and ``use_rand=False`` (each 2x2 cell's first token the destination), one match for the batch (the items'
    cosine similarities averaged), each source meeting the destinations within ``window`` frames of its own."""
    unit = metric / np.linalg.norm(metric, axis=-1, keepdims=True)
    scores = np.einsum("bnc,bmc->nm", unit, unit) / len(metric)
    row, col = np.divmod(np.arange(VIDEO), COLS)
    is_dst = (row % 2 == 0) & (col % 2 == 0)
    dst, src = np.flatnonzero(is_dst), np.flatnonzero(~is_dst)
    frame = row // ROWS
    scores = scores[src][:, dst]
    if window is not None:
        scores[np.abs(frame[src][:, None] - frame[dst][None, :]) > window] = -np.inf
    best = scores.max(-1)
    merged = np.argsort(-best, kind="stable")[: VIDEO // 2]
    target = np.arange(VIDEO)
    target[src[merged]] = dst[scores.argmax(-1)[merged]]
    return target


def _merged_rows(x: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``[B, VIDEO // 2, C]``: the means of ``x``'s tokens over each group of ``target``, in token order."""
    kept = np.unique(target)
    return np.stack([x[:, target == token].mean(axis=1) for token in kept], axis=1)


def _same_rows(merged: np.ndarray, expected: np.ndarray) -> bool:
    """Whether every batch item's rows are the expected ones, in whatever order (each nearest within 1e-5)."""
    distance = np.linalg.norm(merged[:, :, None] - expected[:, None], axis=-1).min(axis=-1)
    return bool(distance.max() < 1e-5)


def test_minimax_h3_video_gets_the_frame_window(minimax):
    """Edges round three, 8: MiniMax-H3's RolesGrid gave no frame count, so ``frame_window`` did nothing there
    (``0`` gave ``None``'s output) and a one-frame warning was said. Now its video's frames come from its
    position ids: under ``frame_window=0`` its attention gets the video's tokens merged as the brute force within
    each frame merges them (each merged source's destination in its own frame), which differs from the search
    over the whole clip (``None``, also matched by brute force), and nothing is said."""
    model, inputs = minimax
    plain, block, attention = _run(model, inputs)
    video = slice(HEAD, HEAD + VIDEO)
    outputs = {}
    for window in (0, None):
        patched = tome.patch(copy.deepcopy(model), ratio=0.5, use_rand=False, frame_window=window)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            outputs[window], _, merged = _run(patched, inputs)
        target = _brute_force(block[:, video], window)
        assert np.array_equal(merged[:, :HEAD], attention[:, :HEAD])
        assert _same_rows(merged[:, HEAD:], _merged_rows(attention[:, video], target)), window
        if window == 0:
            row = np.arange(VIDEO) // COLS
            assert (row // ROWS == row[target] // ROWS).all()
            in_frames = target
    assert not np.array_equal(in_frames, target)  # the whole clip's search merges across frames
    assert not torch.allclose(outputs[0], outputs[None], atol=1e-6)
    assert not torch.allclose(outputs[0], plain, atol=1e-6)
