"""Max-plus and min-plus matrix products: the inner loop of MaxProd and SignedMaxProd matmuls.

``maxplus(a, b)[..., i, j] = max_k a[..., i, k] + b[..., k, j]`` is a matmul in the tropical
semiring. BLAS cannot do it, and the generic broadcast-then-reduce of ``blocked_matmul`` writes
every pair to memory, so this module hands inductor a formulation it turns into a fast CPU loop:

* the reduced dim ``k`` is contiguous in both operands (``b`` is transposed once), so the
  innermost loop is a vectorised add + max over ``k``;
* output rows are tiled by ``ROW_TILE``: each output row of a tile is its own reduction over the
  same ``b`` row, inductor fuses them into one loop and loads ``b`` once per tile; the
  independent accumulators also hide the latency of the NaN-propagating max;
* output columns are blocked so that one block of ``b`` (``COL_BLOCK_BYTES``) stays in L2 while
  every row of ``a`` streams past it.

Small problems, non-float32/64 dtypes, autograd inputs and ``set_compile(False)`` take an eager
fallback that broadcasts and reduces bounded blocks (at most ``EAGER_BLOCK_ELEMENTS`` pairs at
once). Both paths compute every pair sum with the same single rounding and take an exact max, so
their values agree bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

from .blocking import BLOCK_ELEMENTS
from .compiled import compile_enabled, compiled
from .native import (
    MAX_INDEX_K,
    PRUNE_TOP,
    maxplus_f32,
    maxplus_pruned_counts_f32,
    maxplus_pruned_f32,
    native_available,
)
from .shapes import broadcast_shapes
from .weight_cache import WEIGHTS, no_nan_or_posinf_kept

#: Output rows per register tile of the compiled kernel. On a Zen 3 core (AVX2) 4 rows ran at
#: 15 G pairs/s vs 9.7 untiled; 8 rows tied, 16 spilled registers, tiling columns too was slower.
ROW_TILE = 4
#: Bytes of ``b`` per column block, sized to stay in a 512 KiB L2 next to the ``a`` tile.
COL_BLOCK_BYTES = 384 * 1024
#: Problems with fewer pairs (``batch * n * k * m``) than this stay eager: below it the guard
#: checks and padding of the compiled call cost more than they save, and tiny test matrices
#: never trigger a compilation.
COMPILE_MIN_PAIRS = 1 << 19
#: Problems with fewer pairs than this skip the hand-written kernel (its operand checks and
#: panel packing cost more than a small broadcast).
NATIVE_MIN_PAIRS = 1 << 14
#: Single products at least this large (pairs) and deep (``k``) try the pruned native kernel,
#: which pays when max-product messages are spread over orders of magnitude, as they are.
#: Smaller ones run dense without an estimate: products of few rows gain little from pruning,
#: and the estimate (``kept_fraction`` in one or both orientations) is a fixed cost beside them.
#: Measured single-thread on the 2-core VM of BENCHMARKS.md with MiniLM's messages for one
#: 20-token sentence, with the eager estimate of then: [20, 1536] x [1536, 384] ran 1.02 ms
#: pruned (31% kept) against 1.04 dense after a 0.33 ms estimate, and [20, 384] x
#: [384, 1536] took a 0.93 ms estimate to choose dense (0.92 ms); with eight
#: sentences (136 rows) both estimates chose dense too. A BERT layer's products over 1024 rows
#: (6e8 to 2.4e9 pairs) keep 3-15% in their better orientation and run 2-4x faster pruned.
PRUNE_MIN_PAIRS = 1 << 27
PRUNE_MIN_K = 64
#: Rows sampled to estimate the share the pruned kernel keeps, and the share above which the
#: dense kernel runs instead (the pruned one has per-row costs the dense one does not).
PRUNE_SAMPLE_ROWS = 8
PRUNE_MAX_KEPT = 0.5
#: An orientation is pruned only with at least this many output columns. The pruned kernel
#: scans every (row, k) pair for its bound and candidates, a few ns each, and only a kept k's
#: sweep over many columns repays that: measured single-thread on the 2-core VM of
#: BENCHMARKS.md, a [64, 32768] x [32768, 64] weight message of a convolution ran 7.9 ms pruned
#: (6% kept) against 6.7 ms dense, a depthwise [72, 6272] x [6272, 16] one 2.5 ms (3% kept)
#: against 0.3 ms, while Linear's [1024, 3072] x [3072, 768] ran 27 ms (3% kept) against 92 ms.
PRUNE_MIN_COLS = 256
#: An orientation's share is estimated only where the estimate costs at most this share of the
#: dense product: it reads ``PRUNE_TOP`` candidates of ``PRUNE_SAMPLE_ROWS`` rows over every
#: column, so for a product of few rows and a short ``k`` it costs a good part of the product
#: itself (a Linear(16, 72) input message over 6272 rows, [6272, 72] x [72, 16], took 1.8 ms
#: with the estimate and 0.24 ms dense, single-thread).
PRUNE_ESTIMATE_SHARE = 1 / 16
#: Pairs broadcast at once by the eager fallback: 4 MiB of float32 keeps the temporary in cache;
#: measured 3.1 G pairs/s per core vs 0.46 with the full ``BLOCK_ELEMENTS`` (32 MiB).
EAGER_BLOCK_ELEMENTS = min(BLOCK_ELEMENTS, 1 << 20)

#: Per thread: the open ``shared_pruning_choice`` scope's choices, by operand shapes (None: no
#: scope, every product estimates its own).
_choices = threading.local()


@contextlib.contextmanager
def shared_pruning_choice() -> Iterator[None]:
    """Within the block, products with the same operand shapes reuse the first one's choice
    of pruned orientation or dense kernel instead of estimating their own.

    A convolution's kernel taps are nine (or 25, ...) products of the same shapes over nearly
    the same data; estimating each (``kept_fraction`` in both orientations) cost about a fifth
    of ResNet-18's MaxProd backward. The choice only decides speed: every orientation and the
    dense kernel give the same exact values.
    """
    outer = getattr(_choices, "table", None)
    _choices.table = {} if outer is None else outer
    try:
        yield
    finally:
        _choices.table = outer


_COMPILED_DTYPES = (torch.float32, torch.float64)
_INF = float("inf")


# --- public API --------------------------------------------------------------------------------
def maxplus(a: Tensor, b: Tensor) -> Tensor:
    """``out[..., i, j] = max_k a[..., i, k] + b[..., k, j]`` with ``torch.matmul`` batching.

    ``-inf`` entries mean "no edge": an output with no finite pair is ``-inf`` (also for
    ``k == 0``). Inputs are promoted to a common floating dtype. Not differentiable through the
    compiled path: inputs that require grad (with grad mode on) use the eager one.
    """
    return _tropical(a, b, with_index=False)[0]


def maxplus_argmax(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``maxplus(a, b)`` and the int64 ``k`` attaining each max (its first index on ties).

    An output with no finite pair (all pair sums ``-inf``, or ``k == 0``) gets index 0. Where an
    output is NaN the index is unspecified.
    """
    values, index = _tropical(a, b, with_index=True)
    assert index is not None
    return values, index


# --- shape normalisation -----------------------------------------------------------------------
def _tropical(a: Tensor, b: Tensor, with_index: bool) -> tuple[Tensor, Tensor | None]:
    """Check shapes, fold batch dims into a [S, N, k] x [S, M, k] problem, run it, unfold."""
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(
            f"maxplus needs matrices, got shapes {tuple(a.shape)} and {tuple(b.shape)}"
        )
    n, k = a.shape[-2:]
    k_b, m = b.shape[-2:]
    if k != k_b:
        raise ValueError(f"maxplus: inner sizes differ, {tuple(a.shape)} x {tuple(b.shape)}")
    dtype = torch.promote_types(a.dtype, b.dtype)
    if not dtype.is_floating_point:
        dtype = torch.promote_types(dtype, torch.float32)
    a, bt = a.to(dtype), b.to(dtype).transpose(-1, -2)
    # Fast paths first: calls on small matrices are dominated by this bookkeeping.
    if a.shape[:-2] == b.shape[:-2]:
        size = math.prod(a.shape[:-2])
        a3, bt3 = a.reshape(size, n, k), bt.reshape(size, m, k)
    elif b.dim() == 2:  # a batch of messages times one matrix: the batch is just more rows
        a3, bt3 = a.reshape(1, math.prod(a.shape[:-1]), k), bt[None]
    else:
        return _tropical_broadcast(a, bt, with_index)
    values, index = _tropical3(a3, bt3, with_index)
    shape = (*a.shape[:-2], n, m)
    return values.reshape(shape), None if index is None else index.reshape(shape)


def _tropical_broadcast(a: Tensor, bt: Tensor, with_index: bool) -> tuple[Tensor, Tensor | None]:
    """Batch dims where only ``a`` varies become extra rows, those where only ``b`` varies extra
    columns; only dims where both vary stay a batch dim. No broadcast is materialised."""
    n, k = a.shape[-2:]
    m = bt.shape[-2]
    batch = broadcast_shapes(a.shape[:-2], bt.shape[:-2])
    nb = len(batch)
    a = a.reshape((1,) * (nb + 2 - a.dim()) + tuple(a.shape))
    bt = bt.reshape((1,) * (nb + 2 - bt.dim()) + tuple(bt.shape))
    shared = [d for d in range(nb) if a.shape[d] == bt.shape[d]]
    rows_only = [d for d in range(nb) if d not in shared and bt.shape[d] == 1]
    cols_only = [d for d in range(nb) if d not in shared and a.shape[d] == 1]
    size = math.prod(batch[d] for d in shared)
    rows = math.prod(batch[d] for d in rows_only) * n
    cols = math.prod(batch[d] for d in cols_only) * m
    a3 = a.permute(*shared, *rows_only, *cols_only, nb, nb + 1).reshape(size, rows, k)
    bt3 = bt.permute(*shared, *cols_only, *rows_only, nb, nb + 1).reshape(size, cols, k)
    a3, bt3 = a3.contiguous(), bt3.contiguous()

    values, index = _tropical3(a3, bt3, with_index)

    # [S, R*n, C*m] -> [*shared, *rows_only, n, *cols_only, m] -> the batch order.
    unfolded = (
        *(batch[d] for d in shared),
        *(batch[d] for d in rows_only),
        n,
        *(batch[d] for d in cols_only),
        m,
    )
    order = [*shared, *rows_only, nb, *cols_only, nb + 1]
    inverse = [order.index(d) for d in range(nb + 2)]

    def unfold(t: Tensor) -> Tensor:
        return t.reshape(unfolded).permute(inverse).contiguous()

    return unfold(values), None if index is None else unfold(index)


# --- dispatch on the canonical [S, n, k] x [S, m, k] layout --------------------------------------
def _tropical3(a3: Tensor, bt3: Tensor, with_index: bool) -> tuple[Tensor, Tensor | None]:
    """Run the canonical problem natively or compiled when it pays, else eagerly."""
    s, n, k = a3.shape
    m = bt3.shape[1]
    if n == 0 or m == 0 or k == 0 or s == 0:
        values = a3.new_full((s, n, m), -_INF)
        index = torch.zeros((s, n, m), dtype=torch.int64, device=a3.device)
        return values, index if with_index else None
    if _use_native(a3, bt3):
        # Phase 1 alone keeps PRUNE_TOP of the k candidates per row: below 2 * PRUNE_TOP the
        # pruned kernel cannot keep under PRUNE_MAX_KEPT, so the estimate is not worth its cost.
        prunable = k >= PRUNE_MIN_K and PRUNE_MAX_KEPT * k > PRUNE_TOP
        if s == 1 and n * k * m >= PRUNE_MIN_PAIRS and prunable:
            values, index = _maxplus_pruned(a3[0], bt3[0].t(), with_index)
            return values[None], None if index is None else index[None]
        return maxplus_f32(a3, bt3.transpose(1, 2), with_index, memo=WEIGHTS.kept_form)
    a3, bt3 = a3.contiguous(), bt3.contiguous()
    if _use_compiled(a3, bt3):
        return _tiled(a3, bt3, with_index)
    return _eager3(a3, bt3, with_index)


def _use_native(a3: Tensor, bt3: Tensor) -> bool:
    """The hand-written kernel takes float32 CPU problems without NaN or ``+inf`` inputs (its
    max does not propagate NaN); a reduction over each operand checks that."""
    s, n, k = a3.shape
    needs_grad = torch.is_grad_enabled() and (a3.requires_grad or bt3.requires_grad)
    return (
        a3.dtype == torch.float32
        and a3.device.type == "cpu"
        and not needs_grad
        and s * n * k * bt3.shape[1] >= NATIVE_MIN_PAIRS
        and k < MAX_INDEX_K
        and native_available()
        and no_nan_or_posinf_kept(a3, bt3)
    )


def kept_fraction(a: Tensor, b: Tensor, rows: int = PRUNE_SAMPLE_ROWS) -> float:
    """Estimated share of ``k`` the pruned kernel keeps for ``a @ b`` (its phase-1 and phase-2
    candidates), counted by the kernel's own bounds on a few evenly spaced rows of ``a``
    (``maxplus_pruned_counts_f32``: no product is computed, ``b`` is read where it lies)."""
    n, k = a.shape
    picked = torch.linspace(0, n - 1, min(rows, n), device=a.device).long()
    # Rows of a transposed operand are strided: gather them along its contiguous dim instead
    # (one pass over memory rather than a cache miss per entry).
    sample = a[picked] if a.stride(-1) == 1 else a.t().index_select(1, picked).t()
    bound = WEIGHTS.kept_form(b, "row_max", lambda: b.amax(1).contiguous())
    kept, first = maxplus_pruned_counts_f32(sample, b, bound)
    return (kept + first) / (sample.shape[0] * k)


def _estimate_pays(rows: int, k: int) -> bool:
    """Whether ``kept_fraction`` over an orientation with ``rows`` output rows and inner size
    ``k`` costs at most ``PRUNE_ESTIMATE_SHARE`` of the dense product (per column swept: the
    sample's ``PRUNE_TOP`` candidates per sampled row against every row's ``k``)."""
    return min(PRUNE_SAMPLE_ROWS, rows) * PRUNE_TOP <= PRUNE_ESTIMATE_SHARE * rows * k


def _maxplus_pruned(a: Tensor, b: Tensor, with_index: bool) -> tuple[Tensor, Tensor | None]:
    """One [n, k] x [k, m] product: pruned in the orientation that keeps fewer candidates
    (``out.T = b.T (x) a.T`` prunes over the other operand's rows), dense if neither pays."""
    table = getattr(_choices, "table", None)
    key = (tuple(a.shape), tuple(b.shape))
    choice = None if table is None else table.get(key)
    if choice is None:
        # out = a (x) b sweeps b's m columns per kept k; out.T = b.T (x) a.T sweeps a's n rows
        (rows, k), cols = a.shape, b.shape[1]
        direct = _INF
        if cols >= PRUNE_MIN_COLS and _estimate_pays(rows, k):
            direct = kept_fraction(a, b)
        transposed = _INF
        if rows >= PRUNE_MIN_COLS and _estimate_pays(cols, k):
            transposed = kept_fraction(b.t(), a.t())
        if min(direct, transposed) > PRUNE_MAX_KEPT:
            choice = "dense"
        else:
            choice = "direct" if direct <= transposed else "transposed"
        if table is not None:
            table[key] = choice
    if choice == "dense":
        values, index = maxplus_f32(a[None], b[None], with_index, memo=WEIGHTS.kept_form)
        return values[0], None if index is None else index[0]
    if choice == "direct":
        values, index, _ = maxplus_pruned_f32(a, b, with_index, memo=WEIGHTS.kept_form)
        return values, index
    values, index, _ = maxplus_pruned_f32(b.t(), a.t(), with_index, memo=WEIGHTS.kept_form)
    return values.t().contiguous(), None if index is None else index.t().contiguous()


def _use_compiled(a3: Tensor, bt3: Tensor) -> bool:
    s, n, k = a3.shape
    m = bt3.shape[1]
    needs_grad = torch.is_grad_enabled() and (a3.requires_grad or bt3.requires_grad)
    return (
        compile_enabled()
        and not needs_grad
        and a3.dtype in _COMPILED_DTYPES
        and k >= 2  # k == 1 would specialise a new graph; it is a plain outer sum anyway
        and k < (1 << 24)  # indices are carried as floats in the argmax pass
        and s * n * k * m >= COMPILE_MIN_PAIRS
    )


def _eager3(a3: Tensor, bt3: Tensor, with_index: bool) -> tuple[Tensor, Tensor | None]:
    """Broadcast-then-reduce over blocks of at most ``EAGER_BLOCK_ELEMENTS`` pairs."""
    s, n, k = a3.shape
    m = bt3.shape[1]
    if s * n * m * k <= EAGER_BLOCK_ELEMENTS:  # one block: skip the loop bookkeeping
        pairs = a3[:, :, None, :] + bt3[:, None, :, :]
        if not with_index:
            return pairs.amax(-1), None
        found = pairs.max(-1)
        return found.values, found.indices
    values = a3.new_empty((s, n, m))
    index = torch.empty((s, n, m), dtype=torch.int64, device=a3.device) if with_index else None
    cols = max(1, min(m, EAGER_BLOCK_ELEMENTS // k))
    rows = max(1, min(n, EAGER_BLOCK_ELEMENTS // (k * cols)))
    mats = max(1, min(s, EAGER_BLOCK_ELEMENTS // (k * cols * rows)))
    for s0 in range(0, s, mats):
        for r0 in range(0, n, rows):
            a_blk = a3[s0 : s0 + mats, r0 : r0 + rows, None, :]
            for c0 in range(0, m, cols):
                pairs = a_blk + bt3[s0 : s0 + mats, None, c0 : c0 + cols, :]
                where = (slice(s0, s0 + mats), slice(r0, r0 + rows), slice(c0, c0 + cols))
                if index is None:
                    values[where] = pairs.amax(-1)
                else:
                    values[where], index[where] = pairs.max(-1)
    return values, index


# --- compiled, tiled kernels -------------------------------------------------------------------
def _tiled(a3: Tensor, bt3: Tensor, with_index: bool) -> tuple[Tensor, Tensor | None]:
    """Pad to whole tiles with ``-inf`` (rows and columns that are cut off again) and run.

    Every size handed to the compiled graph is >= 2, so dynamo's 0/1 specialisation only ever
    splits graphs on the batch size (1 or more) and the dtype: at most 4 graphs per kernel.
    """
    s, n, k = a3.shape
    m = bt3.shape[1]
    row_groups = max(2, -(-n // ROW_TILE))
    col_cap = max(16, COL_BLOCK_BYTES // (k * a3.element_size()))
    col_blocks = max(2, -(-m // col_cap))
    block_cols = max(2, -(-m // col_blocks))
    a4 = _pad_rows(a3, row_groups * ROW_TILE).view(s, row_groups, ROW_TILE, k)
    b4 = _pad_rows(bt3, col_blocks * block_cols).view(s, col_blocks, block_cols, k)
    if with_index:
        iota = torch.arange(k, dtype=a3.dtype, device=a3.device)
        values, index = _maxplus_argmax_kernel(a4, b4, iota)
        return values[:, :n, :m], index[:, :n, :m]
    return _maxplus_kernel(a4, b4)[:, :n, :m], None


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` [S, r, k] with ``-inf`` rows appended up to ``rows``."""
    missing = rows - x.shape[1]
    if missing == 0:
        return x
    return torch.cat([x, x.new_full((x.shape[0], missing, x.shape[2]), -_INF)], 1)


def _tile_pairs(a4: Tensor, b4: Tensor, r: int) -> Tensor:
    """Pair sums of tile row ``r`` with every column: [S, col_blocks, row_groups, cols, k]."""
    return a4[:, None, :, None, r, :] + b4[:, :, None, :, :]


def _untile(parts: list[Tensor]) -> Tensor:
    """ROW_TILE tensors [S, col_blocks, row_groups, cols] -> [S, row_groups*ROW_TILE, all cols]."""
    t = torch.stack(parts, -1)
    s, col_blocks, row_groups, cols = t.shape[:4]
    return t.permute(0, 2, 4, 1, 3).reshape(s, row_groups * ROW_TILE, col_blocks * cols)


def _flat_operands(a4: Tensor, b4: Tensor) -> tuple[Tensor, Tensor]:
    return a4.reshape(a4.shape[0], -1, a4.shape[-1]), b4.reshape(b4.shape[0], -1, b4.shape[-1])


def _maxplus_tiled_eager(a4: Tensor, b4: Tensor) -> Tensor:
    """Reference for the fused kernel (also its fallback): the eager blocked product."""
    return _eager3(*_flat_operands(a4, b4), with_index=False)[0]


def _maxplus_tiled_fused(a4: Tensor, b4: Tensor) -> Tensor:
    """What inductor compiles: ROW_TILE reductions over the same column block, fused."""
    if not torch.compiler.is_compiling():  # run uncompiled (e.g. recompile limit): stay bounded
        return _maxplus_tiled_eager(a4, b4)
    return _untile([_tile_pairs(a4, b4, r).amax(-1) for r in range(ROW_TILE)])


def _maxplus_argmax_tiled_eager(a4: Tensor, b4: Tensor, iota: Tensor) -> tuple[Tensor, Tensor]:
    values, index = _eager3(*_flat_operands(a4, b4), with_index=True)
    assert index is not None
    return values, index


def _maxplus_argmax_tiled_fused(a4: Tensor, b4: Tensor, iota: Tensor) -> tuple[Tensor, Tensor]:
    """Values first, then the first ``k`` whose pair sum equals the value.

    Inductor's own fused max/argmax reduction ran ~5x slower than values + this second pass.
    The index is the min over ``k`` of ``iota`` (a float copy of ``arange(k)``, loaded like the
    operands; an in-graph int arange is built lane by lane and made the whole call 1.75x slower)
    masked to the hits. A pair sum is recomputed with the same rounding, so the hit is exact; no
    hit (a NaN value) gives index 0.
    """
    if not torch.compiler.is_compiling():
        return _maxplus_argmax_tiled_eager(a4, b4, iota)
    values, firsts = [], []
    for r in range(ROW_TILE):
        values.append(_tile_pairs(a4, b4, r).amax(-1))
    for r in range(ROW_TILE):
        hit = _tile_pairs(a4, b4, r) == values[r][..., None]
        first = torch.where(hit, iota, _INF).amin(-1)
        firsts.append(torch.where(first < _INF, first, 0.0))
    return _untile(values), _untile(firsts).to(torch.int64)


_maxplus_kernel = compiled(_maxplus_tiled_eager, _maxplus_tiled_fused)
_maxplus_argmax_kernel = compiled(_maxplus_argmax_tiled_eager, _maxplus_argmax_tiled_fused)
