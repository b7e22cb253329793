"""The public entry points: ``extend`` (a context manager) and ``grad`` (functional)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import Tensor, nn

from .extensions import FUNCTION_EXTENSIONS, eager_attention_routed, installed
from .semirings.base import Semiring
from .transport import backward as _bw
from .transport.interception import BackwardInterceptor
from .transport.provenance import ModuleTracker


@contextmanager
def extend(
    model: nn.Module | None,
    semiring: Semiring,
    *,
    regular_grads: bool = True,
    extensions: bool = True,
) -> Iterator[nn.Module | None]:
    """Run every ``backward()`` inside the block as a semiring backward.

    Each leaf tensor reached from the root (parameters and inputs with ``requires_grad``) gets
    ``.semiring_grad``: the semiring's readout of the message that arrived there, same shape as
    the leaf. ``.grad`` is filled exactly as by a plain backward unless ``regular_grads=False``,
    in which case ``.grad`` is left untouched and the regular gradient is not computed.

    The forward may run inside the block or before it; running it inside lets error messages
    name the module an unsupported op came from, and lets the module extensions (fused kernels,
    named sites) take over supported layers. ``extensions=False`` keeps every op on the generic
    per-op rules: same values, slower. On exit (normal or by an exception) the model
    has no hooks or attributes of semipack's left, only the ``semiring_grad`` results.
    """
    if not isinstance(semiring, Semiring):
        raise TypeError(f"expected a semipack semiring, got {semiring!r}")
    watched = [p for p in model.parameters() if p.requires_grad] if model is not None else []
    with ExitStack() as stack:
        stack.enter_context(ModuleTracker(model).active())
        reroute = {}
        if extensions:
            stack.enter_context(installed(model))
            stack.enter_context(eager_attention_routed())
            reroute = FUNCTION_EXTENSIONS
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        stack.enter_context(BackwardInterceptor(semiring, regular_grads, watched, reroute, names))
        yield model


def grad(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    semiring: Semiring,
    grad_outputs: Tensor | Sequence[Tensor | None] | None = None,
    *,
    retain_graph: bool | None = None,
    allow_unused: bool = False,
) -> tuple[Any, ...]:
    """Semiring values of ``inputs`` with respect to ``outputs``, like ``torch.autograd.grad``.

    Works on any differentiable function of tensors, no module needed. ``grad_outputs`` (default:
    1 for scalar outputs) are lifted into the semiring as the weights of edges from a virtual
    root. Returns one readout per input (``None`` for unused inputs with ``allow_unused=True``).
    """
    return _bw.grad(
        outputs,
        inputs,
        semiring,
        grad_outputs,
        retain_graph=retain_graph,
        allow_unused=allow_unused,
    )
