"""tomesd's function names and defaults on top of any framework's ``patch``/``remove`` (framework-free)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Tuple

from .config import option_parameters


def tomesd_functions(patch: Callable[..., Any], remove: Callable[[Any], Any]) -> Tuple[Callable[..., Any], Callable[[Any], Any]]:
    """``(apply_patch, remove_patch)`` with ``tomesd``'s signature and defaults (``max_downsample=1``)."""

    def apply_patch(
        model: Any,
        ratio: float = 0.5,
        max_downsample: int = 1,
        sx: int = 2,
        sy: int = 2,
        use_rand: bool = True,
        merge_attn: bool = True,
        merge_crossattn: bool = False,
        merge_mlp: bool = False,
        **unknown: Any,
    ) -> Any:
        """Drop-in for ``tomesd.apply_patch``: the same signature, defaults and arithmetic (``max_downsample=1``,
        ``proportional_attn=False``)."""
        if unknown:
            raise TypeError(
                f"apply_patch got unknown option(s) {', '.join(sorted(unknown))}; tomesd's apply_patch takes ratio, "
                "max_downsample, sx, sy, use_rand, merge_attn, merge_crossattn, merge_mlp (patch() takes the "
                "options beyond tomesd's)"
            )
        return patch(
            model,
            ratio=ratio,
            max_downsample=max_downsample,
            sx=sx,
            sy=sy,
            use_rand=use_rand,
            merge_attn=merge_attn,
            merge_crossattn=merge_crossattn,
            merge_mlp=merge_mlp,
            proportional_attn=False,  # tomesd's arithmetic
        )

    def remove_patch(model: Any) -> Any:
        """Drop-in for ``tomesd.remove_patch``."""
        return remove(model)

    return apply_patch, remove_patch


def ratio_positional(patch: Callable[..., Any], name: str, module: str) -> Callable[..., Any]:
    """An entry point ``name(model, ratio=None, **options)``: :func:`patch` that also takes the ratio
    positionally, as ppdiffusers' and tomesd's users write it (``pipe.apply_tome(0.5)``, ``patch(pipe, 0.5)``);
    every other option by keyword. ``module``: the entry point's module (shown by ``help``, and how tests tell
    ``apply_tome`` from ppdiffusers')."""

    def entry(model: Any, *ratio: Any, **options: Any) -> Any:
        if len(ratio) > 1:
            raise TypeError(
                f"{name} takes the ratio as its only positional argument, got {len(ratio)} positional values "
                f"{ratio!r}; pass every other option by keyword, e.g. {name}(model, 0.5, max_downsample=2)"
            )
        if ratio:
            if "ratio" in options:
                raise TypeError(f"{name} got the ratio twice: positionally and as ratio=")
            options["ratio"] = ratio[0]
        return patch(model, **options)

    entry.__doc__ = (
        f"{name}(model, ratio=None, *, max_downsample=None, ...): the ratio positional or by keyword, every other "
        "option by keyword.\n\n" + (patch.__doc__ or "")
    )
    # what inspect.signature, help() and interactive completion show: every option with the default that acts
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    options = [p for p in option_parameters() if p.name != "ratio"]
    entry.__signature__ = inspect.Signature(
        [inspect.Parameter("model", positional), inspect.Parameter("ratio", positional, default=None, annotation=Optional[float]), *options],
        return_annotation=Any,
    )
    entry.__wrapped__ = patch
    entry.__name__ = entry.__qualname__ = name
    entry.__module__ = module
    return entry
