"""The table from aten ops to semiring rules, and the call object rules receive.

A rule is a function ``rule(call: OpCall) -> output`` registered for one or more aten overloads
(or whole overload packets). It must return what the op returns, with every output that is a
backward message wrapped as a :class:`Message` (``call.wrap``). Ops without a rule raise
:class:`UnsupportedOpError` naming the op, the autograd node and the module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import MessageLostError, UnsupportedOpError
from ..semirings.base import Semiring, State
from ..transport.message import Message
from ..transport.provenance import current_site

Rule = Callable[["OpCall"], Any]
_RULES: dict[OpOverload | OpOverloadPacket, Rule] = {}


def register_rule(*ops: OpOverload | OpOverloadPacket) -> Callable[[Rule], Rule]:
    """Decorator: use ``rule`` for these aten overloads (a packet covers all its overloads).

    Registering an op that already has a rule replaces it, so users can override built-ins.
    """

    def decorate(rule: Rule) -> Rule:
        for op in ops:
            _RULES[op] = rule
        return rule

    return decorate


#: torch function -> replacement used inside ``semipack.extend`` (extensions on or off): functions
#: whose backward cannot carry messages (it copies the gradient into a fresh plain tensor), which
#: are recorded instead as ops whose backward can, with the same values.
FORWARD_ROUTES: dict[Callable[..., Any], Callable[..., Any]] = {}


def route_forward(*functions: Callable[..., Any]) -> Callable[[Callable], Callable]:
    """Decorator: inside ``semipack.extend`` calls of ``functions`` run the decorated one."""

    def register(replacement: Callable[..., Any]) -> Callable[..., Any]:
        for f in functions:
            FORWARD_ROUTES[f] = replacement
        return replacement

    return register


def rule_for(func: OpOverload) -> Rule | None:
    return _RULES.get(func) or _RULES.get(func.overloadpacket)


def registered_ops() -> list[str]:
    """Names of every op (overload or packet) that has a rule, sorted."""
    return sorted(str(op) for op in _RULES)


#: The node that runs module backward hooks: a failing op there is the user's hook, not a formula.
MODULE_HOOK_NODE = "BackwardHookFunctionBackward"


def unsupported(func: OpOverload, reason: str = "") -> UnsupportedOpError:
    node, module = current_site()
    if node is None and not reason:
        reason = (
            "a semiring message was used outside the backward pass. It leaked into user code "
            "through a gradient hook or retain_grad() set up before entering semipack.extend "
            "(set them up inside the block, where they see regular gradients), or through a "
            ".grad read after semipack.grad"
        )
    if node == MODULE_HOOK_NODE and not reason:
        reason = (
            "a module backward hook received a semiring message, probably because it was "
            "registered inside the semipack.extend block; register module backward hooks "
            "before entering the block (they then see regular gradients)"
        )
    return UnsupportedOpError(str(func), node, module, reason)


def dispatch(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    rule = rule_for(func)
    if rule is None:
        raise unsupported(func)
    return rule(OpCall(func, args, kwargs))


class OpCall:
    """One aten call that involves messages, with helpers shared by all rules."""

    def __init__(self, func: OpOverload, args: tuple, kwargs: dict) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        flat, _ = tree_flatten((args, kwargs))
        for t in flat:
            if isinstance(t, Tensor) and t.is_complex():
                raise unsupported(
                    func,
                    f"it received a complex tensor ({t.dtype}); semiring values are defined on "
                    "real local derivatives (split complex tensors with torch.view_as_real)",
                )
        self.messages = [m for m in flat if isinstance(m, Message)]
        first = self.messages[0]
        self.semiring: Semiring = first.semiring
        self.dtype: torch.dtype = first.dtype
        self.device = first.device
        self.regular = all(m.gradient is not None for m in self.messages)
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
            schema_args = self.func._schema.arguments
            for i, arg in enumerate(schema_args):
                if i < len(self.args) and not arg.kwarg_only:
                    out[arg.name] = self.args[i]
                elif arg.name in self.kwargs:
                    out[arg.name] = self.kwargs[arg.name]
                elif arg.has_default_value():
                    out[arg.name] = arg.default_value
                else:
                    out[arg.name] = None
            self._bound = out
        return self._bound

    def __getitem__(self, name: str) -> Any:
        return self.bound[name]

    @property
    def weight_dtype(self) -> torch.dtype:
        """The precision edge weights are built in: the gradient's dtype, at least float32
        (never the dtype of a boolean or integer state component)."""
        return self.semiring.state_dtype(self.dtype)

    def error(self, reason: str = "") -> UnsupportedOpError:
        return unsupported(self.func, reason)

    # --- channels -----------------------------------------------------------------------------
    def run_real(self, *args, **kwargs) -> Any:
        """The op's ordinary result on the regular gradients (None when they are off).

        With no arguments, re-runs the call as given; otherwise runs ``func(*args, **kwargs)``
        with any Message replaced by its regular gradient.
        """
        if not self.regular:
            return None
        if not args and not kwargs:
            args, kwargs = self.args, self.kwargs
        return self.func(*tree_map(_real_of, args), **tree_map(_real_of, kwargs))

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
                raise MessageLostError(
                    f"{self.func}: a non-zero plain tensor was combined with a semiring message; "
                    "a backward formula produced a gradient semipack cannot interpret"
                )
            return self.semiring.zeros(x.shape if shape is None else shape, self.dtype, x.device)
        if isinstance(x, (int, float, bool)) and x == 0:
            return self.semiring.zeros(() if shape is None else shape, self.dtype, self.device)
        raise self.error(f"argument {x!r} cannot be a semiring message")

    def wrap(self, real: Tensor | None, parts: State) -> Message:
        return Message(real, parts, self.semiring, self.dtype if real is None else None)

    def zeros(self, shape: Sequence[int]) -> State:
        return self.semiring.zeros(shape, self.dtype, self.device)


def _real_of(x: Any) -> Any:
    if isinstance(x, Message):
        return x.gradient
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
    real = call.run_real()
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
    return real, outs


def call_by_name(func: OpOverload, named: dict[str, Any]) -> Any:
    """Call an aten overload with arguments given by schema name."""
    args, kwargs = [], {}
    for arg in func._schema.arguments:
        if arg.kwarg_only:
            kwargs[arg.name] = named[arg.name]
        else:
            args.append(named[arg.name])
    return func(*args, **kwargs)


def wrap_outputs(call: OpCall, real: Any, outs: list[Any]) -> Any:
    """Zip per-component results (tensor or sequence of tensors) into Message outputs."""
    first = outs[0]
    if isinstance(first, (list, tuple)):
        reals = real if real is not None else [None] * len(first)
        return type(first)(call.wrap(r, tuple(o[j] for o in outs)) for j, r in enumerate(reals))
    return call.wrap(real, tuple(outs))
