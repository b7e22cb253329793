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
import torch.nn.functional as F
import torch.utils.hooks
from torch import Tensor
from torch.utils._pytree import tree_leaves

from ..errors import PerSampleError
from ..graph.batch_dims import batch_dim_after, call_name, dim_after_index
from ..graph.provenance import MODULE_KEY, OUTSIDE_MODEL, current_module
from ..messages.message import Message
from ..rules.per_sample import (
    BATCHED_KEY,
    FACTORS_KEY,
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
    held weakly with the dim their batch is on (``graph.batch_dims``; None where the call
    mixed or split the examples), their autograd nodes marked ``BATCHED_KEY`` with it. Rows
    are right only where the batch is dim 0: a layer's input, or the other operand of a
    generic row rule (``x * p``); a value computed from buffers and parameters alone, whose
    dim 0 may equal the batch size, is not held at all. Kept by id (a WeakSet's membership
    test compares tensors with ``==``)."""

    def __init__(self) -> None:
        self._tensors: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        #: id -> (batch dim, the call that lost it when the dim is None)
        self._dims: dict[int, tuple[int | None, str]] = {}
        #: dim-0 sizes of the model's inputs
        self.sizes: set[int] = set()

    def add_input(self, tensor: Tensor) -> None:
        """Hold a model input: its dim 0 is the batch."""
        self.sizes.add(int(tensor.shape[0]))
        self.add(tensor)

    def add(self, tensor: Tensor, dim: int | None = 0, lost_by: str = "") -> None:
        """Hold ``tensor`` with its batch on ``dim`` (None: no dim holds one example per
        index, since the call ``lost_by``), and mark its autograd node."""
        if len(self._dims) > 2 * len(self._tensors) + 1024:  # ids of tensors gone
            self._dims = {k: self._dims[k] for k in list(self._tensors) if k in self._dims}
        self._tensors[id(tensor)] = tensor
        self._dims[id(tensor)] = (dim, lost_by)
        if tensor.grad_fn is not None:
            tensor.grad_fn.metadata[BATCHED_KEY] = dim
            tensor.grad_fn.metadata[LOST_BY_KEY] = lost_by

    def mark_nodes(self) -> None:
        """Mark the autograd nodes of held tensors that got theirs after the call the block
        saw: a custom ``autograd.Function``'s output is the tensor its forward computed (the
        block followed the calls inside), its node set by ``apply`` afterwards."""
        for key, tensor in list(self._tensors.items()):
            node = tensor.grad_fn
            if node is not None and BATCHED_KEY not in node.metadata:
                dim, lost_by = self._dims.get(key, (None, ""))
                node.metadata[BATCHED_KEY] = dim
                node.metadata[LOST_BY_KEY] = lost_by

    def lost_by(self, tensor: Tensor) -> str:
        """The call after which a held ``tensor``'s examples have no dim of their own."""
        return self._dims.get(id(tensor), (None, ""))[1]

    def batch_dim(self, tensor: Tensor) -> int | NotHeld | None:
        """The dim ``tensor`` (itself, not an equal one) has its batch on, None if it has
        none, ``NOT_HELD`` if it was not computed from the model's input in the block."""
        if self._tensors.get(id(tensor)) is not tensor:
            return NOT_HELD
        return self._dims.get(id(tensor), (None, ""))[0]

    def holds(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` has the batch on dim 0."""
        return self.batch_dim(tensor) == 0

    def follow(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        """After a call ``func`` in the block: hold each result computed from a held
        argument, with the dim its batch went to; raise ``PerSampleError`` if a layer that
        computes rows got an input whose dim 0 is not the batch (its node is marked
        ``MISPLACED_KEY``, for ``check_graph`` to refuse). A result that is an
        unheld argument itself stays unheld unless the call wrote into it (``buffer.to(x)``
        returns the buffer unchanged, and holding it gave a buffer's dim 0 as the batch); a
        slice assignment writes the batch into its target."""
        if not self._tensors:
            return
        given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        held = [(t, self.batch_dim(t)) for t in given]
        held = [(t, d) for t, d in held if d is not NOT_HELD]
        if not held:
            return
        problem = misplaced_batch(func, args, kwargs, self)
        if problem is not None:  # refused if the backward reaches one of its parameters
            for t in tree_leaves(result):
                if isinstance(t, Tensor) and t.grad_fn is not None:
                    t.grad_fn.metadata[MISPLACED_KEY] = problem
        if func is Tensor.__setitem__ and given:
            self._follow_assignment(args)
            return
        name = call_name(func)
        if name in _SHAPED_BY_ARGUMENTS:
            return  # x.new_zeros(shape): nothing of the batch, in a layout of its own
        _keep_factors(func, args, result)
        writes = _writes_into_first(func)
        results = [t for t in tree_leaves(result) if isinstance(t, Tensor)]
        for position, t in enumerate(results):
            if not writes and any(t is a for a in given):
                continue  # an argument handed back unchanged
            dim = _combined(func, args, kwargs, held, t, position)
            lost = next((self.lost_by(s) for s, d in held if d is None), None) or name
            self.add(t, dim, lost)
            base = t._base if writes else None
            if dim is None and base is not None and self.batch_dim(base) is not NOT_HELD:
                self.add(base, None, lost)  # written through a view: the base changed too

    def _follow_assignment(self, args: tuple) -> None:
        """``target[index] = value``: where the value's batch lands in the target, through
        the index (``out[:, 0] = h[:, 0]``, ``buf[0] = h``); an index tensor on the batch
        (``out[perm] = h``) moves examples, and a target whose own batch is elsewhere mixes
        them. A value that is not the batch's leaves the target as it was."""
        target, index = args[0], args[1]
        value = args[2] if len(args) > 2 else None
        written = self.batch_dim(value) if isinstance(value, Tensor) else NOT_HELD
        if written is NOT_HELD:
            return
        own = self.batch_dim(target)
        place = None
        if written is not None:
            view = target[index]
            at = written + view.dim() - value.dim()
            if 0 <= at < view.dim() and view.shape[at] == value.shape[written]:
                for t in range(target.dim()):
                    if dim_after_index(target, index, t, view) == at:
                        place = t
                        break
        dim = place if own is NOT_HELD or own == place else None
        lost = self.lost_by(value) if written is None else "an indexed assignment"
        self.add(target, dim, lost)


#: Calls whose result's shape comes from their arguments, not from the tensor they are
#: called on (``x.new_zeros(n, d)``): the result holds nothing of the batch.
_SHAPED_BY_ARGUMENTS = frozenset(("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"))


def how_lost(call: str) -> str:
    """What the call ``call`` (a ``graph.batch_dims.call_name``) did to the batch, in words."""
    if call in _MERGING:
        return (
            f"'{call}' merged the batch with other dims (x.reshape(N * T, -1)): every layer "
            "must see the batch as a dim of its own"
        )
    if call == "__getitem__":
        return "indexing picked or reordered examples"
    return f"'{call}' mixed, split or picked the examples"


_MERGING = frozenset(("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "ravel"))


def _keep_factors(func: Any, args: tuple, result: Any) -> None:
    """``x * p`` with a leaf ``p`` (a gain): keep both factors on the node for the row rule
    (``rules.per_sample.FACTORS_KEY``). The node saved ``x`` anyway; inside a checkpoint
    this keeps it alive until the row rule has run (``hook_rules`` lets it go)."""
    if call_name(func) not in _PRODUCTS or len(args) != 2 or not isinstance(result, Tensor):
        return
    if result.grad_fn is None or result.grad_fn.name() != "MulBackward0":
        return
    if not all(isinstance(a, Tensor) for a in args):
        return
    if any(a.requires_grad and a.grad_fn is None for a in args):
        first, second = args if call_name(func) != "__rmul__" else args[::-1]
        result.grad_fn.metadata[FACTORS_KEY] = (first, second)


_PRODUCTS = frozenset(("mul", "multiply", "__mul__", "__rmul__"))


class NotHeld:
    """``BatchedTensors.batch_dim`` of a tensor not computed from the model's input."""

    def __repr__(self) -> str:
        return "NOT_HELD"


NOT_HELD = NotHeld()


def _combined(
    func: Any,
    args: tuple,
    kwargs: dict,
    sources: list[tuple[Tensor, int | None]],
    out: Tensor,
    position: int,
) -> int | None:
    """The batch dim of ``out`` (result ``position``) that every held argument agrees on
    (None if any disagrees, or came in without one)."""
    dims = {
        None if d is None else batch_dim_after(func, args, kwargs, s, d, out, position)
        for s, d in sources
    }
    return dims.pop() if len(dims) == 1 else None


#: Autograd node metadata: with ``BATCHED_KEY`` None, the call after which the node's value
#: had no dim holding one example per index.
LOST_BY_KEY = "semipack_batch_lost_by"

#: Autograd node metadata: why the layer call that made the node cannot compute per-sample
#: rows (``misplaced_batch``); ``check_graph`` raises it when the node feeds a parameter.
MISPLACED_KEY = "semipack_misplaced_batch"

#: Calls whose backward computes per-sample rows from one input's dim (``extensions``,
#: batch norm's generic rule): the input's position in the call and its batch dim (inside
#: ``F.multi_head_attention_forward`` the layout is sequence-first).
LAYER_INPUTS: dict[Any, tuple[str, int]] = {
    F.linear: ("Linear", 0),
    torch.conv1d: ("Conv1d", 0),
    torch.conv2d: ("Conv2d", 0),
    F.layer_norm: ("LayerNorm", 0),
    F.embedding: ("Embedding", 0),
    F.batch_norm: ("BatchNorm", 0),
    F.multi_head_attention_forward: ("MultiheadAttention", 1),
}


def misplaced_batch(func: Any, args: tuple, kwargs: dict, batched: BatchedTensors) -> str | None:
    """Why ``func`` (one of ``LAYER_INPUTS``) cannot compute rows from its input, or None:
    an input computed from the model's input whose batch is not where the layer's rows read
    it, because it moved to another dim or was lost while that dim kept a batch's size. Its
    rows would be one per token (``x.transpose(0, 1)`` with as many tokens as examples),
    silently."""
    layer = LAYER_INPUTS.get(func)
    if layer is None:
        return None
    name, want = layer
    x = args[0] if args else kwargs.get("input", kwargs.get("query"))
    if not isinstance(x, Tensor) or x.dim() <= want:
        return None
    dim = batched.batch_dim(x)
    if dim is NOT_HELD or dim == want:
        return None
    if dim is None and x.shape[want] not in batched.sizes - {1}:
        return None  # not taken for examples: the rows' own checks name what went wrong
    where = (
        f"no dim holds one example per index ({how_lost(batched.lost_by(x))})"
        if dim is None
        else f"the batch is on dim {dim}"
    )
    module = _module_name(current_module())
    return (
        f"{name}{f' ({module})' if module else ''} on an input of shape {tuple(x.shape)} "
        f"computed from the model's input in which {where}: its rows would not be examples. "
        f"Keep the batch in dim {want} of every layer's input (a sequence-first layout such "
        "as x.transpose(0, 1) gives one row per token)"
    )


def _writes_into_first(func: Any) -> bool:
    """Whether ``func`` is an in-place call (``add_``, ``__iadd__``, ``copy_``, ...): its
    result is its first argument, changed."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS


_IN_PLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "pow", "and", "or", "xor")
)


def _module_of(node) -> str | None:
    return _module_name(node.metadata.get(MODULE_KEY))


def _module_name(module: str | None) -> str | None:
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
    unbatched: list[Any] = []  # nodes inside the model whose values lost the batch
    misplaced: list[str] = []  # layers whose input has the batch elsewhere
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
            lost = node.metadata.get(BATCHED_KEY, 0) is None and id(node) not in root_ids
            if lost and _first_size(node) in batches - {1}:
                unbatched.append(node)
        for input_nr, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)
            known = variable is not None and id(variable) in params
            if known and MISPLACED_KEY in node.metadata:
                misplaced.append(
                    f"per-sample values: parameter '{params[id(variable)]}' is used by "
                    f"{node.metadata[MISPLACED_KEY]}"
                )
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
    if misplaced:  # after the checks above, whose messages name a cause the layer follows from
        raise PerSampleError(misplaced[0])
    if batches - {1}:
        _refuse_lost_batch(unbatched, params)
    return generic


def _first_size(node) -> int | None:
    """Dim 0 of ``node``'s (first) output, as autograd recorded it; None when unknown."""
    try:
        shape = node._input_metadata[0].shape
    except (AttributeError, IndexError, RuntimeError):
        return None
    return int(shape[0]) if len(shape) else None


def _refuse_lost_batch(nodes: Sequence[Any], params: dict[int, str]) -> None:
    """Raise for the first of ``nodes`` (inside the model, their values without a dim that
    holds one example per index while dim 0 has a batch's size) that a parameter in
    ``params`` feeds: a row would hold other examples' paths (``h @ (h.T @ h)``,
    ``h[perm]``, ``h.t().mean(-1)``). Checked after the node types ``mixing_reason`` names,
    whose messages say more; a value whose dim 0 is no batch size is left to the rows'
    own checks, which name the layer."""
    for node in nodes:
        reach, seen = [node], set()
        while reach:
            n = reach.pop()
            if n is None or id(n) in seen:
                continue
            seen.add(id(n))
            variable = getattr(n, "variable", None)
            if variable is not None and id(variable) in params:
                raise PerSampleError(
                    f"per-sample values need examples that do not mix, but {node.name()} "
                    f"(created by {_module_of(node)}, from parameter "
                    f"'{params[id(variable)]}') computes a value in which no dim holds one "
                    f"example per index: {how_lost(node.metadata.get(LOST_BY_KEY, '?'))}"
                )
            reach.extend(nxt for nxt, _ in n.next_functions)


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
            node.metadata.pop(FACTORS_KEY, None)  # a later pass reads the saved factor
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
