"""Which tensors of an incoming message nothing else holds, so that a rule may write its results
into their memory, as a plain backward's elementwise formulas leave the incoming gradient to be
freed the moment they return.

A semiring message carries more than a gradient (the regular gradient and one or more state
components), so an activation's node holds the incoming and the new message at once: on a BERT
layer's GELU that is four 12 MB tensors where a plain backward holds two, and it was the pass's
peak. Writing the new regular gradient into the incoming one's memory removes one of them; a
ReLU writes its cut state into the incoming state as well, and then allocates nothing.

The engine hands one gradient object to several consumers (an addition passes its gradient to
both summands unchanged), so writing into a message is allowed only when the engine holds it
for this call alone and nothing but the message holds the tensor written into:

- the message: its count of C++ owners (the engine's buffers) and of Python references equal
  those of a message held for this call alone. Those counts depend on PyTorch's engine, on the
  autograd node that calls the op and on the dispatcher, so they are measured at import, here,
  for each node of ``_NODES``, by running a probe gradient through the engine (``_calibrate``);
  where a probe held twice does not count higher than one held once, that node donates nothing,
  and so does every node not in ``_NODES``.
- each tensor: ``kernels.reuse`` rules out every other holder (Python references, other tensors
  on its memory, a graph that saved it, other processes).

``tests/test_donation.py`` holds a message or its tensors each way a user or the engine can and
checks the other holder's values survive.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_map

from ..kernels.reuse import alone_in_attribute, alone_in_items, calibrating

aten = torch.ops.aten

#: Nothing donated.
NONE: frozenset[int] = frozenset()


def _holders(message: Any) -> tuple[int, int]:
    """(C++ owners, Python references) of ``message`` as seen from here. Called with the
    dispatched call's ``args[0]`` directly, so the only Python references besides the caller's
    argument tuple are this frame's; the probe calls it the same way."""
    return message._use_count(), sys.getrefcount(message)


#: The autograd nodes whose incoming message an elementwise rule may write into, each with a
#: forward that records one. The C++ owners of the gradient a node hands to its op differ from
#: node to node (GELU's node holds one more than SiLU's), so each is calibrated on its own;
#: another node (an in-place activation's, a custom Function's) donates nothing.
_NODES: dict[str, tuple[Callable[[Tensor], Tensor], Any]] = {
    "GeluBackward0": (F.gelu, aten.gelu_backward.default),
    "SiluBackward0": (F.silu, aten.silu_backward.default),
    "MishBackward0": (F.mish, aten.mish_backward.default),
    "TanhBackward0": (torch.tanh, aten.tanh_backward.default),
    "SigmoidBackward0": (torch.sigmoid, aten.sigmoid_backward.default),
    "SoftplusBackward0": (F.softplus, aten.softplus_backward.default),
    "LeakyReluBackward0": (F.leaky_relu, aten.leaky_relu_backward.default),
    "EluBackward0": (F.elu, aten.elu_backward.default),
    "CeluBackward0": (F.celu, aten.elu_backward.default),
    "HardtanhBackward0": (F.hardtanh, aten.hardtanh_backward.default),
    "HardswishBackward0": (F.hardswish, aten.hardswish_backward.default),
    "HardsigmoidBackward0": (F.hardsigmoid, aten.hardsigmoid_backward.default),
    "LogSigmoidBackward0": (F.logsigmoid, aten.log_sigmoid_backward.default),
    "SoftshrinkBackward0": (F.softshrink, aten.softshrink_backward.default),
    "HardshrinkBackward0": (F.hardshrink, aten.hardshrink_backward.default),
    "ReluBackward0": (torch.relu, aten.threshold_backward.default),
    "ThresholdBackward0": (lambda x: F.threshold(x, 0.1, 0.0), aten.threshold_backward.default),
}

#: ``_holders`` of each probe gradient the node under calibration received, in order.
_SEEN: list[tuple[int, int]] = []


class _Probe(Tensor):
    """A gradient with no data that records ``_holders`` when the node under calibration
    hands it to an op."""

    node: str | None = None  # the node under calibration
    op: Any = None  # the op it hands its gradient to

    @staticmethod
    def __new__(cls, like: Tensor) -> _Probe:
        return Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device="cpu"
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _probe_dispatch(func, args, kwargs or {})


def _probe_dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    node = torch._C._current_autograd_node()
    if func is _Probe.op and node is not None and node.name() == _Probe.node:
        _SEEN.append(_holders(args[0]))

    def meta(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")

    out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
    return tree_map(lambda o: _Probe(o) if isinstance(o, Tensor) else o, out)


def _calibrate(node: str, forward: Callable[[Tensor], Tensor], op: Any) -> tuple[int, int] | None:
    """The ``_holders`` of a gradient the engine holds for ``node``'s call alone, or None where
    a gradient held for two calls does not count higher (then that node donates nothing).

    Two graphs: ``2 * forward(x)``, whose node receives a fresh gradient from the product's
    node, and ``forward(x) + forward(x / 2)``, whose addition hands one gradient to both nodes:
    the first to run sees it held twice, the second once (the first has let it go)."""
    x = torch.full((3,), 0.5, requires_grad=True)
    seed = _Probe(torch.empty(()))
    _Probe.node, _Probe.op = node, op
    try:
        _SEEN.clear()
        torch.autograd.grad(2 * forward(x).sum(), x, seed)
        alone = list(_SEEN)
        _SEEN.clear()
        torch.autograd.grad((forward(x) + forward(x / 2)).sum(), x, seed)
        shared = list(_SEEN)
    except Exception:  # an op the probe cannot run: that node donates nothing
        return None
    finally:
        _Probe.node = _Probe.op = None
        _SEEN.clear()
    if len(alone) != 1 or len(shared) != 2 or shared[1] != alone[0]:
        return None
    held_twice_counts_higher = shared[0][0] > alone[0][0] or shared[0][1] > alone[0][1]
    return alone[0] if held_twice_counts_higher else None


#: node name -> the ``_holders`` of a message its node holds for one call alone
with calibrating():
    _ALONE: dict[str, tuple[int, int]] = {
        name: counts
        for name, (forward, op) in _NODES.items()
        if (counts := _calibrate(name, forward, op)) is not None
    }


def donations(args: tuple) -> frozenset[int]:
    """The ids of the tensors of ``args[0]`` (a message) that a rule may write into: its regular
    gradient and state components that nothing holds but the message, where the engine holds
    the message for this call alone. Call it as ``donations(args)`` with the dispatched call's
    own argument tuple (the reference counts are calibrated for that)."""
    node = torch._C._current_autograd_node()
    alone = _ALONE.get(node.name()) if node is not None else None
    if alone is None or _holders(args[0]) != alone:
        return NONE
    message = args[0]
    if message.__dict__.get("sparse") is not None:
        return NONE
    ids = []
    if alone_in_attribute(message, "regular_grad") and _dense(message.regular_grad):
        ids.append(id(message.regular_grad))
    alone = alone_in_items(message, "_parts")  # before a name here refers to the tuple
    ids.extend(id(p) for p, free in zip(message.parts, alone, strict=False) if free and _dense(p))
    return frozenset(ids)


def _dense(t: Tensor) -> bool:
    """Whether every entry of ``t`` has memory of its own (no stride-0 broadcast, as a sum's
    gradient expands a scalar), laid out in one of the layouts ops write their results in."""
    return t.is_contiguous() or (
        t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
    )
