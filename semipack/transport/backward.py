"""Running a semiring backward pass through the autograd engine.

The root gets a seed message (the incoming gradient, lifted to the semiring); autograd then
drives the messages through every backward formula. Leaf messages are captured on the way into
the leaves: the regular gradient continues into ``.grad`` exactly as in a plain backward, the
semiring readout is stored as ``.semiring_grad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from ..errors import MessageLostError
from ..semirings.base import Semiring
from .message import Message
from .passes import semiring_pass

SEMIRING_GRAD = "semiring_grad"


def graph_leaves(roots: Sequence[Tensor]) -> list[Tensor]:
    """Every leaf tensor with requires_grad reachable from ``roots`` through autograd edges."""
    leaves: dict[int, Tensor] = {}
    seen: set[int] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    for t in roots:
        if t.grad_fn is None and t.requires_grad:
            leaves[id(t)] = t
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves[id(variable)] = variable
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return list(leaves.values())


def seeds(
    outputs: Sequence[Tensor], grad_outputs: Sequence[Tensor | None], sr: Semiring, regular: bool
) -> list[Message]:
    out = []
    for t, g in zip(outputs, grad_outputs, strict=True):
        if g is None:
            if t.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            g = torch.ones_like(t)
        out.append(Message.seed(g, sr, regular))
    return out


def _check(leaf_msg: Any, leaf: Tensor) -> Message:
    if not isinstance(leaf_msg, Message):
        raise MessageLostError(
            f"a plain gradient reached a leaf of shape {tuple(leaf.shape)}: some backward "
            "function (often a custom autograd.Function) returned a tensor it created instead "
            "of one computed from its incoming gradient"
        )
    return leaf_msg


@contextmanager
def path_recording(sr: Semiring, roots: Sequence[Tensor], leaf_names: dict[int, str] | None):
    """For path-recording semirings (TopPath): a fresh trace and pre-hooks for this pass."""
    if not getattr(sr, "records_paths", False):
        yield None
        return
    from ..readout.paths import PathTrace, attach

    trace = PathTrace(leaf_names)
    handles = attach(trace, roots)
    sr.trace = trace
    try:
        yield trace
    finally:
        for h in handles:
            h.remove()


def backward(
    tensors: Sequence[Tensor],
    grad_tensors: Sequence[Tensor | None],
    sr: Semiring,
    *,
    regular_grads: bool,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Sequence[Tensor] | None = None,
    leaf_names: dict[int, str] | None = None,
) -> list[Tensor]:
    """``torch.autograd.backward`` that also sets ``leaf.semiring_grad``; returns the leaves."""
    if create_graph:
        raise NotImplementedError("semipack does not support create_graph=True yet")
    leaves = list(inputs) if inputs is not None else graph_leaves(tensors)
    if not leaves:
        return []
    with path_recording(sr, tensors, leaf_names) as trace:
        captured = _run_backward(
            tensors, grad_tensors, sr, leaves, regular_grads, retain_graph, inputs
        )
        for i, leaf in enumerate(leaves):
            msg = captured.get(id(leaf))
            if msg is not None:
                setattr(leaf, SEMIRING_GRAD, sr.readout(msg.parts))
                if trace is not None:
                    trace.capture_leaf(leaf, msg, f"leaf {i}")
    return leaves


def _run_backward(tensors, grad_tensors, sr, leaves, regular_grads, retain_graph, inputs):
    seed = seeds(tensors, grad_tensors, sr, regular_grads)
    captured: dict[int, Message] = {}
    if regular_grads:
        handles = []

        def capture(leaf: Tensor):
            def hook(grad):
                msg = _check(grad, leaf)
                # Keep only the semiring state: the regular gradient goes to ``.grad`` (possibly
                # as a copy), and holding it here too would double the gradients' memory.
                captured[id(leaf)] = Message(None, msg.parts, msg.semiring, msg.dtype)
                return msg.gradient

            return hook

        try:
            for leaf in leaves:
                handles.append(leaf.register_hook(capture(leaf)))
            with semiring_pass(retain_graph):
                torch.autograd.backward(
                    list(tensors),
                    seed,
                    retain_graph=retain_graph,
                    inputs=list(inputs) if inputs is not None else None,
                )
        finally:
            for h in handles:
                h.remove()
    else:
        with semiring_pass(retain_graph):
            got = torch.autograd.grad(
                list(tensors), leaves, seed, retain_graph=retain_graph, allow_unused=True
            )
        for leaf, msg in zip(leaves, got, strict=True):
            if msg is not None:
                captured[id(leaf)] = _check(msg, leaf)
    return captured


def grad(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    sr: Semiring,
    grad_outputs: Tensor | Sequence[Tensor | None] | None = None,
    *,
    retain_graph: bool | None = None,
    allow_unused: bool = False,
    messages: bool = False,
) -> tuple[Any, ...]:
    """Semiring analogue of ``torch.autograd.grad``: readouts for ``inputs`` (see semipack.grad)."""
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if grad_outputs is None:
        grad_outputs = [None] * len(outputs)
    elif isinstance(grad_outputs, Tensor):
        grad_outputs = [grad_outputs]
    seed = seeds(outputs, list(grad_outputs), sr, regular=messages)
    with path_recording(sr, outputs, None) as trace, semiring_pass(retain_graph):
        got = torch.autograd.grad(
            outputs, inputs, seed, retain_graph=retain_graph, allow_unused=True
        )
        for i, (t, msg) in enumerate(zip(inputs, got, strict=True)):
            if trace is not None and isinstance(msg, Message):
                trace.capture_leaf(t, msg, f"input {i}")
    result = []
    for t, msg in zip(inputs, got, strict=True):
        if msg is None:
            if not allow_unused:
                raise RuntimeError(
                    "One of the differentiated Tensors appears to not have been used in the "
                    "graph. Set allow_unused=True if this is the desired behavior."
                )
            result.append(None)
            continue
        msg = _check(msg, t)
        result.append(msg if messages else sr.readout(msg.parts))
    return tuple(result)
