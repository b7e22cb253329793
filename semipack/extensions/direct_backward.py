"""The regular gradient of an extension's inner graph by calling its nodes, without the engine.

An extension records its call's ops on detached aliases of the inputs (``InnerGraph``) and
takes the regular gradient from that graph. ``torch.autograd.grad`` starts a whole engine run
for it, a fixed cost paid once per extension node and backward (a squeeze-excite 1 x 1
convolution's regular gradient: 136-144 us through the engine, 112-118 us calling its nodes,
``benchmarks/bench_kernel_costs.py --only regular_grads``): on a small model (an image of
MobileNetV3-small, a sentence of MiniLM) such fixed costs are most of the semiring backward's
own. For the inner graphs of single torch ops (``F.linear``, ``F.conv2d``,
``F.layer_norm``, ``F.embedding``, ``matmul``) the graph is a small tree of PyTorch's own
nodes, each reached by one edge, ending in the aliases' ``AccumulateGrad`` nodes; calling those
nodes in turn does what the engine does with them (the same ``apply``, the same tensors),
so the gradients are the same bits.

Where anything would differ this returns None and the caller takes the engine:
- a node that is not one of PyTorch's builtin nodes (a custom Function, a module hook's node),
  one with more than one input, or one reached twice (the engine would add before calling);
- anomaly mode (the engine checks each node's outputs), a non-CPU gradient (the engine
  picks streams), more than one output gradient;
- a gradient whose dtype, device or layout differs from what the next node expects (the engine
  would cast it): found after the calls, so the engine run repeats them. A broadcast
  gradient is reduced as the engine reduces it (``sum_to_size``).

- a backward that computes gradients for some tensors only (``backward(inputs=...)``,
  ``torch.autograd.grad``): a node asks the running graph task which outputs it must compute,
  and that task's list does not hold the inner graph's nodes, so it would compute none. A
  probe node answers which kind of task is running (``_filtered``, once per graph task).

Tensor hooks inside the call would not run here (a node's hooks are the engine's to run), so
only extensions whose call is one torch op, with no user code in it, opt in
(``ExtensionFunction.direct_regular_grads``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction


def _is_builtin(node: object) -> bool:
    """Whether ``node`` is one of PyTorch's C++ nodes (``MmBackward0``: its class lives in
    ``builtins``), not a Python Function's ``BackwardCFunction``."""
    return type(node).__module__ == "builtins" and not isinstance(node, BackwardCFunction)


_PROBE: list = []
#: (graph task id, its answer) of the last ``_filtered`` call: one probe per backward, not one
#: per extension node (a graph task keeps its list of nodes to run for its whole life).
_LAST_ANSWER: list[tuple[int, bool]] = [(-1, False)]


def _filtered() -> bool:
    """Whether the running backward computes only some gradients (its graph task lists the
    nodes to run): then PyTorch's nodes skip every output whose next node is not listed, and a
    node of ours, called directly, returns None for its leaf. Answered by calling a one-node
    probe graph of our own (a few microseconds), once per graph task."""
    task = torch._C._current_graph_task_id()
    last_task, answer = _LAST_ANSWER[0]
    if task != -1 and task == last_task:
        return answer
    if not _PROBE:
        with torch.enable_grad():
            leaf = torch.zeros((), requires_grad=True)
            _PROBE.append((leaf, (leaf * 1.0).grad_fn))
    answer = _PROBE[0][1](torch.ones(()))[0] is None
    _LAST_ANSWER[0] = (task, answer)
    return answer


def direct_grads(
    edge: torch.autograd.graph.GradientEdge, grad: Tensor, inputs: Sequence[Tensor]
) -> list[Tensor | None] | None:
    """The gradients reaching ``inputs`` (leaves: the aliases) from ``grad`` at ``edge``, one
    per input (None where none reaches it), or None where the engine must run instead."""
    if (
        edge.output_nr != 0
        or grad.device.type != "cpu"
        or torch.is_anomaly_enabled()
        or type(grad) is not Tensor
        or _filtered()
    ):
        return None
    wanted = {id(t): i for i, t in enumerate(inputs)}
    found: list[Tensor | None] = [None] * len(inputs)
    reached = [False] * len(inputs)
    pending = [(edge.node, grad)]
    called: set[int] = set()
    while pending:
        node, incoming = pending.pop()
        if id(node) in called or not _is_builtin(node) or len(node._input_metadata) != 1:
            return None  # reached twice: the engine adds the gradients before the call
        called.add(id(node))
        with torch.no_grad():  # as the engine runs a node without create_graph
            outputs = node(incoming)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        for (next_node, nr), out in zip(node.next_functions, outputs, strict=True):
            if next_node is None:
                continue
            variable = getattr(next_node, "variable", None)
            if variable is not None:  # an AccumulateGrad: a leaf
                position = wanted.get(id(variable))
                if position is None or reached[position]:
                    return None  # a leaf that is no input, or one reached twice
                reached[position] = True
                if out is not None:
                    out = _passed_on(out, variable.shape, variable.dtype, variable.device)
                    if out is None:
                        return None
                found[position] = out
                continue
            if out is None:  # no gradient along this edge: nothing below it gets one
                continue
            if nr != 0:
                return None
            meta = next_node._input_metadata
            if len(meta) != 1:
                return None
            out = _passed_on(out, meta[0].shape, meta[0].dtype, meta[0].device)
            if out is None:
                return None
            pending.append((next_node, out))
    return found


def _passed_on(
    t: Tensor, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> Tensor | None:
    """``t`` as the engine passes it on to an input of this metadata, or None where the engine
    would do more than PyTorch's reduction of a broadcast gradient (``addmm``'s bias gets
    the whole [rows, n] gradient and the engine sums it to [n], with ``at::sum_to``, which
    ``sum_to_size`` calls): a cast, a layout or a subclass."""
    if type(t) is not Tensor or t.layout != torch.strided or t.dtype != dtype or t.device != device:
        return None
    if tuple(t.shape) == tuple(shape):
        return t
    try:
        return t.sum_to_size(tuple(shape))
    except RuntimeError:  # not expandable: the engine raises its own error
        return None
