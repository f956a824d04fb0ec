"""Size-aware attention's bias: what an adapter adds to the logits of an attention over merged keys
(:class:`SizeBias`, built from a match's sizes by :func:`~tome_core.algorithm.merge.size_bias`), and whether an
attention processor can take it at all (:func:`unbiased_processor`, read from its code) or have its keys merged
inside its attention function (:func:`unreachable_kernel`). Framework-free."""

from __future__ import annotations

import inspect
from typing import Any, Collection, Optional, Sequence, Tuple

from ..algorithm.backend import get_ops
from ..algorithm.match import Match
from ..algorithm.merge import size_bias
from ..algorithm.partition import constant
from ..models.families import TEXT_NONE, text_follows


class SizeBias:
    """Log sizes of one sub-layer's keys: merged image keys get ``log(size)``, text keys (where ``text``, a
    ``TEXT_*``, says) 0."""

    def __init__(
        self, match: Match, text: str, like: Any, tail: int = 0, head: int = 0, whole_mask: bool = True,
        own: Tuple[int, int] = (0, 0),
    ):
        self.match = match
        self.own = own  # the fewest queries and keys of the attention's own call (:func:`own_call`)
        # whether an attention_mask over the merged tokens can carry it: not where the attention merges inside
        # itself (Sublayer.projections), since it sizes its masks from its unmerged input
        self.whole_mask = whole_mask
        self.text = text
        self.like = like  # the merged tokens: the dtype of the mask
        self.tail = tail  # unmerged tokens of other images right after the merged ones (size 1, bias 0)
        self.head = head  # and right before them (FramePack's history)

    def for_merged_tokens(self) -> Any:
        """The bias as a whole-batch additive ``attention_mask`` over the merged tokens (self-attention)."""
        return self.for_keys(self.head + self.match.kept + self.tail, self.like)

    def holds_image(self, keys: int) -> bool:
        """Whether an attention over ``keys`` keys can attend to the merged image tokens; one over fewer attends to
        other tokens of size 1 (the head tokens alone, an IP-Adapter's image prompt)."""
        return keys >= self.head + self.match.kept + self.tail

    def own_call(self, queries: int, keys: int) -> bool:
        """:func:`own_call` for this attention."""
        return own_call(self.own, self.holds_image(keys), queries, keys)

    def for_keys(self, keys: int, like: Any) -> Any:
        """``[B, 1, keys]``: the log sizes where the merged image keys sit, 0 for every other key (:meth:`holds_image`);
        raises where ``keys`` does not fit."""
        ops = get_ops(like)
        match = self.match
        if not self.holds_image(keys):
            return ops.zeros((match.batch, 1, keys), like)
        sizes = size_bias(match, like)
        text = keys - self.head - match.kept - self.tail
        if text and self.text == TEXT_NONE:
            raise RuntimeError(
                f"size-aware attention: the attention has {keys} keys but the merged sequence has "
                f"{self.head + match.kept + self.tail} tokens; pass proportional_attn=False"
            )
        zeros = lambda count: [constant(ops, like, 0, (match.batch, 1, count))] if count else []  # noqa: E731
        # [head; image; tail; text], else [text; head; image; tail]
        before, after = (self.head, self.tail + text) if text_follows(self.text) else (text + self.head, self.tail)
        parts = [*zeros(before), sizes, *zeros(after)]
        return parts[0] if len(parts) == 1 else ops.concat(parts, axis=2)


def own_call(own: Tuple[int, int], holds_image: bool, queries: int, keys: int) -> bool:
    """Whether an attention call of ``queries`` queries over ``keys`` keys, made while an attention whose own call has
    at least ``own`` ``(queries, keys)`` runs, is that call: one over fewer, or whose keys cannot hold the merged
    image, attends elsewhere (an IP-Adapter's image prompt, a reference image's tokens)."""
    return holds_image and queries >= own[0] and keys >= own[1]


def unbiased_processor(processor: Any, trusted: Sequence[str], library: str, functions: Sequence[str]) -> Optional[str]:
    """Why an attention ``processor`` cannot take a size bias, judged from its classes: none is ``trusted`` by name or
    from ``library``, and none of their code names one of the attention ``functions`` the adapter biases. None when
    it can, or its code cannot be read."""
    classes = [cls for cls in type(processor).__mro__ if cls is not object]
    if not classes or any(cls.__name__ in trusted or cls.__module__.split(".")[0] == library for cls in classes):
        return None
    try:
        sources = [inspect.getsource(cls) for cls in classes]
    except (OSError, TypeError):
        return None
    if any(name in source for source in sources for name in functions):
        return None
    return f"processor {type(processor).__name__} computes attention without {' or '.join(functions)} (read from its code)"


def unreachable_kernel(processor: Any, own_scores: Collection[str], library: str, functions: Sequence[str]) -> Optional[str]:
    """Why an adapter cannot merge the keys and values of ``processor``'s attention inside the attention
    ``functions`` it wraps, or None: ``own_scores`` processors and PAG processors cannot, others as
    :func:`unbiased_processor` judges."""
    name = type(processor).__name__
    if name in own_scores:
        return f"its processor {name} computes the attention scores itself, not through {' or '.join(functions)}"
    if name.startswith("PAG"):
        return f"its processor {name} (perturbed-attention guidance) attends over part of the batch"
    return unbiased_processor(processor, (), library, functions)
