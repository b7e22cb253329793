"""Inputs of output-saving functions, recorded during the forward for exact log-derivatives.

tanh, sigmoid, softmax and exp save only their *output* for backward, and their derivatives are
functions of the output that round to 0 in float32 (1 - tanh(x)^2 for |x| > 9, p (1 - p) for a
probability that rounds to 1, e^x below -103) long before the true derivative stops being
representable in log space. The backward cannot recover the input from the output (1.0 is
tanh of every x above 9.01), so while ``semipack.extend`` is active its torch-function mode runs
these functions through ``run_recording_inputs``, which keeps a reference to the input in the
produced autograd node's ``metadata``; the backward rules read it back with ``recorded_input``
and compute the exact log-derivative. Without a recorded input (the forward ran outside
``extend``, or the input was modified in place after the call) the rules keep the output-based
derivative.

Memory: the recorded input lives as long as the node (a plain backward would have freed it after
the forward); an in-place call (``tanh_``, ``exp_``, ...) overwrites its input, so only those copy
it, before running.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

#: Key of the recorded input in an autograd node's ``metadata``.
SAVED_INPUT_KEY = "semipack.saved_input"


@dataclass(frozen=True)
class FunctionSpec:
    """How to find the input of one recorded function, and which node it must produce."""

    node_name: str
    in_place: bool = False
    dtype_position: int | None = None  # where a positional ``dtype`` argument sits, if any


@dataclass(frozen=True)
class SavedInput:
    """A recorded input: detached (a private copy for in-place calls), with the version it had
    when the node was created and the dtype the function cast it to first (softmax's dtype=)."""

    tensor: Tensor
    version: int
    dtype: torch.dtype | None


_TANH = FunctionSpec("TanhBackward0")
_SIGMOID = FunctionSpec("SigmoidBackward0")
_EXP = FunctionSpec("ExpBackward0")
_EXPM1 = FunctionSpec("Expm1Backward0")

#: The functions whose input is recorded, as the torch-function mode sees them.
RECORDED_FUNCTIONS: dict[Callable[..., Any], FunctionSpec] = {
    torch.tanh: _TANH,
    torch.Tensor.tanh: _TANH,
    torch.tanh_: FunctionSpec("TanhBackward0", in_place=True),
    torch.Tensor.tanh_: FunctionSpec("TanhBackward0", in_place=True),
    torch.sigmoid: _SIGMOID,
    torch.Tensor.sigmoid: _SIGMOID,
    torch.special.expit: _SIGMOID,
    torch.sigmoid_: FunctionSpec("SigmoidBackward0", in_place=True),
    torch.Tensor.sigmoid_: FunctionSpec("SigmoidBackward0", in_place=True),
    torch.exp: _EXP,
    torch.Tensor.exp: _EXP,
    torch.exp_: FunctionSpec("ExpBackward0", in_place=True),
    torch.Tensor.exp_: FunctionSpec("ExpBackward0", in_place=True),
    torch.expm1: _EXPM1,
    torch.Tensor.expm1: _EXPM1,
    torch.special.expm1: _EXPM1,
    torch.expm1_: FunctionSpec("Expm1Backward0", in_place=True),
    torch.Tensor.expm1_: FunctionSpec("Expm1Backward0", in_place=True),
    torch.softmax: FunctionSpec("SoftmaxBackward0", dtype_position=2),
    torch.Tensor.softmax: FunctionSpec("SoftmaxBackward0", dtype_position=2),
    torch.special.softmax: FunctionSpec("SoftmaxBackward0", dtype_position=2),
    F.softmax: FunctionSpec("SoftmaxBackward0", dtype_position=3),
}


def run_recording_inputs(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)``; for a function in ``RECORDED_FUNCTIONS`` that creates its
    autograd node, the input is recorded on the node (see the module docstring)."""
    spec = RECORDED_FUNCTIONS.get(func)
    if spec is None or not torch.is_grad_enabled() or kwargs.get("out") is not None:
        return func(*args, **kwargs)
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    if not isinstance(x, Tensor) or not x.requires_grad:
        return func(*args, **kwargs)
    saved = x.detach().clone() if spec.in_place else x.detach()
    version = saved._version
    result = func(*args, **kwargs)
    node = result.grad_fn if isinstance(result, Tensor) else None
    if node is not None and node.name() == spec.node_name:
        dtype = _dtype_argument(spec, args, kwargs)
        node.metadata[SAVED_INPUT_KEY] = SavedInput(saved, version, dtype)
    return result


def recorded_input(node_name: str, like: Tensor) -> Tensor | None:
    """The input recorded for the backward node running now, cast as its function cast it, if
    that node is a ``node_name``, the input is unchanged since the forward and has ``like``'s
    shape; else None (the caller then uses the output-based derivative)."""
    node = torch._C._current_autograd_node()
    if node is None or node.name() != node_name:
        return None
    saved = node.metadata.get(SAVED_INPUT_KEY)
    if not isinstance(saved, SavedInput) or saved.tensor._version != saved.version:
        return None
    x = saved.tensor if saved.dtype is None else saved.tensor.to(saved.dtype)
    return x if x.shape == like.shape else None


def _dtype_argument(spec: FunctionSpec, args: tuple, kwargs: dict) -> torch.dtype | None:
    if "dtype" in kwargs:
        return kwargs["dtype"]
    if spec.dtype_position is not None and len(args) > spec.dtype_position:
        return args[spec.dtype_position]
    return None
