"""Module extensions: a speed and naming layer over the generic per-op rules.

An extension replaces a module's ``forward`` (for the duration of ``semipack.extend``) by one that
routes the computation through a ``torch.autograd.Function``. The Function's forward runs the
module's own ops under autograd on detached aliases of its inputs (the *inner graph*: no copies,
the same saved tensors a plain forward keeps), so the regular gradient is later taken from
exactly the ops a plain backward would run. Its backward computes the semiring messages for the
whole module at once with fused kernels, and tags the result with the module's site names.

Extensions must give the same semiring values as the generic per-op path; tests prove it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..semirings.base import Semiring, State
from ..transport.message import Message
from ..transport.passes import graph_retained


class ModuleExtension:
    """Base class: one subclass per supported module type (see ``register_extension``)."""

    module_class: ClassVar[type[nn.Module]]

    def applies_to(self, module: nn.Module) -> bool:
        """Subclasses of the supported class qualify only if they keep its forward unchanged."""
        return type(module).forward is self.module_class.forward

    def forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


_EXTENSIONS: dict[type[nn.Module], ModuleExtension] = {}


def register_extension(extension: ModuleExtension) -> ModuleExtension:
    """Add an extension to the lookup table (keyed by the exact module class it supports)."""
    _EXTENSIONS[extension.module_class] = extension
    return extension


def extension_for(module: nn.Module) -> ModuleExtension | None:
    """The extension of the nearest registered class in the module's MRO, if it applies."""
    for cls in type(module).__mro__:
        ext = _EXTENSIONS.get(cls)
        if ext is not None:
            return ext if ext.applies_to(module) else None
    return None


def supported_modules() -> list[str]:
    return sorted(cls.__qualname__ for cls in _EXTENSIONS)


@contextmanager
def installed(model: nn.Module | None) -> Iterator[list[str]]:
    """Swap the forward of every supported submodule for its extension; restore on exit.

    Yields the names of the extended modules. The swap is an instance attribute shadowing the
    class's forward; on exit it is deleted (or the user's own instance attribute put back).
    """
    extended: list[str] = []
    with ExitStack() as stack:
        if model is not None:
            for name, module in model.named_modules():
                ext = extension_for(module)
                if ext is None:
                    continue
                stack.enter_context(_swapped_forward(module, ext))
                extended.append(name)
        yield extended


@contextmanager
def _swapped_forward(module: nn.Module, ext: ModuleExtension):
    sentinel = object()
    previous = module.__dict__.get("forward", sentinel)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return ext.forward(module, *args, **kwargs)

    module.forward = forward
    try:
        yield
    finally:
        if previous is sentinel:
            del module.forward
        else:
            module.forward = previous


# --- the inner graph ---------------------------------------------------------------------------


class InnerGraph:
    """The module's own ops, recorded under autograd on detached aliases of its inputs.

    An input passed several times (self-attention's query, key and value) gets one alias, so
    the inner ops see the same identities as a plain forward does.
    """

    #: Keep the inner graph's saved tensors after ``regular_grads`` (set per pass by
    #: ``frees_context``; kept unless the running semiring passes free the graph).
    retain: bool = True

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[Tensor | None]) -> None:
        aliases: dict[int, Tensor] = {}
        self.first_use: list[bool] = []
        self.leaves: list[Tensor | None] = []
        for t in inputs:
            if t is None:
                self.leaves.append(None)
                self.first_use.append(False)
                continue
            alias = aliases.get(id(t))
            self.first_use.append(alias is None)
            if alias is None:
                alias = aliases[id(t)] = t.detach().requires_grad_(t.requires_grad)
            self.leaves.append(alias)
        with torch.enable_grad():
            self.outputs = fn(*self.leaves)

    def release_outputs(self) -> None:
        """Keep only the autograd edges of the outputs, not their data: a plain backward does
        not keep a module's outputs alive, so neither should the inner graph."""
        outputs = self.outputs if isinstance(self.outputs, tuple) else (self.outputs,)
        self.edges = [
            None if o is None or o.grad_fn is None else torch.autograd.graph.get_gradient_edge(o)
            for o in outputs
        ]
        self.outputs = None

    def regular_grads(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        """Gradients for the inner inputs from exactly the ops of a plain backward, given the
        gradients of the outputs (in order; None for an output without one).

        A repeated input receives its whole gradient at its first position and zeros at the
        others (autograd adds them up again).
        """
        pairs = [
            (e, g)
            for e, g in zip(self.edges, grads, strict=False)
            if g is not None and e is not None
        ]
        unique = [
            t
            for t, first in zip(self.leaves, self.first_use, strict=True)
            if first and t.requires_grad
        ]
        if not unique or not pairs:
            return [None] * len(self.leaves)
        got = torch.autograd.grad(
            [e for e, _ in pairs],
            unique,
            [g for _, g in pairs],
            retain_graph=self.retain,
            allow_unused=True,
        )
        found = dict(zip((id(t) for t in unique), got, strict=True))
        out: list[Tensor | None] = []
        for t, first in zip(self.leaves, self.first_use, strict=True):
            g = None if t is None else found.get(id(t))
            if g is not None and not first:
                g = torch.zeros_like(g)
            out.append(g)
        return out


def frees_context(backward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an extension Function's backward so that it frees what its forward kept on ``ctx``.

    The engine frees a plain node's saved tensors right after the node runs, but a custom
    Function's context (here the inner graph with the module's activations) lives until the whole
    graph is gone: without this, a semiring backward would hold every extended module's
    activations to its end. After a semiring pass that does not retain the graph, the context is
    emptied; a second pass through it then fails with the error a plain backward gives.
    """

    @functools.wraps(backward)
    def run(ctx, *grads: Any) -> Any:
        if getattr(ctx, "inner", None) is None:
            raise RuntimeError(
                "Trying to backward through the graph a second time: a semipack module "
                "extension freed its saved state after the first semiring backward. Pass "
                "retain_graph=True to the first backward to keep it."
            )
        release = not graph_retained() and any(isinstance(g, Message) for g in grads)
        ctx.inner.retain = not release
        result = backward(ctx, *grads)
        if release:
            ctx.__dict__.clear()
        return result

    return run


def record_inner(ctx, fn: Callable[..., Any], inputs: Sequence[Tensor | None]) -> Any:
    """Run ``fn`` as the Function's inner graph (kept on ``ctx``) and return its outputs,
    detached, for the Function to return; the inner graph keeps only their autograd edges."""
    ctx.inner = InnerGraph(fn, inputs)
    outputs = ctx.inner.outputs
    if isinstance(outputs, tuple):
        detached = tuple(None if o is None else o.detach() for o in outputs)
    else:
        detached = outputs.detach()
    ctx.inner.release_outputs()
    return detached


def inner_inputs(ctx) -> list[Tensor | None]:
    """The inner graph's inputs, detached, for the semiring computation."""
    return [None if t is None else t.detach() for t in ctx.inner.leaves]


def wanted_inputs(ctx) -> list[Tensor | None]:
    """``inner_inputs``, with None for the inputs autograd wants no gradient for
    (``needs_input_grad`` also covers the Function's trailing non-tensor arguments)."""
    needs = ctx.needs_input_grad
    return [t if needs[i] else None for i, t in enumerate(inner_inputs(ctx))]


def messages(
    regular: Sequence[Tensor | None],
    states: Sequence[State | None],
    sr: Semiring,
    likes: Sequence[Tensor | None],
) -> tuple[Message | None, ...]:
    """One backward output per input: a message where a state was computed, else None."""
    return tuple(
        as_message(r, s, sr, like) if s is not None and like is not None else None
        for r, s, like in zip(regular, states, likes, strict=True)
    )


def split_message(grad: Tensor | None) -> tuple[Tensor | None, State | None, Semiring | None]:
    """(regular gradient, semiring state, semiring) of an incoming gradient or message."""
    if isinstance(grad, Message):
        return grad.gradient, grad.parts, grad.semiring
    return grad, None, None


def as_message(regular: Tensor | None, parts: State | None, sr: Semiring, like: Tensor) -> Message:
    """Wrap a computed state (and regular gradient) for the engine, shaped like ``like``."""
    return Message(regular, parts, sr, like.dtype)
