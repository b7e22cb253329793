"""Data-parallel semiring values: the semiring plus as a collective over ``torch.distributed``.

Under data parallelism each process runs the backward on its own share of the batch. When the
loss sums over examples, the paths from the loss to a parameter are the disjoint union of the
paths through each example, so the whole batch's state of that parameter is the semiring plus,
over processes, of the processes' states. ``all_reduce`` computes that plus with collectives and
rewrites ``semiring_grad`` and ``semiring_state`` (and, after TopPath or KBest,
``semiring_paths``) on every process, as if one process had run the whole batch.

It combines states, not readouts: a readout cannot always be combined (Entropy's entropy has
lost the mass that weighs each process's share), so the pass must keep them
(``semipack.extend(..., keep_state=True)``).

Each semiring's plus becomes the cheapest collectives that compute it exactly (``_REDUCERS``):

- MaxProd, SignedMaxProd, Boolean: one MAX (the min components negated, booleans as bytes);
- LogSum, LogCount: a MAX of the log values, then a SUM of the exponentials shifted by it (the
  log-sum-exp of the processes' values, no overflow or underflow of the shifted terms);
- Entropy: the same, one SUM carrying both the mass and the mass-weighted mean surprisal;
- Real: one SUM;
- TopPath: a MAX of the values, then a MIN of the rank of a process holding each maximum (the
  lowest: ties go to the first process, the first part of the concatenated batch);
- any other semiring (KBest, user semirings): every process's states gathered as bytes, then
  folded with ``semiring.plus`` in rank order.

States are flattened into buckets of at most ``bucket_mb`` MiB, so a model's parameters take a
few collectives per bucket, plus two small ones that check every process agrees on what is
reduced (a disagreement raises on every process instead of hanging).
"""

from __future__ import annotations

import math
import numbers
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .errors import SemipackError
from .kernels.logspace import finite_or_zero
from .messages.paths import LeafPaths, PathTrace
from .semirings import (
    Boolean,
    Entropy,
    LogSum,
    MaxProd,
    Product,
    Real,
    Semiring,
    SignedMaxProd,
    TopPath,
)
from .semirings.base import State
from .semirings.top_path import NO_SUCCESSOR
from .transport.backward import SEMIRING_GRAD, SEMIRING_STATE, require_semiring

#: Default bucket size, as DistributedDataParallel's ``bucket_cap_mb``.
BUCKET_MB = 25.0


@dataclass(frozen=True)
class _Group:
    """The process group a reduction runs over, with this process's place in it."""

    handle: Any  # a ProcessGroup, or None for the default group
    size: int
    rank: int

    def all_reduce(self, tensor: Tensor, op: Any) -> Tensor:
        """``tensor`` reduced in place over the group with ``op`` (a ``dist.ReduceOp``)."""
        dist.all_reduce(tensor, op=op, group=self.handle)
        return tensor

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every process's ``tensor`` (same shape and dtype on all of them), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor, group=self.handle)
        return out


class ReducedState(tuple):
    """A state ``all_reduce`` wrote (a plain tuple of its components otherwise): reducing it
    again would count every other process's paths once more for the sum-like semirings, so
    ``all_reduce`` refuses it until a new backward replaces it."""

    __slots__ = ()


@dataclass
class _Reduced:
    """A bucket's reduced state (1-D components) and, for path-recording semirings, the rank
    of the process that recorded each path slot ([ranks, n]; None otherwise)."""

    state: State
    owners: Tensor | None = None


#: A reduction of one bucket: (semiring, the local state as 1-D components, group) -> result.
Reducer = Callable[[Semiring, State, _Group], _Reduced]


def all_reduce(
    tensors: nn.Module | Tensor | Iterable[Tensor],
    semiring: Semiring,
    group: Any = None,
    *,
    bucket_mb: float = BUCKET_MB,
) -> list[Tensor]:
    """Combine every process's semiring states with ``semiring``'s plus; return the tensors
    that hold a value afterwards.

    ``tensors`` is a module (its parameters that require grad; a ``DistributedDataParallel``
    wrapper or the model inside it), one tensor or several, in the same order on every process
    of ``group`` (default: the whole world). Every process must call it, after a backward run
    in ``semipack.extend(..., keep_state=True)`` with the same ``semiring`` (its readout
    options, ``log=`` say, apply to the new ``semiring_grad``).

    Each tensor's ``semiring_state`` (components shaped like it) becomes the plus over
    processes, the first process first, and ``semiring_grad`` its readout. A tensor no backward
    reached on some process counts there as the zero (no path); one reached on no process is
    left as it is. After TopPath or KBest, ``semiring_paths`` has the reduced values and the rank
    of the process that recorded each path: the traces stay where they were recorded, so
    ``path()`` works on that process and raises elsewhere, naming it.

    The result is what one process would compute on the concatenated batch when the loss each
    process backpropagates weights its examples as that single loss would (``reduction="sum"``,
    or a mean divided by the global batch size). With a per-process mean every path product
    carries ``1 / local batch`` instead of ``1 / global batch``: MaxProd and LogSum values are
    then ``world size`` times the full batch's (Entropy, which normalises, is unaffected).
    """
    sr = require_semiring(semiring)
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, numbers.Real):
        raise TypeError(f"all_reduce(bucket_mb=...) takes a number of MiB, got {bucket_mb!r}")
    if not 0 < bucket_mb < math.inf:  # NaN too; 0 and below were taken as tiny buckets
        raise ValueError(
            f"all_reduce(bucket_mb=...) must be a finite number above 0 MiB, got {bucket_mb!r}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise SemipackError(
            "semipack.distributed.all_reduce needs torch.distributed: call "
            "torch.distributed.init_process_group first (in every process)"
        )
    named = _named_tensors(tensors)
    g = _Group(group, dist.get_world_size(group), dist.get_rank(group))
    small = _small_tensor_device(group)
    _agree(named, sr, g, small)
    present = torch.tensor(
        [hasattr(t, SEMIRING_STATE) for _, t in named], dtype=torch.uint8, device=small
    )
    g.all_reduce(present, dist.ReduceOp.MAX)
    chosen = [(n, t) for (n, t), hit in zip(named, present.tolist(), strict=True) if hit]
    if named and not chosen:  # every process agrees: nothing to combine anywhere
        warnings.warn(
            "semipack.distributed.all_reduce: none of the tensors holds a semiring_state on any "
            "process, so nothing was combined; run the backward first, inside "
            "semipack.extend(..., keep_state=True)",
            RuntimeWarning,
            stacklevel=2,
        )
    here = [hasattr(t, SEMIRING_STATE) for _, t in chosen]
    states = [_local_state(t, sr) for _, t in chosen]
    reducer = _reducer_for(sr)
    limit = max(1, int(bucket_mb * 2**20))
    for bucket in _buckets(states, limit):
        flat = tuple(
            torch.cat([states[i][c].reshape(-1) for i in bucket]) for c in range(len(sr.components))
        )
        reduced = reducer(sr, flat, g)
        offset = 0
        for i in bucket:
            name, t = chosen[i]
            n = t.numel()
            state = tuple(c[offset : offset + n].reshape(t.shape) for c in reduced.state)
            owners = None
            if reduced.owners is not None:
                owners = reduced.owners[:, offset : offset + n].reshape(-1, *t.shape)
            _store(t, name, sr, state, owners, g.rank, here[i])
            offset += n
    return [t for _, t in chosen]


def _named_tensors(tensors: nn.Module | Tensor | Iterable[Tensor]) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` for every distinct tensor to reduce, in order (parameter names for a
    module, ``tensor i`` otherwise)."""
    if isinstance(tensors, nn.Module):
        items = [(n, p) for n, p in tensors.named_parameters() if p.requires_grad]
    elif isinstance(tensors, Tensor):
        items = [("tensor 0", tensors)]
    else:
        items = [(f"tensor {i}", t) for i, t in enumerate(tensors)]
    seen: set[int] = set()
    out = []
    for name, t in items:
        if not isinstance(t, Tensor):
            raise TypeError(
                f"semipack.distributed.all_reduce expects a module or tensors, got {type(t)}"
            )
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _small_tensor_device(group: Any) -> torch.device:
    """Where the small bookkeeping tensors go: the current GPU for a NCCL-only group (NCCL
    reduces nothing else), the CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(named: Sequence[tuple[str, Tensor]], sr: Semiring, g: _Group, device) -> None:
    """Check, with one small all_gather, that every process reduces the same tensors (count,
    shapes, state dtypes) with the same semiring and kept every state it has; raise the same
    error on every process otherwise (a mismatch in a collective would hang or corrupt)."""
    problems = [_state_problem(name, t, sr) for name, t in named]
    problems = [p for p in problems if p is not None]
    layout = (
        ";".join(f"{tuple(t.shape)}{_dtypes(sr, t)}" for _, t in named)
        + f"|{type(sr).__module__}.{type(sr).__qualname__}{tuple(sr.components)}"
    )
    header = torch.tensor(
        [len(named), zlib.crc32(layout.encode()), len(problems)], dtype=torch.int64, device=device
    )
    table = torch.stack(g.all_gather(header)).tolist()
    failing = [r for r, row in enumerate(table) if row[2] > 0]
    if failing:
        mine = f" Here: {'; '.join(problems[:3])}." if problems else ""
        raise SemipackError(
            f"semipack.distributed.all_reduce: process(es) {failing} hold tensors whose "
            f"semiring state cannot be reduced.{mine}"
        )
    if any(row[:2] != table[0][:2] for row in table):
        counts = [row[0] for row in table]
        raise SemipackError(
            "semipack.distributed.all_reduce: the processes do not reduce the same tensors with "
            f"the same semiring (tensor counts per process: {counts}; shapes, dtypes or the "
            "semiring differ): pass the same model or tensors, in the same order, everywhere"
        )


def _dtypes(sr: Semiring, t: Tensor) -> tuple[torch.dtype, ...]:
    """The dtype of each state component of ``t`` (that of a message reaching it)."""
    return sr.component_dtypes(t.dtype)


def _state_problem(name: str, t: Tensor, sr: Semiring) -> str | None:
    """Why ``t``'s state cannot be reduced with ``sr``, or None."""
    state = getattr(t, SEMIRING_STATE, None)
    if state is None:
        if hasattr(t, SEMIRING_GRAD):
            return (
                f"{name} has a semiring_grad but no semiring_state: run the backward in "
                "semipack.extend(..., keep_state=True)"
            )
        return None
    if isinstance(state, ReducedState):
        return (
            f"{name} already holds the reduced state (a second all_reduce would count the "
            "other processes' paths again): run a new backward first"
        )
    made_by = getattr(state, "semiring_type", None)
    if made_by is not None and made_by is not type(sr):
        return (
            f"{name}'s state was kept by a pass of {made_by.__name__}, not of "
            f"{type(sr).__name__}: reduce it with the semiring of the pass that kept it"
        )
    if len(state) != len(sr.components):
        return f"{name}'s state has {len(state)} components, {sr!r} has {len(sr.components)}"
    for c, dtype in zip(state, _dtypes(sr, t), strict=True):
        if c.shape != t.shape or c.dtype != dtype:
            return (
                f"{name}'s state holds a {c.dtype} component of shape {list(c.shape)}, not "
                f"{dtype} {list(t.shape)} ({sr!r} and a tensor of dtype {t.dtype})"
            )
    return None


def _local_state(t: Tensor, sr: Semiring) -> State:
    """``t``'s kept state, or the zero (no path) where this process's backward missed it."""
    state = getattr(t, SEMIRING_STATE, None)
    if state is None:
        return sr.zeros(t.shape, t.dtype, t.device)
    return tuple(state)


def _buckets(states: Sequence[State], limit: int) -> list[list[int]]:
    """Indices of ``states`` grouped into buckets of at most ``limit`` bytes (a larger state
    alone) whose components share a dtype and device, in order of first appearance."""
    groups: dict[tuple, list[list[int]]] = {}
    sizes: dict[tuple, int] = {}
    for i, state in enumerate(states):
        key = (state[0].device, tuple(c.dtype for c in state))
        nbytes = state[0].numel() * sum(c.element_size() for c in state)
        buckets = groups.setdefault(key, [[]])
        if buckets[-1] and sizes[key] + nbytes > limit:
            buckets.append([])
            sizes[key] = 0
        buckets[-1].append(i)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [b for buckets in groups.values() for b in buckets]


def _store(
    t: Tensor,
    name: str,
    sr: Semiring,
    state: State,
    owners: Tensor | None,
    rank: int,
    reached_here: bool,
) -> None:
    """Write the reduced ``state`` to ``t``; after a path-recording pass, also paths that know
    which process recorded each of them (``reached_here``: this process's own pass reached
    ``t``, so its ``semiring_paths`` are that pass's)."""
    setattr(t, SEMIRING_STATE, ReducedState(state))
    setattr(t, SEMIRING_GRAD, sr.readout(state))
    if owners is None:
        return
    local = getattr(t, "semiring_paths", None)
    values, successors = sr.path_slots(state)
    if reached_here and isinstance(local, LeafPaths):
        trace, label = local.trace, local.name
    else:  # no local path reached it: every path with a value is another process's
        trace, label = PathTrace(), name
    t.semiring_paths = LeafPaths(
        trace, label, values.detach().clone(), successors.clone(), tuple(t.shape), owners, rank
    )


# --- reducers ------------------------------------------------------------------------------------
def _max(sr: Semiring, flat: State, g: _Group) -> _Reduced:
    """MaxProd's plus: the maximum of the log values."""
    return _Reduced((g.all_reduce(flat[0], dist.ReduceOp.MAX),))


def _extremes(sr: Semiring, flat: State, g: _Group) -> _Reduced:
    """SignedMaxProd's plus (max, max, min, min) as one MAX, the min components negated."""
    buf = torch.cat([flat[0], flat[1], flat[2].neg(), flat[3].neg()])
    g.all_reduce(buf, dist.ReduceOp.MAX)
    a, b, c, d = buf.chunk(4)
    return _Reduced((a, b, c.neg(), d.neg()))


def _any(sr: Semiring, flat: State, g: _Group) -> _Reduced:
    """Boolean's plus (or) as a MAX of bytes: collectives reduce no booleans."""
    as_bytes = (flat[0] != 0).to(torch.uint8)
    g.all_reduce(as_bytes, dist.ReduceOp.MAX)
    return _Reduced(((as_bytes != 0).to(flat[0].dtype),))


def _sum(sr: Semiring, flat: State, g: _Group) -> _Reduced:
    """Real's plus: the sum."""
    return _Reduced((g.all_reduce(flat[0], dist.ReduceOp.SUM),))


def _shifted_mass(log_values: Tensor, g: _Group) -> tuple[Tensor, Tensor]:
    """``(exp(log_values - peak), peak)`` with ``peak`` the largest finite log value over the
    processes (0 where none is finite): the shifted terms lie in [0, 1], one of them 1."""
    peak = g.all_reduce(log_values.clone(), dist.ReduceOp.MAX)
    peak = finite_or_zero(peak)
    return (log_values - peak).exp(), peak


def _log_sum_exp(sr: Semiring, flat: State, g: _Group) -> _Reduced:
    """LogSum's plus: ``peak + log Σ exp(x - peak)`` (NaN stays NaN, +inf stays +inf)."""
    mass, peak = _shifted_mass(flat[0], g)
    g.all_reduce(mass, dist.ReduceOp.SUM)
    return _Reduced((mass.log_().add_(peak),))


def _expectation(sr: Semiring, flat: State, g: _Group) -> _Reduced:
    """Entropy's plus: ``L = log Σ Z_p``, ``R = Σ Z_p R_p / Σ Z_p`` (0 where no path), with
    mass and weighted surprisal summed in one collective."""
    mass, peak = _shifted_mass(flat[0], g)
    both = torch.cat([mass, mass * flat[1]])
    g.all_reduce(both, dist.ReduceOp.SUM)
    total, weighted = both.chunk(2)
    mean = torch.where(total > 0, weighted / total, torch.zeros_like(total))
    return _Reduced((total.log().add_(peak), mean))


def _argmax(sr: Semiring, flat: State, g: _Group) -> _Reduced:
    """TopPath's plus: the best value, and the successor of the lowest-ranked process that has
    it (``NO_SUCCESSOR`` on the others: their traces do not hold that path)."""
    values, successors = flat
    best = g.all_reduce(values.clone(), dist.ReduceOp.MAX)
    holds = (values == best) | (values.isnan() & best.isnan())
    owner = torch.where(holds, g.rank, g.size).to(torch.int64)
    g.all_reduce(owner, dist.ReduceOp.MIN)
    owner.clamp_(max=g.size - 1)
    local = torch.where(owner == g.rank, successors, NO_SUCCESSOR)
    return _Reduced((best, local), owner[None])


def _gather_and_fold(sr: Semiring, flat: State, g: _Group) -> _Reduced:
    """Any semiring: gather every process's state (all components as bytes, one collective),
    then fold with ``sr.plus`` in rank order. A path-recording semiring's successor ids are
    tagged with their process first (``id * size + rank``), so the fold tells which process
    recorded each surviving path."""
    if sr.records_paths:
        _, successors = sr.path_slots(flat)
        flat = sr.with_successors(flat, successors * g.size + g.rank)
    parts = [c.contiguous().view(-1) for c in flat]
    raw = torch.cat([p.view(torch.uint8) for p in parts])
    sizes = [p.numel() * p.element_size() for p in parts]
    states = []
    for got in g.all_gather(raw):
        chunks = got.split(sizes)
        # a chunk can start at any byte (float32 parts before int64 ids): viewing it as a wider
        # dtype needs an aligned offset, so each chunk is copied to its own memory first
        states.append(tuple(b.clone().view(p.dtype) for b, p in zip(chunks, parts, strict=True)))
    result = states[0]
    for other in states[1:]:
        result = sr.plus(result, other)
    result = tuple(c.expand(flat[0].shape).contiguous() for c in result)
    if not sr.records_paths:
        return _Reduced(result)
    _, tagged = sr.path_slots(result)
    owners = tagged.remainder(g.size)
    ids = torch.div(tagged, g.size, rounding_mode="floor")
    local = torch.where(owners == g.rank, ids, NO_SUCCESSOR)
    return _Reduced(sr.with_successors(result, local), owners)


def _per_factor(sr: Semiring, flat: State, g: _Group) -> _Reduced:
    """A ``Product``: each factor's slice of the bucket with that factor's own collective form
    (its components are the factor's, side by side)."""
    reduced = [
        _reducer_for(factor)(factor, part, g).state
        for factor, part in zip(sr.semirings, sr.split(flat), strict=True)
    ]
    return _Reduced(sr.join(reduced))


#: The collective form of each built-in semiring's plus. A subclass keeps its parent's form only
#: while it keeps the parent's ``plus`` and components (``_reducer_for``).
_REDUCERS: dict[type[Semiring], Reducer] = {
    TopPath: _argmax,
    MaxProd: _max,
    SignedMaxProd: _extremes,
    Boolean: _any,
    LogSum: _log_sum_exp,
    Entropy: _expectation,
    Real: _sum,
}


def _reducer_for(sr: Semiring) -> Reducer:
    """The collective form of ``sr``'s plus: that of the nearest registered class it derives
    from, if it has that class's ``plus`` and components; else gather-and-fold."""
    cls = type(sr)
    if cls is Product:
        return _per_factor
    for base in cls.__mro__:
        reducer = _REDUCERS.get(base)
        if reducer is None:
            continue
        same_plus = cls.plus is base.plus
        same_components = tuple(sr.components) == tuple(base.components)
        return reducer if same_plus and same_components else _gather_and_fold
    return _gather_and_fold


__all__ = ["BUCKET_MB", "ReducedState", "all_reduce"]
