"""Reading the best paths out of a TopPath or KBest backward pass.

While the backward runs, a pre-hook on every autograd node records, for each tensor the node
produced, the successor id and message value of each path slot of each entry (one slot per entry
for TopPath, k for KBest: ``Semiring.path_slots``), then gives the slots fresh ids before the
node's backward runs. Extensions may record tensors internal to a fused module the same way
(``PathTrace.relabel_state``). A leaf slot's successor starts the walk; following successors
reaches the root, whose successor is -1.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import Node

from ..errors import SemipackError
from ..graph.provenance import MODULE_KEY
from ..graph.sites import ROOT_MODULE, SITE_KEY, Site
from ..semirings.base import Semiring, State
from ..semirings.top_path import NO_SUCCESSOR
from .message import MODULE_HOOK_NODE, Message


@dataclass
class TensorRecord:
    """One tensor of the graph as the backward saw it: ids ``base .. base + ranks * numel``,
    slot ``r`` of flat entry ``i`` being ``base + r * numel + i``."""

    base: int
    shape: tuple[int, ...]
    successors: Tensor  # flat int64, [ranks * numel]
    log_values: Tensor  # flat, [ranks * numel]
    op: str
    module: str | None
    site: Site | None
    ranks: int = 1

    def slot(self, offset: int) -> tuple[tuple[int, ...], int]:
        """The entry (index) and rank of the slot at flat ``offset``."""
        numel = math.prod(self.shape)
        rank, flat = divmod(offset, numel) if numel else (0, 0)
        if not self.shape:
            return (), rank
        entry = torch.unravel_index(torch.tensor(flat), self.shape)
        return tuple(int(i) for i in entry), rank


@dataclass
class PathStep:
    """One scalar node on a path: where it is and the log of the path's product from it onward
    (for KBest, ``rank`` says which of the node's k best continuations the path takes)."""

    description: str
    module: str | None
    op: str
    index: tuple[int, ...]
    log_value: float
    rank: int = 0


@dataclass
class Path:
    """A path from a leaf entry to the root, leaf first: the best (``rank`` 0) or, from KBest,
    the ``rank``-th best after it."""

    leaf: str
    index: tuple[int, ...]
    log_value: float
    steps: list[PathStep] = field(default_factory=list)
    rank: int = 0

    @property
    def value(self) -> float:
        """The product of |local derivatives| along the path."""
        return math.exp(self.log_value)

    def modules(self) -> list[tuple[str | None, tuple[int, ...]]]:
        """(module, entry) of the last step of each run of steps inside one module: the module
        outputs the path passes through, independent of how the module's ops were recorded."""
        out: list[tuple[str | None, tuple[int, ...]]] = []
        for i, step in enumerate(self.steps):
            nxt = self.steps[i + 1] if i + 1 < len(self.steps) else None
            if nxt is None or nxt.module != step.module:
                out.append((step.module, step.index))
        return out

    def __str__(self) -> str:
        if self.log_value == -math.inf:  # the semiring zero: no path reaches the entry
            return f"no path from {self.leaf}{list(self.index)} (its value is the zero)"
        which = "best path" if self.rank == 0 else f"path {self.rank + 1}"
        lines = [f"{which} from {self.leaf}{list(self.index)}: value {self.value:.6g}"]
        previous = self.log_value
        for step in self.steps:
            edge = math.exp(previous - step.log_value) if math.isfinite(step.log_value) else 0.0
            lines.append(f"  x{edge:<12.6g} {step.description}")
            previous = step.log_value
        if self.steps and math.isfinite(previous) and previous != 0.0:
            # the edge from the virtual root: the gradient given for the output (|grad_output|)
            lines.append(f"  x{math.exp(previous):<12.6g} the seed (the output's grad_output)")
        return "\n".join(lines)


class PathTrace:
    """Successor tables of one backward pass."""

    def __init__(self, leaf_names: dict[int, str] | None = None) -> None:
        self.records: list[TensorRecord] = []
        self.bases: list[int] = []
        self.next_id = 0
        self.leaf_names = leaf_names or {}

    def relabel(
        self,
        log_values: Tensor,
        successors: Tensor,
        op: str,
        module: str | None,
        site: Site | None = None,
        ranks: int = 1,
    ) -> Tensor:
        """Record a tensor's successors and return fresh ids for its slots. With ``ranks`` > 1
        (KBest), ``log_values`` and ``successors`` are [ranks, *shape]; else the tensor's shape."""
        shape = tuple(log_values.shape)
        base = self.next_id
        self.next_id += log_values.numel()
        self.records.append(
            TensorRecord(
                base,
                shape[1:] if ranks > 1 else shape,
                successors.expand(shape).reshape(-1).clone(),
                log_values.reshape(-1).detach().clone(),
                op,
                module,
                site,
                ranks,
            )
        )
        self.bases.append(base)
        return torch.arange(base, self.next_id, device=log_values.device).reshape(shape)

    def relabel_state(
        self, sr: Semiring, m: State, op: str, module: str | None, site: Site | None = None
    ) -> State:
        """Record the successors of every path slot of state ``m`` of the path-recording
        semiring ``sr`` and return ``m`` with fresh ids for them."""
        values, successors = sr.path_slots(m)
        ranks = values.shape[0]
        if ranks == 1:
            ids = self.relabel(values[0], successors[0], op, module, site)[None]
        else:
            ids = self.relabel(values, successors, op, module, site, ranks)
        return sr.with_successors(m, ids)

    def capture_leaf(self, leaf: Tensor, message: Message, fallback_name: str) -> LeafPaths:
        """The best paths from every entry of ``leaf``, given the message that reached it."""
        name = self.leaf_names.get(id(leaf), fallback_name)
        sparse = message.sparse  # an embedding table's reached rows: keep only those
        parts = message.parts if sparse is None else sparse.parts
        log_values, successors = message.semiring.path_slots(parts)
        return LeafPaths(
            self,
            name,
            log_values.detach().clone(),
            successors.clone(),
            tuple(leaf.shape),
            rows=None if sparse is None else sparse.rows,
            recorded_by=type(message.semiring),
        )

    def locate(self, node_id: int) -> tuple[TensorRecord, int]:
        """The record holding node ``node_id`` and the node's flat offset in that tensor."""
        i = bisect.bisect_right(self.bases, node_id) - 1
        record = self.records[i]
        return record, node_id - record.base

    def node_prehook(self, node):
        """A pre-hook that records the node's incoming messages and relabels their entries."""
        op = (
            node.name().removesuffix("Backward0").removesuffix("Backward1").removesuffix("Backward")
        )
        module = node.metadata.get(MODULE_KEY)
        sites = node.metadata.get(SITE_KEY, ())

        def hook(grad_outputs: Sequence[Tensor | None]):
            out = []
            changed = False
            for slot, g in enumerate(grad_outputs):
                if not isinstance(g, Message) or g.semiring.trace is not self:  # another pass
                    out.append(g)
                    continue
                site = sites[slot] if slot < len(sites) else None
                parts = self.relabel_state(g.semiring, g.parts, op, module, site)
                out.append(Message(g.regular_grad, parts, g.semiring, g.dtype))
                changed = True
            return tuple(out) if changed else None

        return hook


def records_steps(node: Node) -> bool:
    """Whether a path step is recorded at ``node``: not at AccumulateGrad (leaves are captured
    separately), nor at the identity nodes PyTorch puts around modules with backward hooks
    (BackPACK's, say), so that hooks do not change a path."""
    return not hasattr(node, "variable") and node.name() != MODULE_HOOK_NODE


def attach(trace: PathTrace, roots: Sequence[Tensor]) -> list:
    """Register the recording pre-hook on every non-leaf node reachable from ``roots``."""
    handles, seen = [], set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if records_steps(node):
            handles.append(node.register_prehook(trace.node_prehook(node)))
        stack.extend(fn for fn, _ in node.next_functions)
    return handles


def _describe(record: TensorRecord, index: tuple[int, ...]) -> str:
    if record.site is not None:
        return record.site.describe(index)
    where = record.module if record.module not in (None, "") else ROOT_MODULE
    if record.module is None:
        where = "<unnamed>"
    return f"{where}: {record.op} output {list(index)}"


class LeafPaths:
    """The paths of one tensor after a TopPath or KBest pass (stored as
    ``tensor.semiring_paths``): per entry and rank (one rank for TopPath, k for KBest), the
    log-value and the first node of that path in ``trace``.

    After ``semipack.distributed.all_reduce`` the values are those of the whole group's batch
    and ``owners`` says which process (its rank in the group) recorded each slot's path: a
    trace holds the graph of one process's batch, so only the owner can walk it, and asking
    another process for that path raises, naming the owner.

    An embedding table's paths are kept as the rows a lookup reached (``rows``, sorted; every
    other row has no path): a 30k x 384 table's full values and ids took more time and memory
    than a one-sentence backward. ``log_values`` and ``successors`` still read as the full
    ``[ranks, *shape]`` tensors, built on first access.
    """

    def __init__(
        self,
        trace: PathTrace,
        name: str,
        log_values: Tensor,
        successors: Tensor,
        shape: tuple[int, ...],
        owners: Tensor | None = None,
        process: int = 0,
        rows: Tensor | None = None,
        recorded_by: type | None = None,
    ) -> None:
        self.trace, self.name, self.shape = trace, name, tuple(shape)
        #: the class of the semiring whose pass recorded the paths (None: not known)
        self.recorded_by = recorded_by
        self.owners = owners  # [ranks, *shape], process ranks; None: all local
        self.process = process  # this process's rank in the group ``owners`` refers to
        self.rows = rows  # None: ``log_values`` / ``successors`` are full-shaped
        self._values = log_values  # [ranks, *shape], or [ranks, len(rows), *shape[1:]]
        self._successors = successors  # the same shape; node ids in ``trace``
        self._full: tuple[Tensor, Tensor] | None = None

    @property
    def log_values(self) -> Tensor:
        """[ranks, *shape]: each slot's path log-value (``-inf``: no path)."""
        return self._values if self.rows is None else self._densified()[0]

    @property
    def successors(self) -> Tensor:
        """[ranks, *shape]: each slot's first node in ``trace`` (``NO_SUCCESSOR``: none)."""
        return self._successors if self.rows is None else self._densified()[1]

    def _densified(self) -> tuple[Tensor, Tensor]:
        if self._full is None:
            ranks = self._values.shape[0]
            values = self._values.new_full((ranks, *self.shape), -math.inf)
            ids = self._successors.new_full((ranks, *self.shape), NO_SUCCESSOR)
            values[:, self.rows] = self._values
            ids[:, self.rows] = self._successors
            self._full = (values, ids)
        return self._full

    def path(self, index: tuple[int, ...] | int | None = None, rank: int = 0) -> Path:
        """The ``rank``-th best path (0: the best) from entry ``index`` (default: the entry
        with the best path) to the root."""
        ranks = self._values.shape[0]
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
            raise IndexError(
                f"path(rank={rank!r}): the pass recorded {ranks} rank(s) per entry, 0 to "
                f"{ranks - 1} (0: the best path)"
            )
        return self._walk(self._flat(index), rank)

    def paths(self, index: tuple[int, ...] | int | None = None) -> list[Path]:
        """Every recorded path from entry ``index`` (default: the entry with the best path),
        best first; ranks without a path (fewer paths than ranks) are left out, so an entry
        with no path at all gives an empty list."""
        flat = self._flat(index)
        ranks = self._values.shape[0]
        found = [self._walk(flat, r) for r in range(ranks)]
        return [p for p in found if p.log_value != -math.inf]

    def _flat(self, index: tuple[int, ...] | int | None) -> int:
        if index is not None:
            return _ravel(_integer_index(index), self.shape)
        best = int(self._values[0].reshape(-1).argmax()) if self._values[0].numel() else 0
        if self.rows is None or self.rows.numel() == 0:
            return best
        if self._values[0].reshape(-1)[best] == -math.inf:
            return 0  # no path anywhere: the first entry, as the full-shaped argmax gives
        inner = math.prod(self.shape[1:])
        return int(self.rows[best // inner]) * inner + best % inner

    def _stored(self, flat: int) -> int | None:
        """Where slot ``flat`` of the full shape is stored: its flat position in ``_values[r]``,
        None for a row no lookup reached (no path)."""
        if self.rows is None:
            return flat
        inner = math.prod(self.shape[1:])
        row, rest = divmod(flat, inner)
        at = int(torch.searchsorted(self.rows, row))
        if at == self.rows.numel() or int(self.rows[at]) != row:
            return None
        return at * inner + rest

    def _walk(self, flat: int, rank: int) -> Path:
        shape = self.shape
        start = (
            tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if shape else ()
        )
        stored = self._stored(flat)
        value = -math.inf if stored is None else float(self._values[rank].reshape(-1)[stored])
        path = Path(self.name, start, value, rank=rank)
        if path.log_value == -math.inf:  # no path: successor ids of "no path" states mean nothing
            return path
        if self.owners is not None:
            owner = int(self.owners[rank].reshape(-1)[flat])
            if owner != self.process:
                which = "best path" if rank == 0 else f"path of rank {rank}"
                raise SemipackError(
                    f"the {which} from {self.name}{list(start)} (value {path.value:.6g}) was "
                    f"recorded by process {owner}, not by this one (process {self.process}): "
                    "after semipack.distributed.all_reduce each path stays on the process whose "
                    f"batch holds it. Read it on process {owner}."
                )
        node = int(self._successors[rank].reshape(-1)[stored])
        guard = len(self.trace.records) + 1
        while node != NO_SUCCESSOR and guard > 0:
            record, offset = self.trace.locate(node)
            entry, step_rank = record.slot(offset)
            path.steps.append(
                PathStep(
                    _describe(record, entry),
                    record.module,
                    record.op,
                    entry,
                    float(record.log_values[offset]),
                    step_rank,
                )
            )
            node = int(record.successors[offset])
            guard -= 1
        return path


def _integer_index(index: object) -> tuple[int, ...]:
    """``index`` as a tuple of Python ints: an int, a sequence of ints or an integer tensor (as
    ``tensor.argmax()`` or ``torch.unravel_index`` return them; numpy integers too). Anything
    else, a float or a bool included, is a TypeError naming what was given."""
    if isinstance(index, Tensor):
        if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
            raise TypeError(f"a path index must hold integers, got a {index.dtype} tensor")
        index = index.tolist()
    items = index if isinstance(index, (tuple, list)) else (index,)
    out = []
    for i in items:
        try:
            if isinstance(i, bool) or (isinstance(i, Tensor) and i.dtype == torch.bool):
                raise TypeError
            out.append(operator.index(i))
        except TypeError:
            raise TypeError(
                "a path index must be integers (an int, a tuple of ints or an integer tensor), "
                f"got {type(i).__name__} {i!r}"
            ) from None
    return tuple(out)


def _ravel(index: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Flat position of ``index`` in a tensor of ``shape``, with PyTorch's index rules:
    one integer per dim, negative values count from the end, out of range is an IndexError."""
    if len(index) != len(shape):
        raise IndexError(
            f"an index into a leaf of shape {list(shape)} needs {len(shape)} integers, "
            f"got {len(index)}: {list(index)}"
        )
    flat = 0
    for dim, (i, s) in enumerate(zip(index, shape, strict=True)):
        if not -s <= i < s:
            raise IndexError(f"index {i} is out of bounds for dimension {dim} with size {s}")
        flat = flat * s + (i % s)
    return flat
