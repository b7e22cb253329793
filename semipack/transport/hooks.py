"""User hooks inside a semiring backward: they see the regular gradient, never a Message.

Hooks (gradient-norm logging, clipping, module backward hooks) are written for gradients. Inside
``semipack.extend`` the engine hands them ``Message`` objects, so semipack wraps them: a wrapped
hook is called with the regular gradient and whatever it returns replaces the regular gradient
only. Hooks change gradients, not the graph: the semiring state passes through unchanged.

- Tensor hooks registered inside the block are wrapped at registration
  (``SemiringMode`` intercepts ``Tensor.register_hook``).
- Module backward hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook``,
  the legacy ``register_backward_hook`` and the global module hooks) registered before the block
  are wrapped for its duration (``module_hooks_see_gradients``).

Without regular gradients (``regular_grads=False``) there is nothing to show a hook: it raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableMapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch.nn.modules.module as module_hooks
from torch import Tensor, nn

from ..errors import SemipackError
from ..messages.message import Message
from .passes import in_carry_pass


def _no_regular_gradient(what: str) -> SemipackError:
    return SemipackError(
        f"{what} needs the regular gradient, which semipack.extend(..., regular_grads=False) "
        "does not compute: pass regular_grads=True, or remove the hook for this block"
    )


def _regular(grad: Any, what: str) -> Any:
    if isinstance(grad, Message):
        if grad.regular_grad is None:
            raise _no_regular_gradient(what)
        return grad.regular_grad
    return grad


def _rewrap(original: Any, replacement: Any) -> Any:
    """Put a hook's new regular gradient back into the message it came from."""
    if not isinstance(original, Message) or replacement is None:
        return replacement
    if isinstance(replacement, Message):
        return replacement
    return Message(replacement, original.parts, original.semiring, original.dtype)


def _restore_original(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Unpickling or deep-copying a wrapped hook gives back the user's own hook."""
    return hook


class TensorHook:
    """A tensor hook that receives the regular gradient of a message."""

    def __init__(self, hook: Callable[[Tensor], Tensor | None]) -> None:
        self.hook = hook

    def __call__(self, grad: Tensor) -> Tensor | None:
        if in_carry_pass():  # not the user's backward: the hook already saw this gradient
            return None
        result = self.hook(_regular(grad, "a tensor hook"))
        return _rewrap(grad, result)

    def __reduce__(self):
        return (_restore_original, (self.hook,))


class ModuleBackwardHook:
    """A module backward hook ``hook(module, grad_input, grad_output)`` (or a backward pre-hook
    ``hook(module, grad_output)``) that receives regular gradients."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def __call__(self, module: nn.Module, *grads: Any) -> Any:
        if in_carry_pass():
            return None
        plain = [_plain_tuple(g) for g in grads]
        result = self.hook(module, *plain)
        if result is None:
            return None
        first = grads[0]
        if isinstance(first, tuple) and isinstance(result, (tuple, list)):
            return type(result)(_rewrap(o, r) for o, r in zip(first, result, strict=False))
        return _rewrap(first, result)

    def __reduce__(self):
        return (_restore_original, (self.hook,))


def _plain_tuple(grads: Any) -> Any:
    if isinstance(grads, tuple):
        return tuple(_regular(g, "a module backward hook") for g in grads)
    return _regular(grads, "a module backward hook")


@contextmanager
def module_hooks_see_gradients(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Wrap the backward hooks of ``modules`` and the global module backward hooks."""
    with ExitStack() as stack:
        tables: list[MutableMapping[int, Any]] = [
            module_hooks._global_backward_hooks,
            module_hooks._global_backward_pre_hooks,
        ]
        for m in modules:
            tables += [m._backward_hooks, m._backward_pre_hooks]
        for table in tables:
            stack.enter_context(_wrapped_entries(table))
        yield


@contextmanager
def _wrapped_entries(table: MutableMapping[int, Any]) -> Iterator[None]:
    wrapped = {}
    for key, hook in list(table.items()):
        if not isinstance(hook, ModuleBackwardHook):
            wrapped[key] = table[key] = ModuleBackwardHook(hook)
    try:
        yield
    finally:
        for key, wrapper in wrapped.items():
            if table.get(key) is wrapper:  # still registered, not replaced meanwhile
                table[key] = wrapper.hook
