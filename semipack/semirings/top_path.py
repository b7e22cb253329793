"""TopPath: MaxProd that also remembers where each best path goes, so the path can be read out.

Each state entry carries, next to ``log max|path product|``, the id of its best *successor*: the
downstream scalar node on the best path to the root. Plus keeps the id of the larger operand,
sums and matmuls keep the id at the argmax, and multiplying by an edge weight keeps the message's
id. During the backward pass every autograd node re-labels the entries of the tensor it produced
with fresh ids after recording their successors (see ``semipack.readout.paths``), so following
successors from a leaf entry walks the best path up to the root.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.exclusive import exclusive_argmax
from ..kernels.normalization import NO_SUCCESSOR, TOP_PATH, CentredPairsKernel
from ..kernels.tropical import maxplus_argmax
from ._log import kept_log_abs, log_abs
from .base import Sign, State, index_reduce, uses_methods_of
from .max_prod import MaxProd


class PathsNotRecorded(KeyError):
    """No paths of the asked family on a tensor. A KeyError (a lookup of the tensor's paths
    that found none), printed as its message rather than as a quoted key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def stored_paths(leaf: Tensor, what: str, family: type):
    """The paths a recording pass of ``family`` (TopPath, KBest, or a subclass) stored on
    ``leaf`` (``leaf.semiring_paths``); a KeyError that says why when there are none, or when
    another family's pass recorded them (KBest's ``paths`` read a TopPath pass's one path)."""
    semiring = family.__name__
    paths = getattr(leaf, "semiring_paths", None)
    if paths is None:
        raise PathsNotRecorded(
            f"this tensor holds no {what}: it was not a leaf, retained tensor or input of a "
            f"{semiring} backward pass (or a later pass with another semiring replaced them)"
        )
    recorded = getattr(paths, "recorded_by", None)
    if recorded is not None and not issubclass(recorded, family):
        raise PathsNotRecorded(
            f"this tensor holds the paths of a {recorded.__name__} pass, not of a {semiring} "
            f"one: read them with the {recorded.__name__} that ran it (or run a {semiring} "
            "backward)"
        )
    return paths


class TopPath(MaxProd):
    """The single best path and its value (ties go to the first candidate).

    ``readout`` is MaxProd's. After a backward, ``path(leaf, index)`` returns the best path from
    ``leaf[index]`` (default: the leaf's best entry) to the root, step by step, with the name of
    every site it passes (module, head, token, neuron where an extension named them).
    """

    components = ("log_max", "successor")
    zero = (float("-inf"), NO_SUCCESSOR)
    one = (0.0, NO_SUCCESSOR)
    records_paths = True

    def __repr__(self) -> str:
        return f"TopPath(log={self.log})"

    def component_dtypes(self, grad_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (self.state_dtype(grad_dtype), torch.int64)

    def lift(self, w: Tensor) -> State:
        return self._edges(log_abs(w, self.state_dtype(w.dtype)))

    def kept_lift(self, w: Tensor) -> State:
        if not uses_methods_of(self, TopPath, "lift"):
            return self.lift(w)
        return self._edges(kept_log_abs(w, self.state_dtype(w.dtype)))

    @staticmethod
    def _edges(log_w: Tensor) -> State:
        """Edges of log-weights ``log_w``: no successor of their own."""
        return (
            log_w,
            torch.full(log_w.shape, NO_SUCCESSOR, dtype=torch.int64, device=log_w.device),
        )

    def plus(self, a: State, b: State) -> State:
        take_b = b[0] > a[0]
        return torch.maximum(a[0], b[0]), torch.where(take_b, b[1], a[1])

    def times(self, a: State, b: State) -> State:
        # one operand is an edge weight (no successor of its own): keep the message's id
        return a[0] + b[0], torch.maximum(a[1], b[1])

    def scale(self, a: State, w: Tensor) -> State:
        value = a[0] + log_abs(w, a[0].dtype)
        return value, a[1].expand(value.shape)

    def lift_log(self, log_abs: Tensor, sign: Sign = 1.0) -> State:
        value = log_abs.to(self.state_dtype(log_abs.dtype))
        ids = torch.full(value.shape, NO_SUCCESSOR, dtype=torch.int64, device=value.device)
        return (value, ids)

    def scale_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        value = a[0] + log_abs
        return value, a[1].expand(value.shape)

    def scale_log_owned(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return self.scale_log(a, log_abs, sign)

    def matmul_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return self._best_products(a, log_abs.to(a[0].dtype))

    def uses_edge_signs(self) -> bool:
        return False

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        kept = [d for d in range(a[0].dim()) if d not in dims]
        order = kept + list(dims)
        values = a[0].permute(order).flatten(len(kept))
        ids = a[1].expand(a[0].shape).permute(order).flatten(len(kept))
        best, where = values.max(-1)
        chosen = ids.gather(-1, where[..., None])[..., 0]
        if keepdim:
            shape = [1 if d in dims else s for d, s in enumerate(a[0].shape)]
            best, chosen = best.reshape(shape), chosen.reshape(shape)
        return best, chosen

    def matmul(self, a: State, w: Tensor) -> State:
        return self._best_products(a, kept_log_abs(w, a[0].dtype))

    def has_lifted_matmul(self) -> bool:
        return True

    def matmul_lifted(self, a: State, lifted: State) -> State:
        return self._best_products(a, lifted[0].to(a[0].dtype))

    def _best_products(self, a: State, log_w: Tensor) -> State:
        """Max-plus product with the successor id of the winning k (the first on ties)."""
        values, where = maxplus_argmax(a[0], log_w)
        k = a[0].shape[-1]
        ids = a[1].expand(a[0].shape).expand(*values.shape[:-1], k)
        return values, torch.gather(ids, -1, where)

    def index_plus(self, dest: State, dim: int, index: Tensor, src: State) -> State:
        best = index_reduce(dest[0], dim, index, src[0], "amax")
        # which contribution attained the max: the destination itself, else the last source
        gathered = best.index_select(dim, index)
        wins = src[0] == gathered
        src_ids = torch.where(wins, src[1].expand(src[0].shape), NO_SUCCESSOR)
        from_src = index_reduce(
            torch.full_like(dest[1].expand(dest[0].shape), NO_SUCCESSOR),
            dim,
            index,
            src_ids,
            "amax",
        )
        keep_dest = dest[0] == best
        return best, torch.where(keep_dest, dest[1].expand(dest[0].shape), from_src)

    def is_zero(self, a: State) -> Tensor:
        return a[0] == float("-inf")

    def lift_is_multiplicative(self) -> bool:
        return True

    def exclusive_plus(self, a: State) -> State | None:
        # the best other entry: the row's first maximum, except at that entry, where it is the
        # first maximum of the others (so softmax rows take the O(n) diagonal-plus-rank-one
        # form, as MaxProd's do, instead of an argmax over every pair of a dense Jacobian)
        value, where = exclusive_argmax(a[0])
        return value, a[1].expand(a[0].shape).gather(-1, where)

    def is_max_plus(self) -> bool:
        return False  # the state also carries successor ids

    def is_max_plus_with_ids(self) -> bool:
        return uses_methods_of(self, TopPath, "lift", "plus", "times", "sum", "zero", "one")

    def normalization_kernel(self) -> CentredPairsKernel | None:
        # the best input of each output from the sorted envelope: O(n log n) per row where
        # the dense Jacobian took an eager argmax over all n^2 pairs (ResNet-18 in training,
        # 8 x 64 x 64 images: 88 s per backward)
        return TOP_PATH

    def path_slots(self, a: State) -> tuple[Tensor, Tensor]:
        return a[0][None], a[1].expand(a[0].shape)[None]

    def with_successors(self, a: State, ids: Tensor) -> State:
        return a[0], ids[0]

    def path(self, leaf: Tensor, index: tuple[int, ...] | int | None = None):
        """The best path from ``leaf[index]`` (default: the leaf's best entry) to the root of
        the last TopPath backward that reached ``leaf`` (a leaf, a retained tensor or an input
        of ``semipack.grad``). ``index`` counts as tensor indexing does, negative entries from
        the end (``(-1, 0)``: the last row's first entry). The paths live on the tensor
        (``leaf.semiring_paths``), next to its ``semiring_grad``, so one TopPath instance
        serves any number of passes."""
        return stored_paths(leaf, "top paths", TopPath).path(index)
