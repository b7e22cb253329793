"""Per-sample semiring values (``extend(..., per_sample=True)``): the graph check before the
pass, the rows the nodes report during it, and ``p.semiring_grad_batch`` after it.

Row ``n`` of a parameter is the semiring sum over the paths that pass through example ``n``'s
entries (the batch is dim 0 of the model input). Nodes registered in ``rules.per_sample`` (the
module extensions) compute their parameters' rows in their backward and ``add`` them here; the
semiring sum over the rows is the parameter's ``semiring_grad``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils.hooks
from torch import Tensor
from torch.utils._pytree import tree_leaves

from ..errors import PerSampleError
from ..graph.provenance import MODULE_KEY, OUTSIDE_MODEL
from ..messages.message import Message
from ..rules.per_sample import (
    BATCHED_KEY,
    has_per_sample_rule,
    mixing_reason,
    row_rule,
    unbatched_operand,
)
from ..semirings.base import Semiring, State
from ..semirings.k_best import KBest
from ..semirings.product import Product
from .passes import in_carry_pass

SEMIRING_GRAD_BATCH = "semiring_grad_batch"
#: With ``keep_state=True``: the rows' states themselves (``[N, *p.shape]`` per component).
SEMIRING_STATE_BATCH = "semiring_state_batch"


def check_semiring(sr: Semiring) -> None:
    """Refuse semirings whose per-sample rows have no meaning here (path records)."""
    factors = sr.semirings if isinstance(sr, Product) else (sr,)
    for s in factors:
        if s.records_paths or isinstance(s, KBest):
            raise PerSampleError(
                f"per-sample values are not supported for {s.name}: its paths are recorded "
                "once per pass, not per example. Run MaxProd per sample for the best path "
                "values, or TopPath on one example at a time for the paths"
            )


class BatchedTensors:
    """The model's batched inputs in a per-sample block and the tensors computed from them,
    held weakly, with their autograd nodes marked ``BATCHED_KEY``: a generic row rule
    (``x * p``) is right only when ``x`` carries the batch, and a value computed from
    buffers and parameters alone, whose dim 0 may equal the batch size, does not. Kept by id
    (a WeakSet's membership test compares tensors with ``==``)."""

    def __init__(self) -> None:
        self._tensors: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()

    def add(self, tensor: Tensor) -> None:
        """Count ``tensor`` as batched, and mark its autograd node."""
        self._tensors[id(tensor)] = tensor
        if tensor.grad_fn is not None:
            tensor.grad_fn.metadata[BATCHED_KEY] = True

    def holds(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` itself (not an equal one) was counted as batched."""
        return self._tensors.get(id(tensor)) is tensor

    def follow(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        """After a call ``func`` in the block: its results are batched if an argument is. A
        result that is an unbatched argument itself stays unbatched unless the call wrote
        into it (``buffer.to(x)`` returns the buffer unchanged, and counting it batched gave
        a buffer's dim 0 as the batch); a slice assignment marks the tensor it writes."""
        if not self._tensors:
            return
        given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        if not any(self.holds(t) for t in given):
            return
        writes = _writes_into_first(func)
        if func is Tensor.__setitem__ and given:
            self.add(given[0])
        for t in tree_leaves(result):
            if not isinstance(t, Tensor) or self.holds(t):
                continue
            if not writes and any(t is a for a in given):
                continue  # an argument handed back unchanged
            self.add(t)


def _writes_into_first(func: Any) -> bool:
    """Whether ``func`` is an in-place call (``add_``, ``__iadd__``, ``copy_``, ...): its
    result is its first argument, changed."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS


_IN_PLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "pow", "and", "or", "xor")
)


def _module_of(node) -> str | None:
    module = node.metadata.get(MODULE_KEY)
    if module is None or module == OUTSIDE_MODEL:
        return None
    return "the root module" if module == "" else f"module '{module}'"


def check_graph(
    roots: Sequence[Tensor],
    params: dict[int, str],
    batches: frozenset[int] = frozenset(),
    is_batched: Callable[[Tensor], bool] = lambda t: False,
) -> list[tuple[Any, int, Tensor]]:
    """Raise ``PerSampleError`` before the pass if a node without a per-sample rule feeds a
    parameter in ``params`` (id -> name), a generic row rule's node meets the parameter with
    a factor that does not carry the batch (``rules.per_sample.unbatched_operand``;
    ``is_batched`` says whether a tensor is the model's input or computed from it in the
    block, ``BatchedTensors.holds``), or a node inside
    the model mixes examples (``batches``: the dim-0 sizes of the model's inputs, when the
    forward ran in the block). Returns ``(node, input_nr, parameter)`` for the uses a generic
    row rule handles (``hook_rules``)."""
    generic: list[tuple[Any, int, Tensor]] = []
    seen: set[int] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    root_ids = {id(node) for node in stack}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        module = _module_of(node)
        if module is not None:  # created inside the model's forward (the loss is outside)
            reason = mixing_reason(node, id(node) in root_ids, batches)
            if reason is not None:
                raise PerSampleError(
                    f"per-sample values need examples that do not mix, but {node.name()} "
                    f"(created by {module}) mixes them: {reason}"
                )
        for input_nr, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)
            known = variable is not None and id(variable) in params
            if known and row_rule(node.name()) is not None:
                operand = unbatched_operand(node, input_nr, is_batched)
                if operand is not None:
                    where = f", created by {module}," if module else ""
                    raise PerSampleError(
                        f"per-sample values: parameter '{params[id(variable)]}' is used by "
                        f"{node.name()}{where} with {operand}: that operand need not carry "
                        "the batch, so the use is not split by example (a weight computed from "
                        "parameters and buffers, a pruned or masked weight say, has no "
                        "per-sample rows); see 'Per-sample values' in the README"
                    )
                generic.append((node, input_nr, variable))
            if known and not has_per_sample_rule(node.name()):
                if MODULE_KEY not in node.metadata:
                    raise PerSampleError(
                        f"per-sample values: parameter '{params[id(variable)]}' is used by "
                        f"{node.name()}, created outside a semipack.extend(..., per_sample=True) "
                        "block: run the forward inside the block (the module extensions that "
                        "compute the rows only run there)"
                    )
                where = f", created by {module}" if module else ""
                raise PerSampleError(
                    f"per-sample values: parameter '{params[id(variable)]}' is used by "
                    f"{node.name()}{where}, which has no per-sample rule. Supported: "
                    "parameters used directly by F.linear, conv1d/conv2d, F.layer_norm, "
                    "F.embedding and nn.MultiheadAttention (the module extensions, with "
                    "extensions=True); see 'Per-sample values' in the README"
                )
            stack.append(nxt)
    return generic


def hook_rules(
    uses: Sequence[tuple[Any, int, Tensor]], rows: PerSampleRows
) -> list[torch.utils.hooks.RemovableHandle]:
    """Pre-hooks that run the generic row rules on the state arriving at each node of ``uses``
    (from ``check_graph``) and report the rows to ``rows``; remove them after the pass."""
    by_node: dict[int, tuple[Any, list[tuple[int, Tensor]]]] = {}
    for node, input_nr, param in uses:
        by_node.setdefault(id(node), (node, []))[1].append((input_nr, param))
    handles = []
    for node, params in by_node.values():
        rule = row_rule(node.name())

        def prehook(grad_outputs, node=node, params=params, rule=rule):
            msg = grad_outputs[0]
            if in_carry_pass() or not isinstance(msg, Message):
                return None
            for input_nr, param in params:
                rows.add(param, rule(msg.semiring, node, msg.parts, input_nr))
            return None

        handles.append(node.register_prehook(prehook))
    return handles


class PerSampleRows:
    """The rows reported during one pass: parameter id -> ``[N, *p.shape]`` state."""

    def __init__(self, sr: Semiring, params: dict[int, str]) -> None:
        self.sr = sr
        self.names = params
        self.rows: dict[int, State] = {}
        self._lock = threading.Lock()

    def wants(self, node) -> Tensor | None:
        """The parameter behind ``node`` (an input edge's node), if it is one we collect."""
        variable = getattr(node, "variable", None) if node is not None else None
        if variable is not None and id(variable) in self.names:
            return variable
        return None

    def add(self, param: Tensor, rows: State) -> None:
        """Semiring-add ``rows`` (``[N, *param.shape]``) to what ``param`` has."""
        with self._lock:
            before = self.rows.get(id(param))
            if before is not None and before[0].shape[0] != rows[0].shape[0]:
                raise _disagree(self.names[id(param)], before[0].shape[0], rows[0].shape[0])
            self.rows[id(param)] = rows if before is None else self.sr.plus(before, rows)

    def check(self, params: Sequence[Tensor], batches: frozenset[int] = frozenset()) -> None:
        """Raise unless every parameter in ``params`` has rows, all of one batch size, and
        that size is the dim 0 of a model input (``batches``, when known)."""
        for p in params:
            if id(p) not in self.rows:
                raise PerSampleError(
                    f"per-sample values: no rows reached parameter '{self.names[id(p)]}'"
                )
        sizes = [self.rows[id(p)][0].shape[0] for p in params]
        if len(set(sizes)) > 1:
            batch = max(set(sizes), key=sizes.count)
            odd = ", ".join(
                f"'{self.names[id(p)]}' ({n})"
                for p, n in zip(params, sizes, strict=True)
                if n != batch
            )
            raise PerSampleError(
                f"per-sample values: most parameters saw a batch of {batch} examples, but {odd} "
                "did not: they were used on a tensor whose dim 0 is not the batch. A lookup "
                "broadcast over the batch (Hugging Face position embeddings: pass position_ids "
                "of shape [N, T]) or a sequence-first layout (put the batch first)"
            )
        if sizes and batches and sizes[0] not in batches:
            inputs = " or ".join(str(n) for n in sorted(batches))
            raise PerSampleError(
                f"per-sample values: the parameters saw a batch of {sizes[0]} rows, but the "
                f"model's input has {inputs} examples in dim 0: a layer saw a tensor whose dim "
                "0 is not the batch (a sequence-first layout such as x.transpose(0, 1), or "
                "examples flattened with tokens, x.reshape(N * T, -1)). Keep the batch in dim "
                "0 of every layer's input"
            )

    def store(self, params: Sequence[Tensor], keep_state: bool) -> None:
        """``semiring_grad_batch`` (and with ``keep_state`` ``semiring_state_batch``) on each
        parameter in ``params`` (``check`` first)."""
        for p in params:
            rows = self.rows[id(p)]
            setattr(p, SEMIRING_GRAD_BATCH, self.sr.readout(rows))
            if keep_state:
                setattr(p, SEMIRING_STATE_BATCH, tuple(rows))
            elif hasattr(p, SEMIRING_STATE_BATCH):
                delattr(p, SEMIRING_STATE_BATCH)


def _disagree(name: str, a: int, b: int) -> PerSampleError:
    return PerSampleError(
        f"per-sample values: parameter '{name}' is used on batches of {a} and {b} examples; "
        "every use must see the model's batch on dim 0"
    )


def clear(t: Tensor) -> None:
    """Remove per-sample results an earlier pass left on ``t``."""
    for name in (SEMIRING_GRAD_BATCH, SEMIRING_STATE_BATCH):
        if hasattr(t, name):
            delattr(t, name)


_lock = threading.Lock()
_active: list[PerSampleRows] = []


@contextmanager
def collecting(rows: PerSampleRows) -> Iterator[PerSampleRows]:
    """Make ``rows`` the collector the nodes report to while the pass runs. Module-level, not
    thread-local: on CUDA the engine runs backward functions on its own threads."""
    with _lock:
        _active.append(rows)
    try:
        yield rows
    finally:
        with _lock:
            _active.remove(rows)


def active_rows() -> PerSampleRows | None:
    """The collector of the running per-sample pass, if any (None in a carry pass too)."""
    with _lock:
        return _active[-1] if _active else None


__all__ = [
    "SEMIRING_GRAD_BATCH",
    "SEMIRING_STATE_BATCH",
    "BatchedTensors",
    "PerSampleRows",
    "active_rows",
    "check_graph",
    "check_semiring",
    "clear",
    "collecting",
    "hook_rules",
]
