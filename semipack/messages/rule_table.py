"""The table from aten ops to semiring rules, and the forward routes rules may add.

A rule is a function ``rule(call: OpCall) -> output`` registered for one or more aten overloads
(or whole overload packets); ``Message.__torch_dispatch__`` looks it up here. The op-rule modules
in ``semipack.rules`` fill the table when they are imported; users add rules with
``register_rule`` and replace a built-in one only with ``replace=True`` (or inside
``scoped_rules()``, which restores the table on exit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch._ops import OpOverload, OpOverloadPacket

#: ``rule(call: OpCall) -> output`` (``OpCall`` is in ``messages.message``, which imports this).
Rule = Callable[..., Any]
_RULES: dict[OpOverload | OpOverloadPacket, Rule] = {}


def register_rule(
    *ops: OpOverload | OpOverloadPacket, replace: bool = False
) -> Callable[[Rule], Rule]:
    """Decorator: use ``rule`` for these aten overloads (a packet covers all its overloads).

    An op that already has a rule keeps it unless ``replace=True``: overriding a built-in rule
    must be deliberate (a ``ValueError`` names the op otherwise). Inside ``scoped_rules()`` the
    replacement lasts until the block ends.
    """
    taken = [str(op) for op in ops if op in _RULES]
    if taken and not replace:
        raise ValueError(
            f"{', '.join(taken)} already has a semiring rule; pass replace=True to "
            "semipack.register_rule to override it (or register inside semipack.scoped_rules() "
            "to override it for one block)"
        )

    def decorate(rule: Rule) -> Rule:
        for op in ops:
            _RULES[op] = rule
        return rule

    return decorate


@contextmanager
def scoped_rules() -> Iterator[None]:
    """Rules registered (or replaced) inside the block are removed (restored) when it ends."""
    saved = dict(_RULES)
    try:
        yield
    finally:
        _RULES.clear()
        _RULES.update(saved)


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
    """The rule for this overload, or for its whole packet, or None."""
    return _RULES.get(func) or _RULES.get(func.overloadpacket)


def registered_ops() -> list[str]:
    """Names of every op (overload or packet) that has a rule, sorted."""
    return sorted(str(op) for op in _RULES)
