"""tomesd's function names and defaults on top of any framework's ``patch``/``remove`` (framework-free)."""

from __future__ import annotations

from typing import Any, Callable, Tuple


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


def apply_tome_function(patch: Callable[..., Any], module: str) -> Callable[..., Any]:
    """``apply_tome(model, ratio=None, **options)``: :func:`patch` that also takes the ratio positionally, as
    ppdiffusers' and tomesd's users write it (``pipe.apply_tome(0.5)``); every other option by keyword.
    ``module``: the entry point that defines it (shown by ``help``, and how tests tell it from ppdiffusers')."""

    def apply_tome(model: Any, *ratio: Any, **options: Any) -> Any:
        if len(ratio) > 1:
            raise TypeError(
                f"apply_tome takes the ratio as its only positional argument, got {len(ratio)} positional values "
                f"{ratio!r}; pass every other option by keyword, e.g. apply_tome(0.5, max_downsample=2)"
            )
        if ratio:
            if "ratio" in options:
                raise TypeError("apply_tome got the ratio twice: positionally and as ratio=")
            options["ratio"] = ratio[0]
        return patch(model, **options)

    apply_tome.__doc__ = (
        "apply_tome(model, ratio=None, **options): patch(model, ratio=ratio, **options), the ratio positional "
        "or by keyword.\n\n" + (patch.__doc__ or "")
    )
    apply_tome.__wrapped__ = patch
    apply_tome.__module__ = module
    return apply_tome
