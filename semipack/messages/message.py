"""The tensor subclass that carries a semiring message through the autograd engine.

autograd hands a ``Message`` to every backward formula as if it were the incoming gradient. Each
aten op the formula applies to it lands in ``__torch_dispatch__``, which looks up the op's rule:
the rule computes the regular gradient (``regular_grad``) with the op itself, and the semiring state
(``parts``) with the semiring's plus and times. The engine's own accumulation (``aten.add``)
becomes the semiring's plus the same way.

``OpCall`` is the call object every rule receives; it lives here with ``Message`` because each
needs the other (a call unwraps and wraps messages, a message dispatches to a call).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import (
    COMPLEX_VALUES,
    RULE_DEFECT,
    MessageLostError,
    SemipackError,
    StateShapeError,
    UnsupportedOpError,
)
from ..graph.provenance import current_site, root_class
from ..semirings.base import Semiring, SparseRows, State
from ..semirings.product import Product
from .donation import NONE, donations
from .rule_table import rule_for


class Message(torch.Tensor):
    """A backward message: the regular gradient (optional) and the semiring state of a tensor.

    Attributes:
        regular_grad: the regular gradient, or ``None`` when regular gradients are switched off.
        parts: the semiring state, one tensor per component, each of the message's shape.
        semiring: the semiring the state belongs to.
    """

    regular_grad: Tensor | None
    semiring: Semiring
    #: The state kept as its non-zero rows (``SparseRows``) until an op needs the full state:
    #: the embedding extension's message to its table. None once ``parts`` was built.
    sparse: SparseRows | None

    @staticmethod
    def __new__(
        cls,
        regular: Tensor | None,
        parts: State | SparseRows,
        semiring: Semiring,
        dtype: torch.dtype | None = None,
    ) -> Message:
        sparse = parts if isinstance(parts, SparseRows) else None
        if dtype is None:
            if regular is None:
                raise ValueError("a Message without a regular gradient needs an explicit dtype")
            dtype = regular.dtype
        layout = torch.strided
        if regular is not None and regular.layout != torch.strided:
            # a sparse regular gradient (``nn.Embedding(sparse=True)``): the message takes its
            # layout, which the engine checks against what a leaf's hook returns
            shape, strides, device, layout = regular.shape, None, regular.device, regular.layout
        elif regular is not None:
            shape, strides, device = regular.shape, regular.stride(), regular.device
        elif sparse is not None:
            shape, strides, device = torch.Size(sparse.shape), None, sparse.rows.device
        else:
            shape, strides, device = parts[0].shape, parts[0].stride(), parts[0].device
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=strides,
            dtype=dtype,
            device=device,
            layout=layout,
            requires_grad=False,
        )
        self.regular_grad = regular
        self.sparse = sparse
        self._parts = None
        if sparse is None:
            for p in parts:
                if p.shape != shape:  # never broadcast: that would copy one entry's paths
                    raise StateShapeError(
                        f"a semiring state of shape {tuple(p.shape)} for a message of shape "
                        f"{tuple(shape)}"
                    )
            self._parts = tuple(parts)
        self.semiring = semiring
        return self

    @property
    def parts(self) -> State:
        """The semiring state, one tensor per component, each of the message's shape (built
        from ``sparse`` the first time an op reads it)."""
        if self._parts is None:
            self._parts = self.sparse.dense(self.semiring)
            self.sparse = None
        return self._parts

    def stored_state(self) -> State | SparseRows:
        """The state in the form it is kept: ``sparse`` while that stands, else ``parts``."""
        return self.sparse if self.sparse is not None else self._parts

    def __init__(self, *args, **kwargs) -> None:  # attributes are set in __new__
        super().__init__()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        """A message has no numpy form: its semiring state is not a gradient."""
        node, _module = current_site()
        where = f" in the backward of {node}" if node else ""
        raise SemipackError(
            f"a semiring message cannot be converted to numpy{where}: it carries a semiring "
            "state, not a gradient. A custom autograd.Function whose backward goes through "
            "numpy cannot run inside semipack.extend; write its backward with torch ops that "
            "are linear in the incoming gradient"
        )

    def __repr__(self) -> str:  # printing must not dispatch ops on the wrapper
        return (
            f"Message({self.semiring!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"regular_grad={'yes' if self.regular_grad is not None else 'no'})"
        )

    @classmethod
    def seed(cls, gradient: Tensor, semiring: Semiring, regular: bool) -> Message:
        """The message at a backward root: the given gradient, lifted as edge weights.

        For the usual scalar loss the gradient is 1, which lifts to the semiring's one.
        """
        gradient = gradient.detach()
        return cls(gradient if regular else None, semiring.lift(gradient), semiring, gradient.dtype)


#: The identity node PyTorch puts around the inputs and outputs of a module with full backward
#: hooks or backward pre-hooks; the hooks run as its post hooks (``transport.hooks``). A failing
#: op there is the user's hook, not a formula.
MODULE_HOOK_NODE = "BackwardHookFunctionBackward"


def unsupported(func: OpOverload, reason: str = "") -> UnsupportedOpError:
    """The error for ``func`` reaching a message without a usable rule, naming the autograd
    node and module that made the call, with the likely cause when there is no node."""
    node, module = current_site()
    if node is None and not reason:
        reason = (
            "a semiring message was used outside the backward pass. It leaked into user code "
            "through a gradient hook or retain_grad() set up before entering semipack.extend "
            "(set them up inside the block, where they see regular gradients), or through a "
            ".grad read after semipack.grad"
        )
    if not reason and _makes_complex(func):
        reason = (
            "it makes complex values from the message (the backward of a complex tensor's "
            "real view: an FFT, torch.view_as_complex, torch.complex or torch.polar in the "
            "forward, or a tensor's .real / .imag). semipack refuses complex graphs: write "
            "the model's complex arithmetic with real tensors (real and imaginary parts) to "
            f"analyse it {COMPLEX_VALUES}"
        )
    if node == MODULE_HOOK_NODE and not reason:
        reason = (
            "a module backward hook received a semiring message: semipack's passes show module "
            "hooks the regular gradient, so this pass was started some other way (a "
            "torch.autograd call seeded with a Message)"
        )
    if node is not None and not reason and _is_custom_function(node):
        reason = (
            f"{node} is the backward of a custom torch.autograd.Function, which semipack runs on "
            "the semiring message; its ops on the incoming gradient must be linear in it "
            "(scaling by plain tensors, indexing, sums, products with plain matrices). An op "
            "like clamp, sign or abs of the gradient has no semiring meaning"
        )
    return UnsupportedOpError(
        str(func), node, module, reason, root_class() if module == "" else None
    )


def _makes_complex(func: OpOverload) -> bool:
    """Whether ``func`` returns a complex tensor from real ones, by its schema's name (the
    backward of ``view_as_real`` is ``view_as_complex``; FFTs of real input run ``_fft_r2c``)."""
    name = func.name()
    return any(word in name for word in ("view_as_complex", "complex", "polar", "_fft_r2c"))


def _is_custom_function(node: str) -> bool:
    """Built-in autograd nodes are named ``<Op>Backward<N>``; a custom Function's node is its
    class name plus ``Backward``."""
    return node.endswith("Backward") and node != MODULE_HOOK_NODE


def dispatch(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run the rule registered for ``func`` on a call that involves messages (for a
    ``Product`` message: once per factor, see ``dispatch_product``)."""
    rule = rule_for(func)
    if rule is None:
        raise unsupported(func)
    # before any local name refers to the message: the reference counts are calibrated so
    donated = donations(args) if rule in DONATION_RULES and args else NONE
    first = _first_message(args, kwargs)
    if first is not None and isinstance(first.semiring, Product):
        return dispatch_product(rule, func, args, kwargs, first.semiring, donated)
    out = rule(OpCall(func, args, kwargs, donated))
    if out is None and func._schema.returns:
        raise unsupported(func, f"its rule returned None {RULE_DEFECT}")
    return out


def _first_message(args: tuple, kwargs: dict) -> Message | None:
    """The first message among the arguments and the lists among them (aten calls nest no
    deeper), without flattening the whole call: this runs on every op of every pass."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, Message):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, Message):
                    return b
    return None


#: rule -> the function that computes its regular result from the call's whole messages
#: (``register_regular``); ``dispatch_product`` runs it once instead of in the first factor.
RULE_REGULAR: dict[Callable[..., Any], Callable[[OpCall], Any]] = {}


def register_regular(rule: Callable[..., Any], regular: Callable[[OpCall], Any]) -> None:
    """Declare that ``rule``'s regular result is ``regular(call)`` and depends on the
    messages, not only on their regular gradients (the accumulation's layout reads who holds
    a message): a ``Product`` pass computes it from the undivided messages."""
    RULE_REGULAR[rule] = regular


def dispatch_product(
    rule,
    func: OpOverload,
    args: tuple,
    kwargs: dict,
    product: Product,
    donated: frozenset[int] = NONE,
) -> Any:
    """Run ``rule`` once per factor of ``product``: each message replaced by its factor's slice
    of the state (the same tensors: an in-place rule writes into the product's state) under the
    factor's semiring, the regular gradient only in the first factor's call. The outputs'
    slices are joined again; the regular result is the first call's."""
    # A rule whose regular result depends on the messages themselves, not only on their
    # regular gradients (``RULE_REGULAR``), computes it once from the whole messages; the
    # factors then run without regular gradients.
    own_regular = RULE_REGULAR.get(rule)
    regular = own_regular(OpCall(func, args, kwargs)) if own_regular is not None else None
    results = []
    for i, factor in enumerate(product.semirings):

        def narrow(x: Any, i: int = i, factor: Semiring = factor) -> Any:
            if not isinstance(x, Message):
                return x
            carried = x.regular_grad if i == 0 and own_regular is None else None
            return Message(carried, product.split(x.parts)[i], factor, x.dtype)

        call_args, call_kwargs = map_arguments(narrow, args, kwargs)
        results.append(rule(OpCall(func, call_args, call_kwargs, donated)))
    if func._schema.is_mutable and isinstance(args[0], Message):
        return args[0]  # written in place, factor by factor, through the shared tensors
    if isinstance(results[0], Message):  # the common case, without pytree's bookkeeping
        first = results[0]
        states = [first.parts] + [r.parts for r in results[1:]]
        if own_regular is None:
            regular = first.regular_grad
        return Message(regular, product.join(states), product, first.dtype)
    flat, spec = tree_flatten(results[0])
    others = [tree_flatten(r)[0] for r in results[1:]]
    joined = []
    for j, out in enumerate(flat):
        if isinstance(out, Message):
            states = [out.parts] + [o[j].parts for o in others]
            out = Message(out.regular_grad, product.join(states), product, out.dtype)
        joined.append(out)
    return tree_unflatten(joined, spec)


class OpCall:
    """One aten call that involves messages, with helpers shared by all rules."""

    def __init__(
        self, func: OpOverload, args: tuple, kwargs: dict, donated: frozenset[int] = NONE
    ) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        #: ids of the first message's tensors this call may write into (``messages.donation``;
        #: only for rules in ``DONATION_RULES``, empty otherwise)
        self.donated = donated
        flat = flat_arguments(args, kwargs)
        for t in flat:
            if isinstance(t, Tensor) and t.is_complex():
                raise unsupported(
                    func,
                    f"it received a complex tensor ({t.dtype}): semipack refuses complex "
                    "graphs; write the model's complex arithmetic with real tensors (real and "
                    f"imaginary parts, torch.view_as_real) to analyse it {COMPLEX_VALUES}",
                )
        self.messages = [m for m in flat if isinstance(m, Message)]
        first = self.messages[0]
        self.semiring: Semiring = first.semiring
        self.dtype: torch.dtype = first.dtype
        self.device = first.device
        self.has_regular_grad = all(m.regular_grad is not None for m in self.messages)
        for m in self.messages[1:]:
            if type(m.semiring) is not type(self.semiring):
                raise self.error(f"messages of {first.semiring} and {m.semiring} met")
        self._bound: dict[str, Any] | None = None

    # --- arguments ------------------------------------------------------------------------------
    @property
    def bound(self) -> dict[str, Any]:
        """Arguments by schema name, defaults filled in."""
        if self._bound is None:
            out: dict[str, Any] = {}
            args, kwargs = self.args, self.kwargs
            for i, (name, kwarg_only, default) in enumerate(_schema_arguments(self.func)):
                if i < len(args) and not kwarg_only:
                    out[name] = args[i]
                elif name in kwargs:
                    out[name] = kwargs[name]
                else:  # a fresh list per call, as the schema hands out: a rule may change it
                    out[name] = list(default) if isinstance(default, list) else default
            self._bound = out
        return self._bound

    def __getitem__(self, name: str) -> Any:
        bound = self.bound
        if name not in bound:
            raise KeyError(f"{self.func} has no argument {name!r}; its arguments: {list(bound)}")
        return bound[name]

    @property
    def weight_dtype(self) -> torch.dtype:
        """The precision edge weights are built in: the gradient's dtype, at least float32
        (never the dtype of a boolean or integer state component)."""
        return self.semiring.state_dtype(self.dtype)

    def error(self, reason: str = "") -> UnsupportedOpError:
        """An ``UnsupportedOpError`` for this call, with ``reason`` (raise it from a rule)."""
        return unsupported(self.func, reason)

    # --- channels -----------------------------------------------------------------------------
    def run_regular(self, *args, **kwargs) -> Any:
        """The op's ordinary result on the regular gradients (None when they are off).

        With no arguments, re-runs the call as given; otherwise runs ``func(*args, **kwargs)``
        with any Message replaced by its regular gradient.
        """
        if not self.has_regular_grad:
            return None
        if not args and not kwargs:
            args, kwargs = self.args, self.kwargs
        args, kwargs = map_arguments(_regular_of, args, kwargs)
        return self.func(*args, **kwargs)

    def run_regular_donated(self) -> Any:
        """``run_regular()`` of an elementwise op on its first argument, the message, written
        into that message's regular gradient where the call may (``donated``): the op's
        ``out=`` overload computes the same values, and the node then holds one regular
        gradient, as a plain backward does, instead of two."""
        msg = self.args[0] if self.args else None
        regular = msg.regular_grad if isinstance(msg, Message) else None
        out_op = _out_overload(self.func)
        if regular is None or id(regular) not in self.donated or out_op is None:
            return self.run_regular()
        args, kwargs = map_arguments(_regular_of, self.args, self.kwargs)
        for a in flat_arguments(args, kwargs):
            if isinstance(a, Tensor) and (
                a.shape != regular.shape
                or a.dtype != regular.dtype
                or a.stride() != regular.stride()
            ):
                # broadcast, promoted, or laid out otherwise: the op's own result could take
                # another layout (LeakyReLU's follows its input, and on a channels-last map of
                # 1 x 1 the strides of size-1 dims decide), and the ops below it round by it
                return self.run_regular()
        return out_op[0](*args, **kwargs, **{out_op[1]: regular})

    def state(self, x: Any, shape: Sequence[int] | None = None) -> State:
        """The semiring state of an argument in a message slot.

        A plain tensor or number may only stand for "no message" and must be zero: anything else
        would be a gradient with no semiring meaning, so it is an error, not a guess.
        """
        if isinstance(x, Message):
            if x.semiring is not self.semiring and type(x.semiring) is not type(self.semiring):
                raise self.error("mixed semirings")
            return x.parts
        if isinstance(x, Tensor):
            if bool((x != 0).any()):
                node, module = current_site()
                where = f" in the backward of {node}" if node else ""
                if node and module is not None:
                    where += f" (module '{module}')" if module else " (the root module)"
                raise MessageLostError(
                    f"{self.func}{where}: a non-zero plain tensor was combined with a semiring "
                    "message; a backward formula produced a gradient semipack cannot interpret "
                    "(or a tensor retained outside any extend block, h.retain_grad(), holds a "
                    "message in its .grad from a semipack.grad or semiring pass: call "
                    "retain_grad() inside the block)"
                )
            return self.semiring.zeros(x.shape if shape is None else shape, self.dtype, x.device)
        if isinstance(x, (int, float, bool)) and x == 0:
            return self.semiring.zeros(() if shape is None else shape, self.dtype, self.device)
        raise self.error(f"argument {x!r} cannot be a semiring message")

    def wrap(self, regular: Tensor | None, parts: State) -> Message:
        """A message output: regular gradient ``regular`` (or None) and state ``parts``, in this
        call's semiring (which, on a path-recording pass, carries the pass's trace). A state
        whose shape is not the gradient's is an error of the rule, named here: broadcast, it
        would hand one entry's paths to many entries. So is a state with another number of
        components than the semiring's (the extra ones would be dropped unseen)."""
        components = len(self.semiring.components)
        if isinstance(parts, Tensor) or not isinstance(parts, (tuple, list, SparseRows)):
            raise unsupported(
                self.func,
                f"its rule gave wrap() a {type(parts).__name__} as the state, not a tuple of "
                f"{components} tensor(s), one per component of {self.semiring!r} {RULE_DEFECT}",
            )
        if not isinstance(parts, SparseRows) and len(parts) != components:
            raise unsupported(
                self.func,
                f"its rule returned a state of {len(parts)} components, {self.semiring!r} has "
                f"{components} {RULE_DEFECT}",
            )
        try:
            return Message(regular, parts, self.semiring, self.dtype if regular is None else None)
        except StateShapeError as exc:
            raise unsupported(self.func, f"its rule returned {exc} {RULE_DEFECT}") from exc

    def zeros(self, shape: Sequence[int]) -> State:
        """The semiring's zero ("no path") of ``shape``, in the state dtypes and on the device
        of this call."""
        return self.semiring.zeros(shape, self.dtype, self.device)


@functools.cache
def _out_overload(func: OpOverload) -> tuple[OpOverload, str] | None:
    """The ``out=`` overload of ``func`` (same arguments plus one output tensor) and the name of
    its output argument, or None."""
    names = [a.name for a in func._schema.arguments]
    for name in func.overloadpacket.overloads():
        overload = getattr(func.overloadpacket, name)
        arguments = overload._schema.arguments
        outs = [a.name for a in arguments if a.is_out]
        if len(outs) == 1 and [a.name for a in arguments if not a.is_out] == names:
            return overload, outs[0]
    return None


#: Rules that may write into the first message's tensors (``OpCall.donated``); the others get
#: an empty set without the check's cost.
DONATION_RULES: set[Callable[..., Any]] = set()


def accepts_donations(rule: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: ``rule`` receives ``OpCall.donated`` (see ``messages.donation``)."""
    DONATION_RULES.add(rule)
    return rule


@functools.cache
def _schema_arguments(func: OpOverload) -> tuple[tuple[str, bool, Any], ...]:
    """(name, keyword-only, default or None) of ``func``'s schema arguments, read once per op:
    reading a schema through its bindings costs microseconds, on every op of every pass."""
    return tuple(
        (arg.name, arg.kwarg_only, arg.default_value if arg.has_default_value() else None)
        for arg in func._schema.arguments
    )


def flat_arguments(args: tuple, kwargs: dict) -> list[Any]:
    """Every argument of an aten call, lists and tuples opened (aten arguments nest one level:
    ``Tensor[]``, ``int[]``). The hot path of every op of every pass: no pytree machinery."""
    flat: list[Any] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            flat.extend(a)
        else:
            flat.append(a)
    return flat


def map_arguments(fn: Callable[[Any], Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with ``fn`` applied to every argument and every element of a list or
    tuple argument (one level, as ``flat_arguments``); each container keeps its type."""

    def one(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(fn(e) for e in a)
        return fn(a)

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _regular_of(x: Any) -> Any:
    if isinstance(x, Message):
        return x.regular_grad
    return x


def per_component(call: OpCall, slots: Iterable[str]) -> tuple[Any, list[Any]]:
    """Run the op once per state component, with each message slot replaced by that component.

    Non-message arguments are passed unchanged. Used by structural ops (views, copies, cat,
    selection): they move entries around without combining them, so they act on every component
    exactly as on a gradient. Returns (regular result, [result per component]).
    """
    slots = tuple(slots)
    sr = call.semiring
    bound = call.bound
    regular = call.run_regular()
    states: dict[str, Any] = {}
    for name in slots:
        value = bound[name]
        if isinstance(value, (list, tuple)):
            states[name] = [call.state(v) for v in value]
        elif value is not None:
            states[name] = call.state(value)
    outs = []
    for i in range(len(sr.components)):
        kwargs = dict(bound)
        for name, st in states.items():
            kwargs[name] = [s[i] for s in st] if isinstance(st, list) else st[i]
        outs.append(call_by_name(call.func, kwargs))
    return regular, outs


def call_by_name(func: OpOverload, named: dict[str, Any]) -> Any:
    """Call an aten overload with arguments given by schema name."""
    args, kwargs = [], {}
    for arg in func._schema.arguments:
        if arg.kwarg_only:
            kwargs[arg.name] = named[arg.name]
        else:
            args.append(named[arg.name])
    return func(*args, **kwargs)


def wrap_outputs(call: OpCall, regular: Any, outs: list[Any]) -> Any:
    """Zip per-component results (tensor or sequence of tensors) into Message outputs."""
    first = outs[0]
    if isinstance(first, (list, tuple)):
        reals = regular if regular is not None else [None] * len(first)
        return type(first)(call.wrap(r, tuple(o[j] for o in outs)) for j, r in enumerate(reals))
    return call.wrap(regular, tuple(outs))
