"""User hooks inside a semiring backward: they see the regular gradient, never a Message.

Hooks (gradient-norm logging, clipping, module backward hooks, BackPACK's extensions) are written
for gradients. Inside ``semipack.extend`` the engine hands them ``Message`` objects, so semipack
shows them the regular gradient, and whatever they return replaces the regular gradient only.
Hooks change gradients, not the graph: the semiring state passes through unchanged.

- Full module backward hooks and backward pre-hooks (``register_full_backward_hook``,
  ``register_full_backward_pre_hook``, their global forms) of *any* module, wherever and whenever
  they were registered: PyTorch runs them as post hooks of the identity autograd node it puts
  around the module's inputs and outputs (``MODULE_HOOK_NODE``). For each pass, such nodes get a
  pre-hook that hands the node (hence the user hooks) the regular gradients and keeps the
  messages aside, and a post hook, behind the user hooks, that puts the (possibly replaced)
  regular gradients back into those messages (``ModuleHookNodes``). This is what lets BackPACK
  run in the same backward: its hooks, on the model's modules and on the loss module, see the
  gradients of a plain backward.
- Tensor hooks registered inside the block are wrapped at registration
  (``SemiringMode`` intercepts ``Tensor.register_hook``).
- Module backward hooks of the model registered before the block (the legacy
  ``register_backward_hook`` too, which runs on the module's last op node, and the global module
  hooks) are wrapped for its duration (``module_hooks_see_gradients``); the wrapper also keeps
  them out of the extra passes of branch readouts (``passes.carry_pass``), where any other
  module hook is handed messages that raise when used (``SealedMessage``).

Without regular gradients (``regular_grads=False``, ``semipack.grad``) there is nothing to show
a hook: a graph through module-hook nodes raises before the pass, a wrapped hook when called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch.nn.modules.module as module_hooks
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from ..errors import ModuleHooksError, SemipackError
from ..graph.provenance import MODULE_KEY
from ..graph.sites import ROOT_MODULE
from ..messages.message import MODULE_HOOK_NODE, Message, unsupported
from .passes import in_carry_pass


def _no_regular_gradient(what: str) -> SemipackError:
    return SemipackError(
        f"{what} needs the regular gradient, which a pass without regular gradients "
        "(semipack.extend(..., regular_grads=False), semipack.grad) does not compute: run the "
        "backward in semipack.extend with regular_grads=True, or remove the hook for this pass"
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
    """A tensor hook that receives the regular gradient of a message.

    The user's hook is ``user_hook``, not ``hook``: PyTorch wraps a legacy module backward hook
    in ``_WrappedHook``, whose ``functools.update_wrapper`` copies the wrapped object's
    ``__dict__`` over its own, so an attribute named ``hook`` would replace the wrapper by the
    bare user hook (which then saw messages; the same holds for ``ModuleBackwardHook``)."""

    def __init__(self, hook: Callable[[Tensor], Tensor | None]) -> None:
        self.user_hook = hook

    def __call__(self, grad: Tensor) -> Tensor | None:
        if in_carry_pass():  # not the user's backward: the hook already saw this gradient
            return None
        result = self.user_hook(_regular(grad, "a tensor hook"))
        return _rewrap(grad, result)

    def __reduce__(self):
        return (_restore_original, (self.user_hook,))


class ModuleBackwardHook:
    """A module backward hook ``hook(module, grad_input, grad_output)`` (or a backward pre-hook
    ``hook(module, grad_output)``) that receives regular gradients."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.user_hook = hook

    def __call__(self, module: nn.Module, *grads: Any) -> Any:
        if in_carry_pass():
            return None
        plain = [_plain_tuple(g) for g in grads]
        result = self.user_hook(module, *plain)
        if result is None:
            return None
        first = grads[0]
        if isinstance(first, tuple) and isinstance(result, (tuple, list)):
            return type(result)(_rewrap(o, r) for o, r in zip(first, result, strict=False))
        return _rewrap(first, result)

    def __reduce__(self):
        return (_restore_original, (self.user_hook,))


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
            stack.enter_context(_wrapped_entries(table, ModuleBackwardHook))
        yield


@contextmanager
def tensor_hooks_see_gradients(tensors: Iterable[Tensor]) -> Iterator[None]:
    """Wrap the hooks already registered on ``tensors`` (a pass's leaves: a parameter's
    gradient scaling, say) for the pass. With regular gradients the pass's own first hook has
    shown them the regular gradient already; without (``regular_grads=False``,
    ``semipack.grad``) they would be handed the message, and what they return would replace it
    (a hook scaling its gradient by 10 scaled MaxProd by 10): wrapped, they raise instead."""
    with ExitStack() as stack:
        for t in tensors:
            table = t._backward_hooks
            if table:
                stack.enter_context(_wrapped_entries(table, TensorHook))
        yield


#: The attribute that marks a semiring pass's own leaf hook (``mark_pass_hook``).
PASS_HOOK = "semipack_pass_hook"


def mark_pass_hook(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Mark ``hook`` as a pass's own leaf hook, which takes messages: another pass running
    meanwhile on the same parameter (another thread's) must not wrap it as a user's hook (it
    then saw that pass's regular gradients and raised that its message was lost)."""
    setattr(hook, PASS_HOOK, True)
    return hook


@contextmanager
def _wrapped_entries(
    table: MutableMapping[int, Any], wrapper: type[TensorHook | ModuleBackwardHook]
) -> Iterator[None]:
    wrapped = {}
    for key, hook in list(table.items()):
        if not isinstance(hook, wrapper) and not getattr(hook, PASS_HOOK, False):
            wrapped[key] = table[key] = wrapper(hook)
    try:
        yield
    finally:
        for key, kept in wrapped.items():
            if table.get(key) is kept:  # still registered, not replaced meanwhile
                table[key] = kept.user_hook


class ModuleHookNodes:
    """The module-hook nodes of one semiring pass show their hooks regular gradients.

    A module with full backward hooks or backward pre-hooks gets, at each forward call, an
    identity autograd node (``BackwardHookFunctionBackward``) on its output tensors and one on
    its input tensors; the user hooks run as that node's post hooks, with the gradients that
    entered the node (the outputs' gradients) and that leave it (the inputs'). ``watch(node)``
    gives such a node a pre-hook that keeps the entering messages aside and lets the regular
    gradients through the node, its post hooks and the user hooks; a post hook, registered when
    the node first runs and so behind the hooks PyTorch registered in the forward, wraps the
    gradients leaving the node (the user hooks' replacements, if any) with the kept states.
    Input ``i`` of the node is its output ``i`` (the node is the identity), so message ``i``'s
    state goes with gradient ``i``.

    The extra passes of branch readouts (``passes.carry_pass``) have no regular gradient: the
    model's own hooks skip them (``ModuleBackwardHook``), and any other hook is handed sealed
    messages (``SealedMessage``), so that one reading or computing with its gradient raises
    instead of storing a message (BackPACK would); the post hook unseals what leaves the node.
    ``remove()`` takes every hook of the pass off the graph.
    """

    def __init__(self) -> None:
        self.handles: list[RemovableHandle] = []

    def watch(self, node: Node) -> None:
        """Show the hooks of ``node`` regular gradients if it is a module-hook node."""
        if node.name() == MODULE_HOOK_NODE:
            self.handles.append(node.register_prehook(self._unwrapping(node)))

    def remove(self) -> None:
        """Take every pre-hook and post hook of the pass off the graph."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _unwrapping(self, node: Node) -> Callable[[Sequence[Any]], tuple[Any, ...] | None]:
        kept: list[Sequence[Any] | None] = [None]  # the entering messages, pre -> post hook
        rewrapping: list[RemovableHandle] = []

        def unwrap(grad_outputs: Sequence[Any]) -> tuple[Any, ...] | None:
            if not rewrapping:
                rewrapping.append(node.register_hook(rewrap))
                self.handles.append(rewrapping[0])
            if in_carry_pass():
                kept[0] = None
                return tuple(SealedMessage.of(g) for g in grad_outputs)
            kept[0] = tuple(grad_outputs)
            return tuple(_regular(g, "a module backward hook") for g in grad_outputs)

        def rewrap(grad_inputs: Sequence[Any], _grad_outputs: Sequence[Any]) -> Any:
            messages, kept[0] = kept[0], None
            if messages is None:  # a carry pass: unseal
                return tuple(SealedMessage.unsealed(g) for g in grad_inputs)
            return tuple(_rewrap(m, g) for m, g in zip(messages, grad_inputs, strict=True))

        return unwrap


class SealedMessage(Message):
    """A message as module hooks see it in a pass without regular gradients (the extra passes
    of branch readouts): the same state, but any op on it raises, naming the cause. Hooks that
    leave their gradients alone (or skip the pass) let it through unchanged."""

    @classmethod
    def of(cls, grad: Any) -> Any:
        """``grad`` sealed (anything but a message as it is)."""
        if not isinstance(grad, Message) or isinstance(grad, SealedMessage):
            return grad
        return cls(grad.regular_grad, grad.parts, grad.semiring, grad.dtype)

    @staticmethod
    def unsealed(grad: Any) -> Any:
        """``grad`` as an ordinary message again (anything else as it is)."""
        if not isinstance(grad, SealedMessage):
            return grad
        return Message(grad.regular_grad, grad.parts, grad.semiring, grad.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise unsupported(
            func,
            "a module backward hook received a semiring message in an extra pass of a branch "
            "readout (semipack.branches(..., inputs=...)), which computes no regular gradient. "
            "Hooks of the model's modules registered before entering semipack.extend skip "
            "those passes; remove other hooks (registered inside the block, or of modules "
            "outside the model) below the split tensor, or read the branches without inputs=",
        )


def hooks_need_regular_gradients(nodes: Iterable[Node], computed_by: str) -> ModuleHooksError:
    """The error for module-hook nodes in a pass without regular gradients (``computed_by``
    names that pass), naming the modules whose forward created them where the block's module
    tracker stamped them. Raised before the pass, so no hook has run and nothing is changed."""
    names: list[str] = []
    for node in nodes:
        name = node.metadata.get(MODULE_KEY)
        shown = ROOT_MODULE if name == "" else name
        if shown is not None and repr(shown) not in names:
            names.append(repr(shown))
    where = f" (their hook nodes were made in the forward of {', '.join(names)})" if names else ""
    return ModuleHooksError(
        f"modules with full backward hooks or backward pre-hooks are in this graph{where}; "
        "such hooks (BackPACK's extensions among them) receive the regular gradient, which "
        f"{computed_by} does not compute: run loss.backward() inside "
        "semipack.extend(model, semiring) with regular_grads=True (the default), or remove "
        "the hooks for this pass"
    )


class BlockPreHook:
    """A forward pre-hook (``with_kwargs=True``) that a block puts on a module for its duration
    (``semipack.branches`` on a module, ``extend(..., per_sample=True)`` on the model), and that
    leaves nothing behind in copies: ``copy.deepcopy`` or pickling the module inside the block
    (an EMA copy, ``torch.save`` of a checkpoint) copies the hook table, and a copy of the hook
    is ``_SpentHook``, which does nothing and removes itself at the copy's first call (a copied
    closure had kept splitting for the block, and a local function could not be pickled)."""

    def __init__(self, hook: Callable[[nn.Module, tuple, dict], Any]) -> None:
        self.hook = hook

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        return self.hook(module, args, kwargs)

    def __deepcopy__(self, memo: dict) -> _SpentHook:
        return _SpentHook()

    def __reduce__(self):
        return (_SpentHook, ())


class _SpentHook:
    """A copied ``BlockPreHook``: removes itself from the module it is called for."""

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        for key, hook in list(module._forward_pre_hooks.items()):
            if hook is self:
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
        return None
