"""KBest: the k best single paths and their values, each path readable afterwards.

The state of an entry is its k best path products, as logs sorted from best to worst (``-inf``
where fewer than k paths exist), and for each of them the id of its *successor slot*: the
(downstream scalar node, rank in that node's list) the path continues with towards the root.
Plus merges two sorted lists and keeps the k best, sums and matmuls keep the k best over the
union of their candidates, and multiplying by an edge weight adds its log to every value and
keeps the successors. Ties keep the order of the candidates (the first operand first).

The state is the tuple of 2k same-shaped components ``log_value0 .. log_value{k-1}``,
``successor0 .. successor{k-1}``, so every generic message computation (structural ops,
``index_plus``, ``prefix_plus``, dense Jacobians) applies to it unchanged. As for TopPath, the
backward pass re-labels every tensor's slots with fresh ids after recording their successors
(``semipack.messages.paths``), so following successors from a leaf entry's r-th slot walks its
r-th best path up to the root.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..kernels.blocking import BLOCK_ELEMENTS
from ..kernels.shapes import broadcast_shapes
from ._log import kept_log_abs, log_abs
from .base import Semiring, Sign, State, checked_flag
from .top_path import NO_SUCCESSOR, stored_paths


class KBest(Semiring):
    """The k best paths of every entry (k-best max-product, in log space).

    ``readout`` gives, per entry, the k best products of |local derivatives| along single paths,
    best first, in a trailing dim of size k: ``semiring_grad`` has shape ``[*leaf.shape, k]``
    (0 where fewer than k paths exist; ``log=True``: their logs, ``-inf`` there). ``[..., 0]`` is
    MaxProd's value. After a backward, ``paths(leaf, index)`` returns those paths themselves.
    """

    records_paths = True

    def __init__(self, k: int = 2, log: bool = False) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"KBest needs a positive integer k, got {k!r}")
        self.k = k
        self.log = checked_flag(log, "KBest", "log")
        self.components = tuple(f"log_value{r}" for r in range(k)) + tuple(
            f"successor{r}" for r in range(k)
        )
        self.zero = (-math.inf,) * k + (NO_SUCCESSOR,) * k
        self.one = (0.0,) + (-math.inf,) * (k - 1) + (NO_SUCCESSOR,) * k

    def __repr__(self) -> str:
        return f"KBest(k={self.k}, log={self.log})"

    def component_dtypes(self, grad_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (self.state_dtype(grad_dtype),) * self.k + (torch.int64,) * self.k

    # --- the state as [..., k] value and successor tensors --------------------------------------
    def _stacked(self, a: State) -> tuple[Tensor, Tensor]:
        """Values and successors of ``a`` as two [..., k] tensors of one shape."""
        parts = torch.broadcast_tensors(*a)
        return torch.stack(parts[: self.k], -1), torch.stack(parts[self.k :], -1)

    def _state(self, values: Tensor, successors: Tensor) -> State:
        successors = successors.expand(values.shape)
        return tuple(values.unbind(-1)) + tuple(successors.unbind(-1))

    def _ranked(self, best: Tensor, successors: Tensor) -> State:
        """The state of k ranked candidates; a slot without a path (``-inf``) has no successor,
        whichever candidate filled it."""
        return self._state(best, torch.where(best == -math.inf, NO_SUCCESSOR, successors))

    def _best(self, values: Tensor, successors: Tensor, owned: bool = False) -> State:
        """The k best of the candidates along the last dim (ties: the first candidate first).
        ``owned``: ``values`` is a fresh tensor the caller gives up (it may be overwritten)."""
        successors = successors.expand(values.shape)
        n = values.shape[-1]
        if n < self.k:
            pad = (*values.shape[:-1], self.k - n)
            values = torch.cat([values, values.new_full(pad, -math.inf)], -1)
            successors = torch.cat([successors, successors.new_full(pad, NO_SUCCESSOR)], -1)
        if n <= 4 * self.k:  # few candidates: one stable sort
            best, order = torch.sort(values, dim=-1, descending=True, stable=True)
            best, order = best[..., : self.k], order[..., : self.k]
            return self._ranked(best, successors.gather(-1, order))
        # many candidates (a matmul's inner size times k): O(n k) instead of O(n log n) per
        # output (the sort was 80% of a sentence's KBest backward)
        best, order = _first_maxima(values if owned else values.clone(), self.k)
        return self._ranked(best, successors.gather(-1, order))

    # --- the primitives -------------------------------------------------------------------------
    def _single(self, value: Tensor) -> State:
        """One path per entry with log-value ``value`` and no successor (an edge weight)."""
        none = torch.full(value.shape, -math.inf, dtype=value.dtype, device=value.device)
        ids = torch.full(value.shape, NO_SUCCESSOR, dtype=torch.int64, device=value.device)
        return (value,) + tuple(none.clone() for _ in range(self.k - 1)) + (ids,) * self.k

    def lift(self, w: Tensor) -> State:
        return self._single(log_abs(w, self.state_dtype(w.dtype)))

    def plus(self, a: State, b: State) -> State:
        va, sa = self._stacked(a)
        vb, sb = self._stacked(b)
        va, vb = torch.broadcast_tensors(va, vb)
        sa, sb = sa.expand(va.shape), sb.expand(vb.shape)
        return self._best(torch.cat([va, vb], -1), torch.cat([sa, sb], -1))

    def times(self, a: State, b: State) -> State:
        # every pair of a path of ``a`` and a path of ``b``; one operand is an edge weight (no
        # successor of its own), so the pair keeps the other's successor
        va, sa = self._stacked(a)
        vb, sb = self._stacked(b)
        values = va[..., :, None] + vb[..., None, :]
        ids = torch.maximum(sa[..., :, None], sb[..., None, :])
        flat = (*values.shape[:-2], self.k * self.k)
        return self._best(values.reshape(flat), ids.expand(values.shape).reshape(flat))

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        values, ids = self._stacked(a)
        ndim = values.dim() - 1
        kept = [d for d in range(ndim) if d not in dims]
        order = [*kept, *dims, ndim]
        values = values.permute(order).flatten(len(kept))
        ids = ids.permute(order).flatten(len(kept))
        out = self._best(values, ids)
        if keepdim:
            shape = [1 if d in dims else s for d, s in enumerate(a[0].shape)]
            out = tuple(c.reshape(shape) for c in out)
        return out

    def readout(self, a: State) -> Tensor:
        values, _ = self._stacked(a)
        return values if self.log else values.exp()

    # --- derived operations ---------------------------------------------------------------------
    def is_zero(self, a: State) -> Tensor:
        return a[0] == -math.inf

    def scale(self, a: State, w: Tensor) -> State:
        return self.scale_log(a, log_abs(w, a[0].dtype))

    def lift_log(self, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return self._single(log_abs.to(self.state_dtype(log_abs.dtype)))

    def scale_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        values = tuple(v + log_abs for v in a[: self.k])
        return values + tuple(s.expand(values[0].shape) for s in a[self.k :])

    def uses_edge_signs(self) -> bool:
        return False

    def lift_is_multiplicative(self) -> bool:
        return True  # an edge is one path of log-value log|w|: log|ab| = log|a| + log|b|

    def exclusive_plus(self, a: State) -> State | None:
        # the k best paths of the other entries of a row, for softmax rows in O(n k): removing
        # one entry removes at most its k paths, so they are among the row's 2k best, ranked
        # once (first candidates first, entry i's r-th path at i * k + r)
        values, ids = self._stacked(a)  # [rows, n, k]
        rows, n, k = values.shape
        flat_values, flat_ids = values.reshape(rows, n * k), ids.reshape(rows, n * k)
        owner = torch.arange(n, device=values.device).repeat_interleave(k)
        top_values, at = _first_maxima(flat_values.clone(), min(2 * k, n * k))  # best first
        top_ids = flat_ids.gather(-1, at)  # [rows, top]
        others = owner[at][:, None, :] != torch.arange(n, device=values.device)[None, :, None]
        place = others.cumsum(-1)  # [rows, n, top]: 1 for the first candidate kept, ...
        best = values.new_full((rows, n, k), -math.inf)
        chosen = torch.full((rows, n, k), NO_SUCCESSOR, dtype=ids.dtype, device=ids.device)
        for r in range(min(k, at.shape[-1])):
            slot = others & (place == r + 1)  # at most one candidate per output
            found = slot.any(-1)
            where = slot.to(torch.uint8).argmax(-1, keepdim=True)  # [rows, n, 1]
            best[..., r] = torch.where(
                found, top_values[:, None, :].expand_as(slot).gather(-1, where)[..., 0], -math.inf
            )
            chosen[..., r] = top_ids[:, None, :].expand_as(slot).gather(-1, where)[..., 0]
        return self._ranked(best, chosen)

    def matmul(self, a: State, w: Tensor) -> State:
        return self._products(a, kept_log_abs(w, a[0].dtype))

    def matmul_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return self._products(a, log_abs.to(a[0].dtype))

    def _products(self, a: State, log_w: Tensor) -> State:
        """``out[..., i, j]`` = the k best of ``a[..., i, l]``'s paths times ``w[..., l, j]``
        over every l, in blocks of rows and columns of at most ``BLOCK_ELEMENTS`` candidates."""
        values, ids = self._stacked(a)  # [..., n, L, k]
        n, inner = values.shape[-3], values.shape[-2]
        m = log_w.shape[-1]
        batch = broadcast_shapes(values.shape[:-3], log_w.shape[:-2])
        if n == 0 or m == 0:
            return self.zeros((*batch, n, m), log_w.dtype, log_w.device)
        values = values.expand(*batch, n, inner, self.k)
        ids = ids.expand(*batch, n, inner, self.k)
        log_w = log_w.expand(*batch, inner, m)
        per_column = max(1, math.prod(batch) * inner * self.k)  # candidates of one output
        if per_column * m <= BLOCK_ELEMENTS:
            rows, cols = max(1, BLOCK_ELEMENTS // (per_column * m)), m
        else:
            rows, cols = 1, max(1, BLOCK_ELEMENTS // per_column)
        log_w_t = log_w.transpose(-1, -2)  # [..., m, L]
        out_rows = []
        for r0 in range(0, n, rows):
            v_blk = values[..., r0 : r0 + rows, None, :, :]  # [..., rows, 1, L, k]
            i_blk = ids[..., r0 : r0 + rows, None, :, :].flatten(-2)  # [..., rows, 1, L*k]
            out_cols = []
            for c0 in range(0, m, cols):
                w_blk = log_w_t[..., None, c0 : c0 + cols, :, None]  # [..., 1, cols, L, 1]
                # written straight into a [rows, cols, L, k] layout: candidate l*k + r, and
                # flattening is a view (a plain add follows the inputs' strides, and the
                # flatten then copied every candidate once more)
                shape = broadcast_shapes(v_blk.shape, w_blk.shape)
                cand = torch.add(v_blk, w_blk, out=v_blk.new_empty(shape)).flatten(-2)
                out_cols.append(self._best(cand, i_blk.expand(cand.shape), owned=True))
            out_rows.append(tuple(torch.cat(p, -1) for p in zip(*out_cols, strict=True)))
        return tuple(torch.cat(p, -2) for p in zip(*out_rows, strict=True))

    # --- path recording (see ``semipack.messages.paths``) ---------------------------------------
    def path_slots(self, a: State) -> tuple[Tensor, Tensor]:
        values, ids = self._stacked(a)
        return values.movedim(-1, 0), ids.movedim(-1, 0)

    def with_successors(self, a: State, ids: Tensor) -> State:
        return tuple(a[: self.k]) + tuple(ids.unbind(0))

    def paths(self, leaf: Tensor, index: tuple[int, ...] | int | None = None) -> list:
        """The k best paths from ``leaf[index]`` (default: the leaf's best entry) to the root of
        the last KBest backward that reached ``leaf``, best first (fewer where fewer paths
        exist). Each is a ``Path`` like ``TopPath.path`` returns; ``paths[r].value`` is
        ``leaf.semiring_grad[index][r]``."""
        return stored_paths(leaf, "paths", KBest).paths(index)


def _first_maxima(work: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` largest entries along the last dim and their positions, best first, ties
    in the order of the entries (a stable descending sort's first ``count``): ``count`` passes
    of a first-occurrence max, each taking its winner out of ``work``, which is overwritten."""
    values, picks = [], []
    for _ in range(count):
        value, at = work.max(-1, keepdim=True)
        values.append(value)
        picks.append(at)
        work.scatter_(-1, at, -math.inf)
    return torch.cat(values, -1), torch.cat(picks, -1)
