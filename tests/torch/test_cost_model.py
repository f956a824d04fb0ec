"""The default runs a level unmerged where merging would not pay (tome_core.models.cost), says so in summary() and once
at info level in diffusers' logger, and merges there with ``min_tokens=0`` or an arrangement chosen by hand. Oracle:
the unpatched model, and the keys each SDPA call really sees."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from diffusers.utils import logging as diffusers_logging

import tome_core.torch as tome
from tome_tools.diffusers_models import build_unet
from tome_tools.diffusers_bench import SdpaCalls

pytestmark = pytest.mark.cost_model


@pytest.fixture(scope="module")
def unet():
    return build_unet("tiny")


def _run(unet, side):
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 4, side, side, generator=generator)
    context = torch.randn(2, 7, 32, generator=generator)
    with torch.no_grad(), SdpaCalls() as counts:
        out = unet(sample, torch.tensor([500, 500]), context).sample
    return out, sorted({keys for queries, keys in counts.lengths if queries == keys or queries == side * side})


def _patched_run(unet, side, **options):
    """``(output, keys seen, summary)`` of one call of ``unet`` patched with ``options``, which is then removed."""
    tome.patch(unet, **options)
    try:
        out, seen = _run(unet, side)
        return out, seen, tome.patched_models(unet)[0].state.summary()
    finally:
        tome.remove(unet)


def test_default_leaves_a_small_level_unmerged_and_says_why(unet):
    unpatched, keys = _run(unet, 16)
    out, seen, summary = _patched_run(unet, 16)
    assert torch.equal(out, unpatched)
    assert seen == keys
    assert "blocks unmerged: 256 tokens, fewer than the 4096 from which merging pays on a cpu (eager, cells" in summary
    assert "min_tokens=0 merges anyway" in summary


@pytest.mark.parametrize("options", [dict(min_tokens=0), dict(ratio=0.5), dict(prefer="speed", min_tokens=200)])
def test_min_tokens_or_a_chosen_arrangement_merges_anyway(unet, options):
    unpatched, keys = _run(unet, 16)
    out, seen, summary = _patched_run(unet, 16, **options)
    assert not torch.equal(out, unpatched)
    assert min(seen) < 256 and 256 not in seen, seen
    assert "unmerged" not in summary


def test_default_merges_from_the_measured_size(unet):
    """At 64x64 latents the finest level has 4,096 tokens: the CPU bound, so the default merges there."""
    unpatched, keys = _run(unet, 64)
    out, seen, summary = _patched_run(unet, 64)
    assert 4096 in keys and 4096 not in seen
    assert "4096 -> 1024 keys/values" in summary, summary


@contextlib.contextmanager
def _told():
    """The records logged at info level or above by ToMe while the block runs, under diffusers' logger
    ("diffusers.tome_core", where the torch framework informs: the driver hands it to each patch's state)."""
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    loggers = [diffusers_logging.get_logger("diffusers.tome_core")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)


def test_default_says_once_at_info_level_that_a_level_runs_unmerged_and_how_to_merge(unet):
    """Edges round three, also seen: an eager call whose default merges nothing said nothing unless the user called
    summary(). Now the first such call says it once per patch, at info level: the level, its tokens, why (the cost
    model's measured bound) and how to merge anyway."""
    tome.patch(unet)
    try:
        with _told() as records:
            _run(unet, 16)
            _run(unet, 16)
    finally:
        tome.remove(unet)
    assert len(records) == 1 and records[0].levelno == logging.INFO, [r.getMessage() for r in records]
    message = records[0].getMessage()
    for words in ("ToMe on UNet2DConditionModel: its blocks at 1/1 scale run unmerged: 256 tokens, fewer than the 4096",
                  "To merge at every size, pass min_tokens=0 or choose the arrangement", "mode='tokens'", "summary()"):
        assert words in message, message


@pytest.mark.parametrize("options", [dict(min_tokens=0), dict(ratio=0.5)])
def test_nothing_is_said_where_the_patch_merges(unet, options):
    tome.patch(unet, **options)
    try:
        with _told() as records:
            _run(unet, 16)
    finally:
        tome.remove(unet)
    assert records == []


def test_min_tokens_given_names_itself_in_the_word(unet):
    tome.patch(unet, min_tokens=300)
    try:
        with _told() as records:
            _run(unet, 16)
    finally:
        tome.remove(unet)
    [record] = records
    assert "256 tokens, fewer than min_tokens=300. To merge there, lower min_tokens" in record.getMessage()


def test_the_torch_framework_informs_where_diffusers_users_look():
    """``diffusers.utils.logging.set_verbosity_info()`` shows what the torch framework says (its logger is under
    diffusers'); at diffusers' default verbosity (warnings) it stays quiet."""
    from tome_core.adapters.diffusers import FRAMEWORK

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    before = diffusers_logging.get_verbosity()
    diffusers_logging.add_handler(handler)
    try:
        diffusers_logging.set_verbosity_warning()
        FRAMEWORK.inform("quiet")
        diffusers_logging.set_verbosity_info()
        FRAMEWORK.inform("shown")
    finally:
        diffusers_logging.remove_handler(handler)
        diffusers_logging.set_verbosity(before)
    assert [(r.name, r.levelno, r.getMessage()) for r in records] == [("diffusers.tome_core", logging.INFO, "shown")]
