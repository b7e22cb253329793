"""torch.compile with an eager fallback, shared by every fused kernel.

Kernels are compiled once per shape family (``dynamic=True``), lazily on first use. If
compilation fails (no C++ compiler, unsupported platform) the kernel falls back to its eager
implementation for the rest of the process, with one warning naming the kernel.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .switches import switched_on

#: Below this many entries an elementwise kernel runs eagerly: on one core the fused Entropy
#: readout of 7.7k entries took as long as its eager ops (the compiled call's guards), at 147k
#: 0.06 ms against 0.32 ms (``benchmarks/bench_kernel_costs.py``).
FUSED_MIN_ELEMENTS = 1 << 15

_state = {"enabled": switched_on("SEMIPACK_COMPILE")}


def set_compile(enabled: bool) -> None:
    """Switch compiled kernels on or off for the whole process (eager fallbacks otherwise)."""
    _state["enabled"] = bool(enabled)


def compile_enabled() -> bool:
    """Whether kernels run compiled (``set_compile``); eager fallbacks otherwise."""
    return _state["enabled"]


def _forced_eager() -> bool:
    """Whether torch.compile is told to run everything eagerly here (``semipack.extend`` does
    so for user code outside its passes): a compiled kernel would then run its fused source
    op by op, slower than the eager form written for that."""
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    return getattr(stance, "stance", "default") == "force_eager"


def compiled(
    eager: Callable[..., Any],
    fused: Callable[..., Any] | None = None,
    min_elements: int = 0,
    native: Callable[..., Any] | None = None,
):
    """Decorate-able: returns ``call(*args)`` running ``torch.compile(fused or eager)``.

    ``eager`` is the reference (a blocked implementation that never materialises large
    broadcasts); ``fused`` is the expression handed to inductor, which fuses the broadcast into
    its reduction loop. Both must compute the same values. Calls whose first argument has fewer
    than ``min_elements`` entries run eagerly (a compiled call's guards cost more than a few
    small eager ops).

    ``native``, where given, is a hand-written loop of the fused expression (the native
    library's), tried first wherever the compiled form would run; it returns ``NotImplemented``
    for arguments it does not take (another dtype or device, a layout that is not one dense
    block). Why: a process's first compiled call pays inductor's start-up, seconds on a CPU,
    which is most of a first backward for the semirings whose kernels all have native forms.
    It runs whether or not compiling is on (``set_compile``), as the native library's other
    loops do (``set_native`` turns them all off).
    """
    source = fused or eager
    holder: dict[str, Any] = {"fn": None, "broken": False}

    @functools.wraps(eager)
    def call(*args: Any) -> Any:
        if native is not None and args[0].numel() >= min_elements:
            out = native(*args)
            if out is not NotImplemented:
                return out
        if (
            not _state["enabled"]
            or holder["broken"]
            or args[0].numel() < min_elements
            or _forced_eager()
        ):
            return eager(*args)
        if holder["fn"] is None:
            holder["fn"] = torch.compile(source, dynamic=True)
        try:
            return holder["fn"](*args)
        except Exception as exc:  # compilation or codegen failure: keep working, eagerly
            holder["broken"] = True
            warnings.warn(
                f"semipack: compiling kernel {source.__qualname__} failed ({type(exc).__name__}: "
                f"{exc}); using the eager fallback from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            return eager(*args)

    call.eager = eager  # type: ignore[attr-defined]
    return call
