"""The semiring interface every message computation is written against.

A semiring *state* is a tuple of same-shaped tensors (its "components"): one for MaxProd (the log
of the best path product), two for Entropy (log-normaliser and expected surprisal), four for
SignedMaxProd. The op rules only ever call the methods below, so a new semiring is a subclass
that fills in the six primitives (``zero``, ``one``, ``lift``, ``plus``, ``times``, ``sum``) and,
optionally, faster ``matmul`` / ``index_plus`` kernels.

Edge weights reach a semiring in two forms. ``lift`` / ``scale`` / ``matmul`` take the linear
derivative ``w``. ``lift_log`` / ``scale_log`` / ``matmul_log`` take it as ``(log|w|, sign)``:
for a saturating function (tanh, sigmoid, softmax, GELU, ...) the linear derivative rounds to 0
in float32 long before its logarithm stops being representable (tanh'(20) ~ 4e-17, whose log
-38.6 is an ordinary float), and every built-in state but Real's is a logarithm anyway, so the
log form never cuts a path that exists. The defaults go through ``lift`` of the linear weight, so
a user semiring that only defines the primitives stays correct (as precise as its ``lift``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..kernels import logspace
from ..kernels.affine_params import AffineParams
from ..kernels.blocking import BLOCK_ELEMENTS
from ..kernels.logspace import precise_log_floor
from ..kernels.normalization import CentredPairsKernel
from ..kernels.reuse import same_memory
from ..kernels.shapes import broadcast_shapes
from ..kernels.shared_shift import ConvolutionSums
from ..kernels.weight_cache import WEIGHTS

State = tuple[Tensor, ...]

#: Edge signs for the log-space operations: a tensor of -1 / 0 / +1 (0 only where ``log_abs`` is
#: ``-inf``), or one number for every edge.
Sign = Tensor | float

#: log of the smallest positive float64 (a subnormal, 4.9e-324). An edge weight whose exact
#: magnitude lies below it is an exact 0 in every floating-point type: the forward computed the
#: function in a float type, where such a weight cannot exist, and the float64 oracle reads it as
#: 0. Log-form weights below this are no edge. This is how additive masks (-1e4, -1e9, -1e30,
#: ``finfo.min``) cut their keys in log space, while every weight a float64 model can represent
#: (tanh'(20) ~ 4e-17, a probability of 1e-50) keeps its edge in float32 too.
NO_EDGE_LOG = math.log(math.ulp(0.0))


#: The algebra a semiring is defined by. A subclass that redefines any of these gets the generic
#: versions of every derived operation below that it does not redefine itself.
PRIMITIVES: tuple[str, ...] = ("lift", "plus", "times", "sum", "zero", "one", "components")

#: Operations with a generic definition in terms of the primitives (or a generic "no fast form
#: here" answer), which semiring classes override with fast kernels written for *their* algebra,
#: each mapped to the other operations its fast versions rely on. Inheriting such a kernel after
#: changing the algebra would compute the parent's semiring, so ``Semiring.__init_subclass__``
#: gives a subclass that redefines a primitive the generic version of every operation here it
#: does not define itself, and a subclass that redefines an operation the generic version of
#: every operation relying on it. A subclass that changes none of them keeps every fast path,
#: and one that overrides a fast path has its own version used.
DERIVED_OPERATIONS: dict[str, tuple[str, ...]] = {
    "scale": (),
    "scale_owned": ("scale",),
    "matmul": (),
    "matmul_lifted": (),
    "has_lifted_matmul": ("matmul", "matmul_lifted"),
    "index_plus": (),
    "is_zero": (),
    # edge weights in log form
    "lift_log": (),
    "scale_log": (),
    "scale_log_owned": ("scale_log",),
    "matmul_log": (),
    "uses_edge_signs": ("lift_log", "scale_log", "scale_log_owned", "matmul_log", "matmul"),
    # fast paths of the message math (semipack.messages)
    "lift_is_multiplicative": (),
    "prefix_plus": (),
    "exclusive_plus": (),
    "softmax_closed_form": ("lift_log", "scale_log", "exclusive_plus"),
    "log_softmax_closed_form": ("lift_log", "scale_log", "exclusive_plus"),
    "compiles_rowwise": ("lift_log", "scale_log", "exclusive_plus"),
    "normalization_closed_form": (),
    "normalization_kernel": (),
    "affine_params_kernel": (),
    "shared_shift_products": (),
    "shared_shift_conv": (),
}

#: ``(m ⊗ right, mᵀ ⊗ left, ⊕ of m over dim -2)`` (or a convolution's (input, weight, bias)
#: messages) from one shared shift; None where a product was not asked for.
Products = tuple[State | None, State | None, State | None]


def _drop_fast_paths_of_another_algebra(cls: type[Semiring]) -> None:
    """Give ``cls`` the generic version of each derived operation it inherits from a class
    whose primitives, or whose operations that one relies on (``DERIVED_OPERATIONS``), are not
    ``cls``'s own, until none is left: the fast version was written for that class's algebra.
    Whatever class supplies the change counts (the class body or a mixin before the parent);
    an operation ``cls`` defines itself is its own."""
    changed = True
    while changed:
        changed = False
        for name, assumes in DERIVED_OPERATIONS.items():
            generic = Semiring.__dict__[name]
            owner = next(c for c in cls.__mro__ if name in c.__dict__)
            if owner is cls or owner.__dict__[name] is generic:
                continue
            if any(
                getattr(cls, r, None) is not getattr(owner, r, None)
                for r in (*PRIMITIVES, *assumes)
            ):
                setattr(cls, name, generic)
                changed = True


def use_generic(cls: type[Semiring], names: Iterable[str]) -> None:
    """Give ``cls`` the generic ``Semiring`` version of each derived operation in ``names`` that
    its own class body does not define, and then of every derived operation relying on one of
    those (``DERIVED_OPERATIONS``), transitively."""
    changed = set(names)
    pending = list(changed)
    while pending:
        name = pending.pop()
        if name in DERIVED_OPERATIONS and not _defines(cls, name):
            setattr(cls, name, getattr(Semiring, name))
        for other, assumes in DERIVED_OPERATIONS.items():
            if other not in changed and name in assumes:
                changed.add(other)
                pending.append(other)


def _defines(cls: type, name: str) -> bool:
    """Whether the class body of ``cls`` defines ``name`` (a generic version set by
    ``use_generic`` does not count)."""
    own = cls.__dict__.get(name)
    return own is not None and own is not Semiring.__dict__.get(name)


def checked_flag(value: Any, owner: str, name: str) -> bool:
    """``value`` of a semiring's on/off option, or a TypeError naming it: a string such as
    ``log="False"`` counted as True, silently switching the readout (trial 123)."""
    if not isinstance(value, bool):
        raise TypeError(f"{owner}({name}=...) must be True or False, got {value!r}")
    return value


def _undefined(sr: Semiring, method: str) -> NotImplementedError:
    return NotImplementedError(
        f"{sr.name} does not define {method}: a semiring defines lift, plus, times and sum "
        "(see 'Adding a semiring' in the README)"
    )


#: Set on an instance of a semiring written outside semipack once ``check_definition`` passed.
_CHECKED_MARK = "_semipack_definition_checked"


#: The package's own semiring classes (``register_built_in``): tested against the oracles, so
#: ``check_definition`` passes them by. Exactly these classes: a subclass, or another class
#: written inside the package, is checked.
_BUILT_IN: set[type] = set()


def register_built_in(*classes: type) -> None:
    """Declare ``classes`` built-in semirings (``semirings/__init__.py`` names them)."""
    _BUILT_IN.update(classes)


def check_definition(sr: Semiring) -> None:
    """Refuse a semiring written outside semipack whose pieces do not fit, by name, before a
    pass runs (trials 68 and 69: raw ``IndexError``s, "iteration over a 0-d tensor", a ``sum``
    without ``keepdim`` failing deep inside a pass, and a ``lift`` that did not send 0 to
    ``zero`` giving wrong values silently): ``components`` a tuple of names, ``zero`` and
    ``one`` tuples with one entry per name, and ``lift``, ``plus``, ``times`` and
    ``sum(a, dims, keepdim)`` each returning a tuple of one tensor per component, ``lift``
    sending an exact 0 to ``zero``. Built-in semirings (a ``Product``'s factors are checked)
    and instances checked once are not checked again."""
    for factor in getattr(sr, "semirings", ()):  # a Product's factors
        check_definition(factor)
    cls = type(sr)
    if cls in _BUILT_IN or sr.__dict__.get(_CHECKED_MARK):
        # each instance: its settings may change what lift gives (trial 70); a class of the
        # package that is not a built-in one is checked too (trial 132: one added where
        # "Layout" says semirings go skipped every check)
        return
    name = sr.name
    see = "(see 'Adding a semiring' in the README)"
    components = sr.components
    if not isinstance(components, (tuple, list)) or not all(isinstance(c, str) for c in components):
        raise TypeError(
            f"{name}.components must be a tuple of names, one per state component, got "
            f"{components!r} {see}"
        )
    n = len(components)
    for field_name in ("zero", "one"):
        value = getattr(sr, field_name)
        if not isinstance(value, (tuple, list)):
            raise TypeError(
                f"{name}.{field_name} must be a tuple with one entry per component, got "
                f"{value!r} (write ({value!r},)) {see}"
            )
    if len(sr.zero) != n or len(sr.one) != n:
        raise TypeError(
            f"{name}: components names {n} state component(s) {tuple(components)}, but "
            f"zero has {len(sr.zero)} and one {len(sr.one)} entries: give each component its "
            f"zero and one {see}"
        )
    probe = torch.tensor([0.0, 2.0])
    raw = _lift_or_none(sr, probe)
    if raw is None:  # a lift written for float64 only (an assert or a dtype check in it)
        probe = probe.double()
        raw = sr.lift(probe)
    lifted = _checked_state(sr, "lift", raw, n, see)
    _check_zero_lifted(sr, lifted, see)
    if probe.dtype != torch.float64:  # a lift may send 0 elsewhere in float64 only (trial 133:
        raw = _lift_or_none(sr, probe.double())  # |w|.clamp_min(1e-50), 0 in float32)
        if raw is not None:
            _check_zero_lifted(sr, _checked_state(sr, "lift", raw, n, see), see)
    _checked_state(sr, "plus", sr.plus(lifted, lifted), n, see)
    _checked_state(sr, "times", sr.times(lifted, lifted), n, see)
    try:
        summed = sr.sum(lifted, [0], False)
    except TypeError as error:
        raise TypeError(f"{name}.sum must take (a, dims, keepdim=False): {error} {see}") from error
    _checked_state(sr, "sum", summed, n, see, shape=())
    for edge in (2.0, 0.5):  # an edge above 1 and one below: a zero of 0 (log 1) hid behind
        _check_laws(sr, torch.tensor([0.0, edge], dtype=probe.dtype), see)  # log 2 (trial 133)
    sr.__dict__[_CHECKED_MARK] = True


def _lift_or_none(sr: Semiring, probe: Tensor) -> State | None:
    """``sr.lift(probe)``, or None where the lift refuses the probe's dtype."""
    try:
        return sr.lift(probe)
    except (RuntimeError, TypeError, ValueError, AssertionError):
        return None


def _check_zero_lifted(sr: Semiring, lifted: State, see: str) -> None:
    """Refuse a lift that does not send the probe's first entry, an exact 0, to ``zero``."""
    for c, z in zip(lifted, sr.zero, strict=True):
        if not (bool(c[0] == z) or (isinstance(z, float) and math.isnan(z) and bool(c[0].isnan()))):
            raise TypeError(
                f"{sr.name}.lift must send an exact 0 (no edge) to zero {tuple(sr.zero)}; it "
                f"sent 0 ({c.dtype}) to {tuple(float(c[0]) for c in lifted)} {see}"
            )


def _check_laws(sr: Semiring, probe: Tensor, see: str) -> None:
    """The laws a pass relies on, on the probe's two edges (0 and another, ``e``): ``plus``
    commutative with ``zero`` its identity, ``one`` the identity of ``times``, and ``sum`` over
    one or several dims (with and without ``keepdim``) the ``plus`` of the entries. Not a
    proof of the laws, a net for the usual slips (trial 132: a ``plus`` that returned its left
    argument, a ``zero`` that was not plus's identity and a ``sum`` that reduced its first dim
    only gave values without an error; trial 133: one that reduced every dim whatever
    ``dims`` said failed deep inside the pass). Within float rounding (``_law``)."""
    name, n, e = sr.name, len(sr.components), f"{float(probe[1]):g}"
    lifted = _checked_state(sr, "lift", sr.lift(probe), n, see)
    swapped = tuple(c.flip(0) for c in lifted)  # lift([e, 0])
    edge = tuple(c[1:].expand(2) for c in lifted)  # lift(e), twice
    one = tuple(torch.full_like(c, o) for c, o in zip(lifted, sr.one, strict=True))
    both = sr.plus(lifted, swapped)
    _law(sr, both, sr.plus(swapped, lifted), f"{name}.plus is not commutative: plus(a, b) and "
         f"plus(b, a) differ for a = lift([0, {e}]), b = lift([{e}, 0])", see)  # fmt: skip
    _law(sr, both, edge, f"{name}.zero {tuple(sr.zero)} is not the identity of plus: plus(a, b) "
         f"for a = lift([0, {e}]), b = lift([{e}, 0]) is not lift([{e}, {e}])", see)  # fmt: skip
    _law(sr, sr.times(one, lifted), lifted, f"{name}.one {tuple(sr.one)} is not the identity of "
         f"times: times(one, lift([0, {e}])) is not lift([0, {e}])", see)  # fmt: skip
    grid = _checked_state(sr, "lift", sr.lift(torch.stack([probe, probe.flip(0)])), n, see,
                          shape=(2, 2))  # fmt: skip
    total = sr.plus(tuple(c[:1] for c in both), tuple(c[1:] for c in both))
    for keepdim, shape in ((True, (1, 1)), (False, ())):
        summed = _checked_state(sr, "sum", sr.sum(grid, [0, 1], keepdim), n, see, shape)
        _law(sr, tuple(c.reshape(1) for c in summed), total, f"{name}.sum(a, [0, 1], keepdim="
             f"{keepdim}) is not the plus of a's four entries (it must reduce every dim in "
             "dims)", see)  # fmt: skip
    rows = _checked_state(sr, "sum", sr.sum(grid, [1], False), n, see, shape=(2,))
    _law(sr, rows, edge, f"{name}.sum(a, [1]) of a = lift([[0, {e}], [{e}, 0]]) is not "
         f"lift([{e}, {e}]) (it must reduce only the dims in dims)", see)  # fmt: skip


def _law(sr: Semiring, got: State, want: State, what: str, see: str) -> None:
    """Raise ``TypeError(what)`` unless the states agree, component by component, within
    float rounding (NaN with NaN, an infinity with itself): relative and absolute, since a
    log-space sum near 0 rounds by 1e-8 in absolute terms (trial 133: a valid semiring whose
    probe total was 0.0025 was refused at a relative 1e-6). The slips it is for are off by
    far more."""
    for g, w in zip(got, want, strict=True):
        g, w = g.reshape(w.shape) if g.numel() == w.numel() else g, w
        same = (
            torch.equal(g, w)
            if g.dtype == torch.bool or w.dtype == torch.bool
            else g.shape == w.shape
            and bool(
                torch.isclose(g.double(), w.double(), rtol=1e-5, atol=1e-5, equal_nan=True).all()
            )
        )
        if not same:
            raise TypeError(f"{what}: got {got}, expected {want} {see}")


def _checked_state(
    sr: Semiring, method: str, state: Any, n: int, see: str, shape: tuple[int, ...] = (2,)
) -> tuple:
    """``state`` if it is a tuple of ``n`` tensors of ``shape``, else a TypeError naming the
    method (``check_definition``)."""
    if not (
        isinstance(state, tuple)
        and len(state) == n
        and all(isinstance(c, Tensor) and tuple(c.shape) == shape for c in state)
    ):
        got = f"a {type(state).__name__}"
        if isinstance(state, tuple):
            shapes = ", ".join(
                str(tuple(c.shape)) if isinstance(c, Tensor) else type(c).__name__ for c in state
            )
            got = f"a tuple of {len(state)}: {shapes}"
        raise TypeError(
            f"{sr.name}.{method} must return a tuple of {n} tensor(s), one per component, each "
            f"shaped like the state (here {shape}); it returned {got} {see}"
        )
    return state


def normalize_dims(dims: int | Sequence[int] | None, ndim: int) -> list[int]:
    """Turn an aten ``dim`` argument into a sorted list of non-negative dims (None or [] = all)."""
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return list(range(ndim))
    return sorted({d % ndim if ndim else 0 for d in dims})


class Semiring:
    """Base class: subclass it and implement ``lift``, ``plus``, ``times`` and ``sum``.

    ``zero`` is the value of "no path" (the identity of ``plus``), ``one`` the value of the empty
    path (the identity of ``times``), both given per component. ``lift`` turns a tensor of local
    partial derivatives into states; a derivative that is exactly 0 must lift to ``zero`` so that
    zero-weight edges and absent edges are the same thing.
    """

    #: Names of the state components, in order.
    components: ClassVar[tuple[str, ...]] = ("value",)
    zero: ClassVar[tuple[float | bool, ...]] = (0.0,)
    one: ClassVar[tuple[float | bool, ...]] = (1.0,)
    #: True when rules must give this semiring the op's own linear derivative (Real: its messages
    #: are gradients and must equal autograd's, rounding included). Otherwise rules that know an
    #: exact log-derivative use ``scale_log`` / ``matmul_log``.
    linear_weights: ClassVar[bool] = False
    #: True for semirings whose backward records a path trace (TopPath): the backward driver
    #: then runs the pass with a pass-bound copy of the semiring (``bound_to``).
    records_paths: ClassVar[bool] = False
    #: The path trace of the pass a pass-bound copy belongs to; ``None`` on the user's instance,
    #: which the backward never modifies (one instance serves many passes and threads).
    trace: Any = None

    def path_slots(self, a: State) -> tuple[Tensor, Tensor]:
        """Path-recording semirings: the log-values and successor ids of the ``ranks`` paths
        each entry of ``a`` keeps, as two [ranks, *shape] tensors (TopPath: 1, KBest: k)."""
        raise NotImplementedError(f"{self.name} records no paths")

    def with_successors(self, a: State, ids: Tensor) -> State:
        """Path-recording semirings: ``a`` with its successor ids replaced by ``ids``
        ([ranks, *shape], as ``path_slots`` gives them)."""
        raise NotImplementedError(f"{self.name} records no paths")

    def bound_to(self, trace: Any) -> Semiring:
        """A shallow copy carrying ``trace``: the semiring every message of one pass holds, so
        rules and extensions reach the pass's trace through ``call.semiring``."""
        bound = copy.copy(self)
        bound.trace = trace
        return bound

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that changes the algebra (``PRIMITIVES``) falls back to the generic
        ``DERIVED_OPERATIONS`` it does not define itself, never to its parent's fast kernels;
        one that redefines a derived operation loses the fast paths that rely on it.

        Every ``sum`` and ``matmul`` a class defines is also made total: reducing over an empty
        dimension (an empty batch, a zero-width layer) gives the semiring zero, "no path", as
        an empty sum gives 0, instead of failing inside ``amax`` or a kernel.
        """
        super().__init_subclass__(**kwargs)
        _drop_fast_paths_of_another_algebra(cls)
        _make_total(cls)

    @property
    def name(self) -> str:
        """The class name, as messages and reprs show it."""
        return type(self).__name__

    def __repr__(self) -> str:
        return f"{self.name}()"

    # --- the six primitives -------------------------------------------------------------------
    def lift(self, w: Tensor) -> State:
        """Edge weights ``w`` (local partial derivatives, any shape) as states of that shape;
        an exact 0 must lift to ``zero`` (no edge)."""
        raise _undefined(self, "lift")

    def lift_cache_key(self) -> Hashable | None:
        """What besides ``w`` decides ``lift(w)``: the key under which lifted model weights are
        kept across passes (``kept_lift``), or None, the default, to lift every time. A
        semiring whose ``lift`` reads settings of the instance puts them in the key; the
        built-in ones return None for a subclass that redefines how it lifts
        (``uses_methods_of``), whose lift may read settings of its own."""
        return None

    def kept_lift(self, w: Tensor) -> State:
        """``lift(w)``, kept across passes while ``w`` is a model weight with unchanged contents
        (``kernels.weight_cache``). The state is shared with later passes: only read it."""
        key = lift_key(self)
        if key is None:
            return self.lift(w)
        return WEIGHTS.derived(w, ("lift", key), lambda: self.lift(w))

    def plus(self, a: State, b: State) -> State:
        """Combine two alternatives (paths that meet), entry by entry; identity ``zero``."""
        raise _undefined(self, "plus")

    def times(self, a: State, b: State) -> State:
        """Extend paths by edges (or concatenate two path sets), entry by entry; identity
        ``one``, and ``zero`` absorbs."""
        raise _undefined(self, "times")

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        """Plus-reduce over ``dims`` (already normalised, non-empty)."""
        raise _undefined(self, "sum")

    def readout(self, a: State) -> Any:
        """What users see: a tensor (or named tuple of tensors) of the state's shape."""
        return a[0]

    def readout_into(self, a: State, into: Any) -> Any:
        """``readout(a)`` written into the memory of ``into`` where shape, dtype and device
        agree (else a fresh readout). ``into``: an earlier readout of the same tensor that
        nothing else holds any more (``kernels.reuse``), as PyTorch accumulates into a
        gradient's buffer: a pass then needs no second weight-sized tensor per parameter.
        The default computes the readout and copies it (built-ins write theirs directly); a
        readout that is the state itself (a log-space readout) is returned as it is: its
        memory is no more than the state's, and a copy would cost a pass over it."""
        value = self.readout(a)
        if (
            isinstance(value, Tensor)
            and fits(into, value)
            and not any(same_memory(value, p) for p in a)
        ):
            return on_memory_of(into).copy_(value)
        return value

    def readout_sparse(self, a: SparseRows, into: Any = None) -> Any:
        """``readout`` of a state kept as its non-zero rows: the other rows get the readout of
        the zero without evaluating it entry by entry (the exponential of a 30k x 384
        embedding table costs more than a small model's backward).

        ``into``: an earlier readout of the same tensor that nothing else holds any more. The
        result is written into its memory where shape, dtype and device agree: a table this
        large is fresh memory from the OS at each allocation, and the first touch of its
        pages costs as much as the writes themselves.
        """
        device = a.rows.device
        zero_row = self.readout(self.zeros((1, *a.shape[1:]), a.grad_dtype, device))
        if isinstance(zero_row, Tensor):
            return _rows_over(zero_row, a.shape[0], a.rows, self.readout(a.parts), into)
        if isinstance(zero_row, tuple) and all(isinstance(z, Tensor) for z in zero_row):
            # a named tuple of tensors (``Entropy(flow=True)``): the same, field by field
            rows = self.readout(a.parts)
            earlier = into if type(into) is type(zero_row) else (None,) * len(zero_row)
            fields = zip(zero_row, rows, earlier, strict=True)
            return type(zero_row)(*(_rows_over(z, a.shape[0], a.rows, r, e) for z, r, e in fields))
        return self.readout(a.dense(self))  # nested tuples (paths): read the dense state

    # --- dtypes and constants -----------------------------------------------------------------
    def state_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """Components are kept in at least float32, whatever the gradient dtype."""
        if not grad_dtype.is_floating_point:
            return torch.float32
        return torch.promote_types(grad_dtype, torch.float32)

    def component_dtypes(self, grad_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The dtype of each state component for messages of gradients of
        ``grad_dtype`` (float32 at least, so half-precision models keep their paths)."""
        return (self.state_dtype(grad_dtype),) * len(self.components)

    def full(
        self,
        values: tuple[float | bool, ...],
        shape: Sequence[int],
        grad_dtype: torch.dtype,
        device: torch.device | str,
    ) -> State:
        """A state of ``shape`` holding ``values`` (one per component) in the component dtypes."""
        dtypes = self.component_dtypes(grad_dtype)
        return tuple(
            torch.full(tuple(shape), v, dtype=dt, device=device)
            for v, dt in zip(values, dtypes, strict=True)
        )

    def zeros(self, shape: Sequence[int], grad_dtype: torch.dtype, device) -> State:
        """The semiring's zero ("no path") in every entry of ``shape``."""
        return self.full(self.zero, shape, grad_dtype, device)

    def ones(self, shape: Sequence[int], grad_dtype: torch.dtype, device) -> State:
        """The semiring's one (the empty path) in every entry of ``shape``."""
        return self.full(self.one, shape, grad_dtype, device)

    def is_zero(self, a: State) -> Tensor:
        """Boolean mask of entries equal to the semiring zero (no path)."""
        out = None
        for c, z in zip(a, self.zero, strict=True):
            hit = c == z
            out = hit if out is None else out & hit
        return out

    def where(self, cond: Tensor, a: State, b: State) -> State:
        """``a`` where ``cond`` holds, ``b`` elsewhere, component by component."""
        return tuple(torch.where(cond, x, y) for x, y in zip(a, b, strict=True))

    # --- derived operations (override for speed) ----------------------------------------------
    def scale(self, a: State, w: Tensor) -> State:
        """``a ⊗ lift(w)`` elementwise with broadcasting: multiply messages by edge weights."""
        return self.times(a, self.lift(w))

    def scale_owned(self, a: State, w: Tensor) -> State:
        """``scale``, free to overwrite ``w``: a fresh tensor of edge weights the caller gives up.

        Elementwise rules hand over their edge weights this way so that a semiring can build the
        new state in their memory, one message-sized temporary fewer at the rule's peak.
        """
        return self.scale(a, w)

    # --- edge weights in log form (derived operations, see DERIVED_OPERATIONS) -------------------
    def lift_log(self, log_abs: Tensor, sign: Sign = 1.0) -> State:
        """``lift(w)`` for ``w = sign * exp(log_abs)``, elementwise with broadcasting.

        ``log_abs`` is ``log|w|``: ``-inf`` exactly where there is no edge (a structural zero),
        NaN for a NaN derivative. ``sign`` is -1 or +1 where there is an edge (its value where
        ``log_abs`` is ``-inf`` does not matter; 0 by convention), or one number for all edges.
        The default lifts the linear weight, so it underflows where ``exp(log_abs)`` does.
        """
        return self.lift(linear_from_log(log_abs, sign))

    def scale_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        """``a ⊗ lift_log(log_abs, sign)``: ``scale`` with the edge weights in log form."""
        return self.times(a, self.lift_log(log_abs, sign))

    def scale_log_owned(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        """``scale_log``, free to overwrite ``log_abs`` (a fresh tensor the caller gives up), so
        that the new state can be built in its memory (see ``scale_owned``)."""
        return self.scale_log(a, log_abs, sign)

    def matmul_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        """``matmul(a, w)`` with ``w = sign * exp(log_abs)`` given in log form ([..., k, j])."""
        return self.matmul(a, linear_from_log(log_abs, sign))

    def uses_edge_signs(self) -> bool:
        """Whether the log-form operations read ``sign`` (a rule may then skip computing signs
        and pass 1.0). True unless the log-form operations are a built-in's that ignore it."""
        return True

    def matmul(self, a: State, w: Tensor) -> State:
        """``out[..., i, j] = ⊕_k a[..., i, k] ⊗ lift(w[..., k, j])`` (message on the left).

        The default broadcasts and plus-reduces in blocks, so it never holds more than
        ``BLOCK_ELEMENTS`` broadcast entries per component at once.
        """
        return blocked_matmul(self, a, w)

    def has_lifted_matmul(self) -> bool:
        """Whether ``matmul_lifted`` has a form here (a caller may then lift a tensor once and
        multiply by many slices of it, as the taps of a convolution do)."""
        return False

    def matmul_lifted(self, a: State, lifted: State) -> State:
        """``matmul(a, w)`` given ``lifted = lift(w)`` (see ``has_lifted_matmul``)."""
        raise NotImplementedError(f"{self.name} has no matmul on lifted weights")

    def index_plus(self, dest: State, dim: int, index: Tensor, src: State) -> State:
        """``dest[..., index[i], ...] ⊕= src[..., i, ...]`` along ``dim`` (out of place).

        The default uses only the primitives: the sources are grouped by destination into a
        [..., size, m] table (m = the largest number of sources one destination receives, the
        gaps filled with the semiring zero), plus-reduced over m with ``sum`` and added to
        ``dest``. Memory is O(size * m) per leading entry, never O(n * size). Built-in semirings
        override it with scatter-reduce kernels.
        """
        index = index.reshape(-1)
        n, size = index.numel(), dest[0].shape[dim]
        if n == 0:
            return dest
        counts = torch.bincount(index, minlength=size)
        width = int(counts.max())
        order = torch.argsort(index, stable=True)
        grouped = index[order]
        rank = torch.arange(n, device=index.device) - (counts.cumsum(0) - counts)[grouped]
        # table[d * width + r] = which source is the r-th to reach destination d (n: none)
        table = torch.full((size * width,), n, dtype=torch.long, device=index.device)
        table[grouped * width + rank] = order
        moved = tuple(c.movedim(dim, -1) for c in src)
        padding = self.zeros((*moved[0].shape[:-1], 1), _state_grad_dtype(src), index.device)
        padded = tuple(torch.cat([c, z], -1) for c, z in zip(moved, padding, strict=True))
        lead = padded[0].shape[:-1]
        gathered = tuple(c[..., table].reshape(*lead, size, width) for c in padded)
        reduced = self.sum(gathered, [len(lead) + 1])
        return self.plus(dest, tuple(c.movedim(-1, dim) for c in reduced))

    # --- fast paths of the message math (derived operations, see DERIVED_OPERATIONS) ----------
    # The generic message math of ``semipack.messages`` (softmax rows, normalisation rows,
    # shared-shift products) asks the semiring for these; the defaults answer "no fast form"
    # (None / False) or compute the generic version from the primitives.
    def lift_is_multiplicative(self) -> bool:
        """Whether ``lift(a * b) = lift(a) ⊗ lift(b)``, with exact zeros lifting to the zero.

        Message math that factors edge weights (separable interpolation maps, the diagonal plus
        rank-one Jacobians of softmax) relies on it; without it the caller contracts the full
        Jacobian. A user ``lift`` need not be multiplicative, so the default is False.
        """
        return False

    def prefix_plus(self, a: State, dim: int) -> State:
        """``out[i] = ⊕_{j <= i} a[j]`` along ``dim`` (cumsum's messages).

        The default is a left-to-right scan with ``plus``: one call per entry along ``dim``;
        built-in semirings override it with a cumulative kernel (cumsum, cummax, ...).
        """
        if a[0].shape[dim] == 0:
            return a
        running = tuple(p.select(dim, 0) for p in a)
        outs = [running]
        for i in range(1, a[0].shape[dim]):
            running = self.plus(running, tuple(p.select(dim, i) for p in a))
            outs.append(running)
        return tuple(torch.stack(c, dim) for c in zip(*outs, strict=True))

    def exclusive_plus(self, a: State) -> State | None:
        """``out_j = ⊕_{i != j} a_i`` along the last dim of a [rows, n] state in O(n) per row,
        or None where this semiring has no such form (the caller then contracts the dense
        Jacobian: softmax rows need it only together with ``lift_is_multiplicative``).

        A fast form must not subtract an entry's own term from the row total (that cancels for
        max-like semirings and for a dominant term in sums); see ``kernels.exclusive``.
        """
        return None

    def softmax_closed_form(
        self, m: State, probs: Tensor, log_probs: Tensor | None
    ) -> State | None:
        """Messages through softmax rows by this semiring's own formula or kernel, or None for
        the generic diagonal-plus-rank-one form (``messages.rowwise``). ``m``, ``probs``
        [rows, n]; ``log_probs`` the exact log-probabilities where the caller knows them."""
        return None

    def log_softmax_closed_form(self, m: State, log_probs: Tensor) -> State | None:
        """Messages through log_softmax rows by this semiring's own formula, or None for the
        generic form (``messages.rowwise``). ``m``, ``log_probs`` [rows, n]."""
        return None

    def is_max_plus(self) -> bool:
        """Whether the state is one log-magnitude tensor that ``plus`` combines by max and
        ``times`` by addition, with ``lift`` = log|w| (MaxProd's algebra): kernels written for
        max-plus products (a convolution's, ``rules.convolution``) then apply."""
        return False

    def is_max_plus_with_ids(self) -> bool:
        """Whether the state is MaxProd's log-magnitude and a successor id per entry, the id of
        the first candidate attaining each max (TopPath's algebra; ties keep the first)."""
        return False

    def compiles_rowwise(self) -> bool:
        """Whether the generic softmax form may run as one compiled kernel for this semiring on
        large rows (float components). The kernel is kept across calls, built for
        ``kernel_owner(self, "compiles_rowwise")``: the built-in class or this instance."""
        return False

    def normalization_closed_form(
        self, m: State, x_hat: Tensor, rstd: Tensor, gain: Tensor, gain_per_row: bool
    ) -> State | None:
        """Messages through normalisation rows by this semiring's own formula, or None (the
        caller tries ``normalization_kernel``, then the dense Jacobian). ``m``, ``x_hat``
        [rows, n]; ``rstd`` [rows]; ``gain`` [n], [rows] (``gain_per_row``) or [rows, n]."""
        return None

    def normalization_kernel(self) -> CentredPairsKernel | None:
        """This semiring's fused kernels for ``⊕_i m_ri ⊗ lift(J'_rij)`` over a normalisation
        layer's centred Jacobian J' (``kernels.normalization``), or None: dense Jacobian."""
        return None

    def affine_params_kernel(self) -> Callable[..., AffineParams] | None:
        """This semiring's fused expression for the gain's and bias's messages of a
        per-channel affine map (``kernels.affine_params``: ``(*m, x, mean, invstd)`` ->
        (gain, bias, the channels to recompute with the generic ops or None)), or None: the
        generic ``scale`` and ``sum``."""
        return None

    def shared_shift_products(
        self,
        m: State,
        right: Tensor | None = None,
        left: Tensor | None = None,
        want_sum: bool = False,
        left_log: Tensor | None = None,
    ) -> Products | None:
        """``(m ⊗ right, mᵀ ⊗ left, ⊕ of m over dim -2)`` from one shared shift of ``m``
        (``kernels.shared_shift``), or None where this semiring has no such form or ``m``
        spans too many nats. Shapes and operands as ``messages.shared_shift_products``; the
        caller repairs underflowed entries."""
        return None

    def shared_shift_conv(
        self, m: State, sums: ConvolutionSums, mask: Sequence[bool]
    ) -> Products | None:
        """A convolution's (input, weight, bias) messages from the output message ``m`` with
        one shared shift, through ``sums`` (non-negative operands), or None (see
        ``shared_shift_products``). ``mask`` says which of the three to compute."""
        return None


def _state_grad_dtype(a: State) -> torch.dtype:
    """A gradient dtype whose state dtype is that of ``a`` (for building zeros like ``a``)."""
    return next((c.dtype for c in a if c.is_floating_point()), torch.float32)


def _make_total(cls: type) -> None:
    """Wrap the ``sum`` / ``matmul`` / ``matmul_lifted`` that ``cls`` itself defines (empty
    reductions give the zero, a sum over no dim the state) and its log-form operations
    (``NO_EDGE_LOG`` cuts)."""
    for name, wrap in (
        ("sum", _empty_sum_is_zero),
        ("matmul", _empty_product_is_zero),
        ("matmul_lifted", _empty_product_is_zero),
        ("lift_log", _vanishing_weights_cut(0, in_place=False)),
        ("scale_log", _vanishing_weights_cut(1, in_place=False)),
        ("matmul_log", _vanishing_weights_cut(1, in_place=False)),
        ("scale_log_owned", _vanishing_weights_cut(1, in_place=True)),
    ):
        fn = cls.__dict__.get(name)
        if fn is not None and not getattr(fn, "_total", False):
            total = wrap(fn)
            total._total = True
            setattr(cls, name, total)


def cut_vanishing(log_abs: Tensor, in_place: bool = False) -> Tensor:
    """``log_abs`` with every entry below ``NO_EDGE_LOG`` set to ``-inf`` (no edge).

    Eagerly on the CPU, a tensor with nothing to cut is returned as it is (no write). Inside a
    compiled kernel the fill is unconditional, since a data-dependent branch would split the
    kernel into pieces that recompile per call pattern, and so it is on a GPU, where reading
    the branch's condition back stalls the kernel queue (``logspace.checks_on_host``). The
    values are the same either way."""
    vanishing = log_abs < NO_EDGE_LOG
    shortcut = not torch.compiler.is_compiling() and logspace.checks_on_host(log_abs)
    if shortcut and not bool(vanishing.any()):
        return log_abs
    if in_place:
        return log_abs.masked_fill_(vanishing, -math.inf)
    return log_abs.masked_fill(vanishing, -math.inf)


def _vanishing_weights_cut(position: int, in_place: bool):
    """Wrap a log-form operation so that its ``log_abs`` argument (``position`` among the
    arguments after ``self``) goes through ``cut_vanishing`` first."""

    def wrap(fn):
        @functools.wraps(fn)
        def cut(self: Semiring, *args: Any, **kwargs: Any) -> Any:
            if "log_abs" in kwargs:
                kwargs["log_abs"] = cut_vanishing(kwargs["log_abs"], in_place)
            elif len(args) > position:
                args = (
                    *args[:position],
                    cut_vanishing(args[position], in_place),
                    *args[position + 1 :],
                )
            return fn(self, *args, **kwargs)

        return cut

    return wrap


def _empty_sum_is_zero(sum_fn):
    @functools.wraps(sum_fn)
    def total_sum(self: Semiring, a: State, dims: list[int], keepdim: bool = False) -> State:
        if not dims:  # a sum over no dim is the state itself (torch's reductions read [] as
            return tuple(c.clone() for c in a)  # every dim, or refuse it, op by op)
        shape = a[0].shape
        if not any(shape[d] == 0 for d in dims):
            return sum_fn(self, a, dims, keepdim)
        out = [1 if d in dims else s for d, s in enumerate(shape)]
        if not keepdim:
            out = [s for d, s in enumerate(out) if d not in dims]
        return self.zeros(out, _state_grad_dtype(a), a[0].device)

    return total_sum


def _empty_product_is_zero(matmul_fn):
    @functools.wraps(matmul_fn)
    def total_matmul(self: Semiring, a: State, w: Any) -> State:
        if a[0].shape[-1] != 0:
            return matmul_fn(self, a, w)
        right = w[0] if isinstance(w, tuple) else w
        batch = broadcast_shapes(a[0].shape[:-2], right.shape[:-2])
        shape = (*batch, a[0].shape[-2], right.shape[-1])
        return self.zeros(shape, _state_grad_dtype(a), a[0].device)

    return total_matmul


def linear_from_log(log_abs: Tensor, sign: Sign) -> Tensor:
    """``sign * exp(log_abs)``: the linear edge weight (0 where ``log_abs`` is ``-inf``)."""
    w = log_abs.exp()
    if isinstance(sign, Tensor):
        return w.mul_(sign) if w.shape == broadcast_shapes(w.shape, sign.shape) else w * sign
    return w if sign == 1 else w.mul_(sign)


def on_memory_of(t: Tensor) -> Tensor:
    """A new tensor object on ``t``'s memory (same shape and strides): the result is a new
    value, so weak references to ``t`` and memos keyed by its identity end with ``t``."""
    return logspace.on_memory(t, t.shape, t.stride())


def _rows_over(zero_row: Tensor, n: int, rows: Tensor, values: Tensor, into: Any) -> Tensor:
    """An ``n``-row readout: ``values`` at ``rows``, the zero's readout ``zero_row`` ([1, ...])
    elsewhere; written into ``into`` where it fits (see ``Semiring.readout_sparse``)."""
    full = zero_row.expand(n, *zero_row.shape[1:])  # KBest adds a k axis
    out = on_memory_of(into).copy_(full) if fits(into, full) else full.clone()
    out[rows] = values
    return out


def fits(out: Any, like: Tensor) -> bool:
    """Whether ``out`` is a plain tensor that can take ``like``'s values in place: same shape,
    dtype and device, contiguous, outside autograd."""
    return (
        type(out) is Tensor
        and out.shape == like.shape
        and out.dtype == like.dtype
        and out.device == like.device
        and out.is_contiguous()
        and not out.requires_grad
    )


@dataclasses.dataclass(frozen=True)
class SparseRows:
    """A state of ``shape`` that is the semiring zero outside ``rows`` (sorted, distinct
    indices along dim 0), kept as those rows only: ``parts`` has one tensor per component,
    shaped ``[len(rows), *shape[1:]]``. An embedding table's message from a batch that looks
    up a few of its tens of thousands of rows; ``dense`` builds the full state when an op
    needs it, ``Semiring.readout_sparse`` reads it without."""

    rows: Tensor
    parts: State
    shape: tuple[int, ...]
    grad_dtype: torch.dtype

    def dense(self, sr: Semiring) -> State:
        """The full state: the semiring zero, with ``parts`` placed at ``rows``."""
        full = sr.zeros(self.shape, self.grad_dtype, self.rows.device)
        return tuple(f.index_copy_(0, self.rows, c) for f, c in zip(full, self.parts, strict=True))


def _distinct_lookups(
    sr: Semiring, shape: Sequence[int], dim: int, index: Tensor, src: State, grad_dtype
) -> tuple[Tensor, State]:
    """``(rows, compact)``: the distinct indices (sorted) and, for each, the semiring sum of
    the lookups ``src`` that hit it, shaped like ``shape`` with ``len(rows)`` along ``dim``."""
    # int64 rows whatever the ids' dtype (embedding takes int32 ids; index_copy_ needs int64)
    rows, inverse = torch.unique(index.long(), return_inverse=True)
    compact_shape = list(shape)
    compact_shape[dim] = rows.numel()
    zeros = sr.zeros(compact_shape, grad_dtype, index.device)
    return rows, sr.index_plus(zeros, dim, inverse, src)


def sparse_rows(
    sr: Semiring, shape: Sequence[int], index: Tensor, src: State, grad_dtype
) -> SparseRows:
    """``index_plus`` along dim 0 into a zero state of ``shape``, kept sparse: the lookups
    ``src`` (``[len(index), *shape[1:]]``) are reduced into one row per distinct index."""
    rows, compact = _distinct_lookups(sr, shape, 0, index, src, grad_dtype)
    return SparseRows(rows, tuple(compact), tuple(shape), grad_dtype)


def scatter_into_zeros(
    sr: Semiring, shape: Sequence[int], dim: int, index: Tensor, src: State, grad_dtype
) -> State:
    """``index_plus`` into a fresh zero state, touching only the rows ``index`` names.

    An embedding table has tens of thousands of rows and a batch looks up a few: reducing the
    lookups into one row per distinct index first, then placing those rows, keeps the work
    proportional to the batch instead of the table.
    """
    rows, compact = _distinct_lookups(sr, shape, dim, index, src, grad_dtype)
    full = sr.zeros(shape, grad_dtype, index.device)
    return tuple(f.index_copy_(dim, rows, c) for f, c in zip(full, compact, strict=True))


def blocked_matmul(sr: Semiring, a: State, w: Tensor) -> State:
    """Semiring matmul by broadcast-and-reduce over bounded blocks of rows and columns."""
    n, m = a[0].shape[-2], w.shape[-1]
    batch = broadcast_shapes(a[0].shape[:-2], w.shape[:-2])
    if n == 0 or m == 0:
        return sr.zeros((*batch, n, m), w.dtype, w.device)
    return blocked_lifted_matmul(sr, a, sr.lift(w))


def blocked_lifted_matmul(sr: Semiring, a: State, lifted: State) -> State:
    """``out[..., i, j] = ⊕_k a[..., i, k] ⊗ lifted[..., k, j]`` for already lifted weights, by
    broadcast-and-reduce over blocks of at most ``BLOCK_ELEMENTS`` products."""
    n, k = a[0].shape[-2], a[0].shape[-1]
    m = lifted[0].shape[-1]
    batch = broadcast_shapes(a[0].shape[:-2], lifted[0].shape[:-2])
    per_row = max(1, k * m * max(1, _numel(batch)))
    if per_row <= BLOCK_ELEMENTS:
        rows, cols = max(1, BLOCK_ELEMENTS // per_row), m
    else:
        rows = 1
        cols = max(1, BLOCK_ELEMENTS // max(1, k * max(1, _numel(batch))))
    out_rows = []
    for r0 in range(0, n, rows):
        a_blk = tuple(c[..., r0 : r0 + rows, :, None] for c in a)
        out_cols = []
        for c0 in range(0, m, cols):
            w_blk = tuple(c[..., None, :, c0 : c0 + cols] for c in lifted)
            out_cols.append(sr.sum(sr.times(a_blk, w_blk), [_ndim(a_blk, w_blk) - 2]))
        out_rows.append(tuple(torch.cat(parts, -1) for parts in zip(*out_cols, strict=True)))
    return tuple(torch.cat(parts, -2) for parts in zip(*out_rows, strict=True))


def repair_underflow(
    sr: Semiring,
    a: State,
    lifted: State | Callable[[], State],
    out: State,
    shift: Tensor | float | None = None,
    edges: Callable[[], Tensor] | None = None,
) -> State:
    """Entries of a fast product ``out = a ⊗ lifted`` that underflowed in its BLAS form.

    The BLAS forms of the sum-like semirings shift the message (by its row maxima, or one global
    maximum) and exponentiate, so a sum of products far below the shift (a weight of 1e-30
    meeting a message 40 nats down) underflows: to 0, which would read as "no path" (rounding
    would cut a path), or to a subnormal number with few significant bits. Entries whose
    shifted sum fell below ``precise_log_floor`` (or is zero) while their row has a path and
    their column an edge are recomputed with the exact log-domain definition
    (``blocked_lifted_matmul``), by rows, or by columns where fewer entries are recomputed
    that way (each entry's sum is the same either way). ``shift`` is what was subtracted in log
    space (broadcastable to ``out``); None checks exact zeros only. ``lifted`` may be a function
    that lifts the weights, called only when some entry needs the check; ``edges`` one that
    gives which columns of ``lifted`` hold an edge ([..., 1, m] bool), when that is known
    without lifting (``kept_edge_columns``).
    ``a`` [..., n, k], ``lifted`` [..., k, m], ``out`` [..., n, m].
    """
    floor = precise_log_floor(out[0].dtype)
    if _none_below(out[0], shift, floor):
        return out
    low = sr.is_zero(out) if shift is None else (out[0] - shift) < floor
    if not bool(low.any()):
        return out
    row_has_path = (~sr.is_zero(a)).any(-1, keepdim=True)
    low = low & row_has_path
    if not bool(low.any()):  # the low entries are rows without a path (a token no loss
        return out  # reads): no column needs its edges, nor the weights their lift
    if edges is None:
        lifted = lifted() if callable(lifted) else lifted
        col_has_edge = _edge_columns(sr, lifted)
    else:
        col_has_edge = edges()
    suspect = low & col_has_edge
    if not bool(suspect.any()):
        return out
    if callable(lifted):
        lifted = lifted()
    n, k, m = a[0].shape[-2], a[0].shape[-1], lifted[0].shape[-1]
    batch = broadcast_shapes(a[0].shape[:-2], lifted[0].shape[:-2])
    size = _numel(batch)
    flat_a = tuple(c.expand(*batch, n, k).reshape(size, n, k) for c in a)
    flat_w = tuple(c.expand(*batch, k, m).reshape(size, k, m) for c in lifted)
    fixed = tuple(c.expand(*batch, n, m).reshape(size, n, m).clone() for c in out)
    flat_suspect = suspect.expand(*batch, n, m).reshape(size, n, m)
    for b in flat_suspect.any(-1).any(-1).nonzero().flatten().tolist():
        rows = flat_suspect[b].any(-1).nonzero().flatten()
        cols = flat_suspect[b].any(-2).nonzero().flatten()
        if cols.numel() * n < rows.numel() * m:
            # the suspects lie in a few columns: recompute those (causal attention's last key
            # meets only the last query, whose message may be no path: one column of every
            # head's value message is an exact zero, and whole rows recomputed every entry)
            exact = blocked_lifted_matmul(
                sr, tuple(c[b] for c in flat_a), tuple(c[b][:, cols] for c in flat_w)
            )
            for f, e in zip(fixed, exact, strict=True):
                f[b][:, cols] = e.to(f.dtype)
            continue
        exact = blocked_lifted_matmul(
            sr, tuple(c[b, rows] for c in flat_a), tuple(c[b] for c in flat_w)
        )
        for f, e in zip(fixed, exact, strict=True):
            f[b, rows] = e.to(f.dtype)
    return tuple(f.reshape(*batch, n, m) for f in fixed)


def uses_methods_of(sr: Semiring, cls: type, *methods: str) -> bool:
    """Whether ``sr`` has ``cls``'s own ``methods``: a subclass that redefines one of them (a
    lift reading settings of its own, another plus) must not get the fast path written for
    ``cls`` (kept lifts, max-plus kernels)."""
    return all(getattr(type(sr), name) is getattr(cls, name) for name in methods)


def lift_key(sr: Semiring) -> Hashable | None:
    """The key of ``sr``'s kept lifts: its ``lift_cache_key`` beside the class whose ``lift``
    it is, so that two semirings with keys of their own (two user classes returning ``()``)
    never share a lift; None where ``sr`` keeps none."""
    key = sr.lift_cache_key()
    if key is None:
        return None
    return next(c for c in type(sr).__mro__ if "lift" in c.__dict__), key


#: What a class body may define, besides its constructor and special methods, without touching
#: the algebra: its readouts.
_READOUT_ONLY = frozenset({"readout", "readout_into", "readout_sparse"})


def kernel_owner(sr: Semiring, operation: str) -> type[Semiring] | Semiring:
    """What a kernel for ``sr``'s fast path ``operation`` is built from, where the kernel is kept
    across calls (compiled once): ``sr``'s built-in class, whose fresh instance it then serves
    (a built-in instance's settings, such as ``log``, only change its readout), or ``sr``
    itself. A user's subclass gets its built-in class only where its own classes change nothing
    but readouts and leave the built-in settings at their defaults; otherwise the instance,
    for which callers keep no kernel and run the eager forms, which read its own methods and
    settings (a temperature read by ``magnitude``, a ``k``): never a fresh instance that would
    lack its settings or could not be made (required arguments)."""
    cls = type(sr)
    built_in = next(c for c in cls.__mro__ if c.__module__.startswith("semipack."))
    if built_in is cls:
        return cls
    for c in cls.__mro__[: cls.__mro__.index(built_in)]:
        own = {n for n in c.__dict__ if not (n.startswith("__") and n.endswith("__"))}
        if operation in c.__dict__ or own - _READOUT_ONLY:
            return sr
    try:
        fresh = built_in()
    except TypeError:
        return sr
    settings = {k: v for k, v in vars(fresh).items() if k != "trace"}
    return built_in if all(getattr(sr, k, None) == v for k, v in settings.items()) else sr


def _none_below(out: Tensor, shift: Tensor | float | None, floor: float) -> bool:
    """Whether no entry of ``out - shift`` is below ``floor``, from one reduction, where
    ``shift`` is one number or one per row (``[..., n, 1]`` beside ``out`` [..., n, m], the
    row maxima of a per-product shift): rounding ``x - s`` is monotone in ``x``, so the
    smallest difference in a row is its smallest entry's difference. A NaN minimum proves
    nothing (the comparison is False)."""
    if shift is None or out.numel() == 0:
        return False
    if not isinstance(shift, Tensor) or shift.numel() == 1:
        lowest = out.amin() - shift
        return bool(lowest >= floor)
    if out.dim() < 2 or shift.dim() > out.dim() or shift.shape[-1] != 1:
        return False
    rows = out.amin(-1, keepdim=True)
    if broadcast_shapes(rows.shape, shift.shape) != rows.shape:
        return False  # a shift that would broadcast the rows: the full check
    return bool(((rows - shift) >= floor).all())


def _edge_columns(sr: Semiring, lifted: State) -> Tensor:
    return (~sr.is_zero(lifted)).any(-2, keepdim=True)


def kept_edge_columns(sr: Semiring, w: Tensor) -> Tensor:
    """Which columns of the weights ``w`` [..., k, m] hold an edge, as ``[..., 1, m]`` bools,
    kept across passes like ``Semiring.kept_lift`` (the check of ``repair_underflow`` then
    reads no weight-sized tensor)."""
    key = lift_key(sr)
    if key is None:
        return _edge_columns(sr, sr.lift(w))
    return WEIGHTS.derived(w, ("edge columns", key), lambda: _edge_columns(sr, sr.kept_lift(w)))


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _ndim(a: State, b: State) -> int:
    return max(a[0].dim(), b[0].dim())


_make_total(Semiring)


def index_reduce(dest: Tensor, dim: int, index: Tensor, src: Tensor, reduce: str) -> Tensor:
    """``dest.index_reduce(dim, index, src, reduce, include_self=True)`` via ``scatter_reduce``
    (stable API): ``index`` is 1-D along ``dim`` and broadcast over the other dims of ``src``."""
    shape = [1] * src.dim()
    shape[dim] = -1
    return dest.scatter_reduce(
        dim, index.view(shape).expand_as(src), src, reduce, include_self=True
    )
