"""The product semiring: several semirings in one backward pass.

``Product(MaxProd(), Entropy(), LogSum())`` is the direct product of its factors: a state is
the factors' states side by side (the concatenation of their component tuples), and every
operation acts on each factor's slice with that factor's own operation. Its readout is a tuple
with one readout per factor, in order.

One product pass costs less than one pass per factor: the forward, the autograd traversal and
the regular gradient are shared, and every op still runs each factor's own fast rule: the
message layer (``messages.message.dispatch``) and the extension template hand each factor its
slice of the message and its own semiring, so no rule ever sees a ``Product``. The operations
below are for the code that combines whole states outside the rules (accumulation at leaves,
branch readouts).

Path-recording semirings (TopPath, KBest) cannot be factors: their successor ids belong to one
pass's trace per semiring.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from torch import Tensor

from .base import Semiring, Sign, SparseRows, State, check_definition


class Product(Semiring):
    """The direct product of ``semirings`` (at least one, none recording paths, no products).

    ``readout`` gives a tuple: ``p.semiring_grad[i]`` is the ``i``-th factor's readout, exactly
    what a pass with that semiring alone gives.
    """

    def __init__(self, *semirings: Semiring) -> None:
        if not semirings:
            raise ValueError("Product needs at least one semiring")
        for s in semirings:
            if isinstance(s, type) and issubclass(s, Semiring):
                raise TypeError(f"Product takes semiring instances: pass {s.__name__}()")
            if isinstance(s, (list, tuple)):
                raise TypeError(
                    f"Product takes the semirings as separate arguments, got a "
                    f"{type(s).__name__}: write Product(*factors)"
                )
            if not isinstance(s, Semiring):
                raise TypeError(f"Product takes semirings, got {type(s).__name__}")
            check_definition(s)  # a factor of one's own that does not fit, by name
            if isinstance(s, Product):
                raise ValueError("a Product cannot contain a Product: list its factors instead")
            if s.records_paths:
                raise ValueError(
                    f"{s.name} records paths and cannot be a factor of a Product (run it in a "
                    "pass of its own, or use MaxProd for the value)"
                )
        self.semirings: tuple[Semiring, ...] = tuple(semirings)
        self.components = tuple(f"{s.name}.{c}" for s in semirings for c in s.components)
        self.zero = tuple(z for s in semirings for z in s.zero)
        self.one = tuple(o for s in semirings for o in s.one)
        self.linear_weights = any(s.linear_weights for s in semirings)
        ends = [0]
        for s in semirings:
            ends.append(ends[-1] + len(s.components))
        self._slices = [slice(a, b) for a, b in itertools.pairwise(ends)]

    def __repr__(self) -> str:
        return f"Product({', '.join(repr(s) for s in self.semirings)})"

    # --- slicing ------------------------------------------------------------------------------
    def split(self, a: State) -> list[State]:
        """Each factor's state: a slice of ``a``'s components (the same tensors, not copies,
        so writing into a factor's slice writes into ``a``)."""
        return [tuple(a[s]) for s in self._slices]

    def join(self, states: list[State]) -> State:
        """The product state of the factors' ``states`` (in order)."""
        return tuple(c for st in states for c in st)

    def _each(self, method: str, *states: State, **kwargs: Any) -> State:
        """``method`` of each factor on its slices of ``states``."""
        parts = zip(*(self.split(a) for a in states), strict=True)
        pairs = zip(self.semirings, parts, strict=True)
        return self.join([getattr(s, method)(*p, **kwargs) for s, p in pairs])

    def _each_or_none(self, method: str, *args: Any) -> State | None:
        """A fast form per factor, or None when some factor has none (the caller then takes
        the generic form for the whole product)."""
        out = []
        for s, st in zip(self.semirings, self.split(args[0]), strict=True):
            got = getattr(s, method)(st, *args[1:])
            if got is None:
                return None
            out.append(got)
        return self.join(out)

    # --- primitives -----------------------------------------------------------------------------
    def lift(self, w: Tensor) -> State:
        return self.join([s.lift(w) for s in self.semirings])

    def plus(self, a: State, b: State) -> State:
        return self._each("plus", a, b)

    def times(self, a: State, b: State) -> State:
        return self._each("times", a, b)

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        return self._each("sum", a, dims=dims, keepdim=keepdim)

    def readout(self, a: State) -> tuple[Any, ...]:
        """One readout per factor, in order."""
        return tuple(s.readout(st) for s, st in zip(self.semirings, self.split(a), strict=True))

    def readout_into(self, a: State, into: Any) -> tuple[Any, ...]:
        """``readout_into`` factor by factor, ``into`` an earlier readout of this product."""
        earlier = into if type(into) is tuple and len(into) == len(self.semirings) else None
        return tuple(
            s.readout_into(st, None if earlier is None else earlier[i])
            for i, (s, st) in enumerate(zip(self.semirings, self.split(a), strict=True))
        )

    def readout_sparse(self, a: SparseRows, into: Any = None) -> tuple[Any, ...]:
        """``readout`` of a sparse state, factor by factor (each skips the unreached rows);
        ``into`` is an earlier readout of this product, reused factor by factor."""
        earlier = into if type(into) is tuple and len(into) == len(self.semirings) else None
        return tuple(
            s.readout_sparse(
                dataclasses.replace(a, parts=st), None if earlier is None else earlier[i]
            )
            for i, (s, st) in enumerate(zip(self.semirings, self.split(a.parts), strict=True))
        )

    def component_dtypes(self, grad_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return tuple(d for s in self.semirings for d in s.component_dtypes(grad_dtype))

    def is_zero(self, a: State) -> Tensor:
        out = None
        for s, st in zip(self.semirings, self.split(a), strict=True):
            hit = s.is_zero(st)
            out = hit if out is None else out & hit
        return out

    # --- derived operations: each factor's own ----------------------------------------------------
    def scale(self, a: State, w: Tensor) -> State:
        pairs = zip(self.semirings, self.split(a), strict=True)
        return self.join([s.scale(st, w) for s, st in pairs])

    def lift_log(self, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return self.join([s.lift_log(log_abs, sign) for s in self.semirings])

    def scale_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        pairs = zip(self.semirings, self.split(a), strict=True)
        return self.join([s.scale_log(st, log_abs, sign) for s, st in pairs])

    def matmul(self, a: State, w: Tensor) -> State:
        pairs = zip(self.semirings, self.split(a), strict=True)
        return self.join([s.matmul(st, w) for s, st in pairs])

    def matmul_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        pairs = zip(self.semirings, self.split(a), strict=True)
        return self.join([s.matmul_log(st, log_abs, sign) for s, st in pairs])

    def uses_edge_signs(self) -> bool:
        return any(s.uses_edge_signs() for s in self.semirings)

    def index_plus(self, dest: State, dim: int, index: Tensor, src: State) -> State:
        pairs = zip(self.semirings, self.split(dest), self.split(src), strict=True)
        return self.join([s.index_plus(d, dim, index, x) for s, d, x in pairs])

    def prefix_plus(self, a: State, dim: int) -> State:
        pairs = zip(self.semirings, self.split(a), strict=True)
        return self.join([s.prefix_plus(st, dim) for s, st in pairs])

    def lift_is_multiplicative(self) -> bool:
        return all(s.lift_is_multiplicative() for s in self.semirings)

    def exclusive_plus(self, a: State) -> State | None:
        return self._each_or_none("exclusive_plus", a)

    def softmax_closed_form(
        self, m: State, probs: Tensor, log_probs: Tensor | None
    ) -> State | None:
        return self._each_or_none("softmax_closed_form", m, probs, log_probs)

    def log_softmax_closed_form(self, m: State, log_probs: Tensor) -> State | None:
        return self._each_or_none("log_softmax_closed_form", m, log_probs)


__all__ = ["Product"]
