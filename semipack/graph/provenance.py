"""Which module created an autograd node: recorded during the forward, read during backward.

While ``semipack.extend`` is active, a node-creation hook stamps every new autograd node with the
dotted path of the innermost module of the model whose forward is running. Error messages and
site names read the stamp of the node that is executing (``torch._C._current_autograd_node``).

Module calls are followed with PyTorch's *global* forward hooks, filtered by the model's own
module objects: nothing is registered on the modules themselves, so a model copied, pickled or
inspected inside the block looks exactly as outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.modules.module as module_hooks
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

MODULE_KEY = "semipack.module"
OUTSIDE_MODEL = "<outside the model>"


class ModuleTracker:
    """Keeps a per-thread stack of running module paths and stamps new autograd nodes with it."""

    def __init__(self, model: nn.Module | None) -> None:
        self.model = model
        self.names: dict[int, str] = {}
        #: modules with legacy backward hooks (``register_backward_hook``) at the block's entry
        self.legacy_hooked: set[str] = set()
        if model is not None:
            self.names = {id(m): display_name(n) for n, m in model.named_modules()}
            self.legacy_hooked = {
                display_name(n)
                for n, m in model.named_modules()
                if m._backward_hooks and getattr(m, "_is_full_backward_hook", None) is False
            }
        self._local = threading.local()

    @property
    def stack(self) -> list[str]:
        """The names of the modules whose forward is running in this thread, outermost first."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _stamp(self, node: torch.autograd.graph.Node) -> None:
        stack = self.stack
        node.metadata[MODULE_KEY] = stack[-1] if stack else OUTSIDE_MODEL

    def _push(self, module: nn.Module, _args) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.stack.append(name)

    def _pop(self, module: nn.Module, _args, _output) -> None:
        name = self.names.get(id(module))
        stack = self.stack
        if name is not None and stack and stack[-1] == name:
            stack.pop()

    @contextmanager
    def active(self) -> Iterator[ModuleTracker]:
        """Track the model's module calls while the block runs (global hooks, removed on exit)."""
        with ExitStack() as stack:
            if self.names:
                stack.callback(register_module_forward_pre_hook(self._push).remove)
                stack.callback(register_module_forward_hook(self._pop, always_call=True).remove)
            stack.enter_context(torch.autograd.graph.node_creation_hook(self._stamp))
            _ACTIVE.append(self)
            stack.callback(_ACTIVE.remove, self)
            yield self


def display_name(name: str) -> str:
    """Module paths as the user wrote the model: without torch.compile's wrapper prefix."""
    prefix = "_orig_mod"
    if name == prefix:
        return ""
    return name.removeprefix(prefix + ".")


def under_legacy_backward_hook() -> bool:
    """Whether a module whose forward is running has a legacy backward hook
    (``register_backward_hook``, or a global one). PyTorch runs such a hook on the module's last
    autograd node, with that node's gradients in its order: an extension's node in its place
    would hand the hook other tensors (for ``nn.Linear``, ``(input, weight, bias)`` where
    ``addmm`` gives ``(bias, input, weight.T)``)."""
    if module_hooks._global_backward_hooks and not module_hooks._global_is_full_backward_hook:
        return True
    for tracker in reversed(_ACTIVE):
        if tracker.stack:
            return any(name in tracker.legacy_hooked for name in tracker.stack)
    return False


def current_site() -> tuple[str | None, str | None]:
    """(autograd node name, module path) of the backward node running now, when known."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None, None
    module = node.metadata.get(MODULE_KEY)
    return node.name(), module


_ACTIVE: list[ModuleTracker] = []


def root_class() -> str | None:
    """The class name of the model the innermost active block extends (errors name the root
    module by it: its module path is empty), or None without one."""
    for tracker in reversed(_ACTIVE):
        if tracker.model is not None:
            return type(tracker.model).__name__
    return None


def current_module() -> str:
    """Dotted path of the innermost module whose forward is running under semipack.extend."""
    for tracker in reversed(_ACTIVE):
        if tracker.stack:
            return tracker.stack[-1]
    return OUTSIDE_MODEL
