"""SignedMaxProd: the largest and the smallest signed path products, in log space."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..kernels.exclusive import exclusive_max, exclusive_min
from ..kernels.normalization import SIGNED, CentredPairsKernel
from ..kernels.tropical import maxplus
from ._log import log_abs
from .base import Semiring, Sign, State, checked_flag, index_reduce, uses_methods_of

INF = float("inf")


class Extremes(NamedTuple):
    """The largest and the smallest signed path product of each entry."""

    largest: Tensor
    smallest: Tensor


class SignedLog(NamedTuple):
    """A signed value as ``sign * exp(log_abs)``; ``sign`` is 0 where there is no path."""

    sign: Tensor
    log_abs: Tensor


def _max_log_product(x: Tensor, y: Tensor) -> Tensor:
    """``x + y`` for the max components, where ``-inf`` is "no path" and absorbs even an
    infinite magnitude (an edge of weight inf, such as sqrt'(0)): no path times inf is no path,
    not the NaN of ``-inf + inf``. A NaN stays NaN."""
    return (x + y).masked_fill_((x == -INF) | (y == -INF), -INF)


def _min_log_product(x: Tensor, y: Tensor) -> Tensor:
    """``x + y`` for the min components, where ``+inf`` is "no path" (see ``_max_log_product``)."""
    return (x + y).masked_fill_((x == INF) | (y == INF), INF)


class SignedMaxProd(Semiring):
    """Largest and smallest signed product over paths (a negative derivative swaps them).

    To stay exact and overflow-free the state tracks four log-magnitudes: the largest and the
    smallest |product| among positive paths and among negative paths. The largest signed product
    is the largest positive one or, when every path is negative, minus the smallest negative
    magnitude; the smallest signed product is symmetric. ``readout`` gives
    ``Extremes(largest, smallest)`` in linear scale (0 where no path exists), or, with
    ``log=True``, each as a ``SignedLog(sign, log_abs)``.
    """

    components = ("pos_max", "neg_max", "pos_min", "neg_min")
    zero = (-INF, -INF, INF, INF)
    one = (0.0, -INF, 0.0, INF)

    def __init__(self, log: bool = False) -> None:
        self.log = checked_flag(log, type(self).__name__, "log")

    def __repr__(self) -> str:
        return f"SignedMaxProd(log={self.log})"

    def lift(self, w: Tensor) -> State:
        return self._lift_routed(log_abs(w, self.state_dtype(w.dtype)), w > 0, w < 0)

    def lift_log(self, log_abs: Tensor, sign: Sign = 1.0) -> State:
        lw = log_abs.to(self.state_dtype(log_abs.dtype))
        return self._lift_routed(lw, *_sign_masks(lw, sign))

    def _lift_routed(self, lw: Tensor, pos: Tensor, neg: Tensor) -> State:
        """The four components of edges with log-magnitudes ``lw``, positive where ``pos`` and
        negative where ``neg`` (neither: no edge). A NaN weight lifts to NaN everywhere."""
        lifted = (
            torch.where(pos, lw, -INF),
            torch.where(neg, lw, -INF),
            torch.where(pos, lw, INF),
            torch.where(neg, lw, INF),
        )
        return _with_nan(lifted, torch.isnan(lw))

    def plus(self, a: State, b: State) -> State:
        return (
            torch.maximum(a[0], b[0]),
            torch.maximum(a[1], b[1]),
            torch.minimum(a[2], b[2]),
            torch.minimum(a[3], b[3]),
        )

    def times(self, a: State, b: State) -> State:
        # sign rules: (+)(+) and (-)(-) are positive, mixed signs are negative.
        return (
            torch.maximum(_max_log_product(a[0], b[0]), _max_log_product(a[1], b[1])),
            torch.maximum(_max_log_product(a[0], b[1]), _max_log_product(a[1], b[0])),
            torch.minimum(_min_log_product(a[2], b[2]), _min_log_product(a[3], b[3])),
            torch.minimum(_min_log_product(a[2], b[3]), _min_log_product(a[3], b[2])),
        )

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        return (
            a[0].amax(dims, keepdim=keepdim),
            a[1].amax(dims, keepdim=keepdim),
            a[2].amin(dims, keepdim=keepdim),
            a[3].amin(dims, keepdim=keepdim),
        )

    def scale(self, a: State, w: Tensor) -> State:
        return self._scale_routed(a, log_abs(w, a[0].dtype), w > 0, w < 0)

    def scale_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return self._scale_routed(a, log_abs, *_sign_masks(log_abs, sign))

    def _scale_routed(self, a: State, lw: Tensor, pos: Tensor, neg: Tensor) -> State:
        # Multiplying by one signed edge routes each component instead of combining pairs.
        up = [_max_log_product(a[i], lw) for i in (0, 1)]
        down = [_min_log_product(a[i], lw) for i in (2, 3)]
        scaled = (
            torch.where(pos, up[0], torch.where(neg, up[1], -INF)),
            torch.where(pos, up[1], torch.where(neg, up[0], -INF)),
            torch.where(pos, down[0], torch.where(neg, down[1], INF)),
            torch.where(pos, down[1], torch.where(neg, down[0], INF)),
        )
        return _with_nan(scaled, torch.isnan(lw))

    def matmul(self, a: State, w: Tensor) -> State:
        return self._matmul_lifted(a, self.kept_lift(w))

    def lift_cache_key(self) -> tuple | None:
        if uses_methods_of(self, SignedMaxProd, "lift", "_lift_routed"):
            return (SignedMaxProd,)
        return None

    def matmul_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return self._matmul_lifted(a, self.lift_log(log_abs.to(a[0].dtype), sign))

    def uses_edge_signs(self) -> bool:
        return True

    def _matmul_lifted(self, a: State, lifted: State) -> State:
        """All four components in one max-plus call, routing signs through a block matrix.

        With ``w`` lifted to its positive and negative parts (``-inf``/``+inf`` where an entry
        has the other sign or is zero), ``[pos_max | neg_max] @ [[P, N], [N, P]]`` gives
        ``[pos_max' | neg_max']`` and the min components are the same product of the negated
        ``[pos_min | neg_min]`` and min-parts. Both products are stacked on a leading batch dim.
        Negation is exact, so this equals the generic blocked product bit for bit; the max-plus
        kernels propagate NaN, so a NaN weight gives NaN as in MaxProd.
        """
        rank = max(a[0].dim(), lifted[0].dim())  # equal ranks: the stacked dim lines up below
        a = tuple(c.reshape((1,) * (rank - c.dim()) + tuple(c.shape)) for c in a)
        pos_max, neg_max, pos_min, neg_min = (
            c.reshape((1,) * (rank - c.dim()) + tuple(c.shape)) for c in lifted
        )
        route_max = torch.cat(
            [torch.cat([pos_max, neg_max], -1), torch.cat([neg_max, pos_max], -1)], -2
        )
        route_min = torch.cat(
            [torch.cat([pos_min, neg_min], -1), torch.cat([neg_min, pos_min], -1)], -2
        )
        left = torch.stack([torch.cat([a[0], a[1]], -1), -torch.cat([a[2], a[3]], -1)])
        right = torch.stack([route_max, -route_min])
        out = _absorbing_maxplus(left, right)
        m = lifted[0].shape[-1]
        return (out[0, ..., :m], out[0, ..., m:], -out[1, ..., :m], -out[1, ..., m:])

    def readout(self, a: State) -> Extremes:
        """NaN where any component is NaN (a NaN derivative on some path, as MaxProd reads it)."""
        pos_max, neg_max, pos_min, neg_min = a
        has_pos, has_neg = pos_max > -INF, neg_max > -INF
        nan = torch.isnan(pos_max) | torch.isnan(neg_max) | torch.isnan(pos_min)
        nan |= torch.isnan(neg_min)
        largest = SignedLog(
            torch.where(has_pos, 1.0, torch.where(has_neg, -1.0, 0.0)).to(pos_max.dtype),
            torch.where(has_pos, pos_max, torch.where(has_neg, neg_min, -INF)),
        )
        smallest = SignedLog(
            torch.where(has_neg, -1.0, torch.where(has_pos, 1.0, 0.0)).to(pos_max.dtype),
            torch.where(has_neg, neg_max, torch.where(has_pos, pos_min, -INF)),
        )
        largest = SignedLog(*_with_nan(largest, nan))
        smallest = SignedLog(*_with_nan(smallest, nan))
        if self.log:
            return Extremes(largest, smallest)
        return Extremes(
            largest.sign * largest.log_abs.exp(), smallest.sign * smallest.log_abs.exp()
        )

    def index_plus(self, dest: State, dim: int, index: Tensor, src: State) -> State:
        reduce = ("amax", "amax", "amin", "amin")
        return tuple(
            index_reduce(d, dim, index, s, r) for d, s, r in zip(dest, src, reduce, strict=True)
        )

    # --- fast paths of the message math -------------------------------------------------------
    def lift_is_multiplicative(self) -> bool:
        return True

    def exclusive_plus(self, a: State) -> State | None:
        # Largest magnitudes are maxima, smallest magnitudes minima, separately for each sign.
        return (
            exclusive_max(a[0]),
            exclusive_max(a[1]),
            exclusive_min(a[2]),
            exclusive_min(a[3]),
        )

    def normalization_kernel(self) -> CentredPairsKernel | None:
        return SIGNED


def _absorbing_maxplus(left: Tensor, right: Tensor) -> Tensor:
    """``maxplus(left, right)`` where ``-inf`` ("no path", and the other sign's half of the
    routing blocks) absorbs ``+inf`` (an infinite product), as ``_max_log_product`` does: the
    plain sum ``inf + -inf`` is NaN, and each routed product meets the other sign's ``-inf``s,
    so an infinite path product read NaN in both extremes. ``+inf`` is carried as a finite
    stand-in far above any real log-magnitude and read back as ``+inf``; finite entries and NaN
    are unchanged."""
    big = torch.finfo(torch.promote_types(left.dtype, right.dtype)).max / 8
    on_host = left.device.type == "cpu"  # elsewhere the branch-free form (no host read)
    if on_host and not (bool((left == INF).any()) or bool((right == INF).any())):
        return maxplus(left, right)
    out = maxplus(left.clamp(max=big), right.clamp(max=big))
    return out.masked_fill_(out >= big / 2, INF)


def _sign_masks(log_abs: Tensor, sign: Sign) -> tuple[Tensor, Tensor]:
    """(positive, negative) edge masks: an edge exists where ``log_abs`` is not ``-inf``."""
    edge = log_abs != -INF
    if isinstance(sign, Tensor):
        return edge & (sign > 0), edge & (sign < 0)
    none = torch.zeros_like(edge)
    return (edge, none) if sign > 0 else (none, edge)


def _with_nan(parts: tuple[Tensor, ...], nan: Tensor) -> tuple[Tensor, ...]:
    """``parts`` with NaN wherever ``nan`` is set (a NaN derivative must not read as no path)."""
    if not bool(nan.any()):
        return parts
    return tuple(torch.where(nan, float("nan"), p) for p in parts)
