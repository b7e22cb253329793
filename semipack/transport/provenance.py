"""Which module created an autograd node: recorded during the forward, read during backward.

While ``semipack.extend`` is active, a node-creation hook stamps every new autograd node with the
dotted path of the innermost module whose forward is running. Error messages and site names read
the stamp of the node that is executing (``torch._C._current_autograd_node``).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
from torch import nn

MODULE_KEY = "semipack.module"
OUTSIDE_MODEL = "<outside the model>"


class ModuleTracker:
    """Keeps a stack of running module paths and stamps new autograd nodes with its top."""

    def __init__(self, model: nn.Module | None) -> None:
        self.model = model
        self.stack: list[str] = []

    def _stamp(self, node: torch.autograd.graph.Node) -> None:
        node.metadata[MODULE_KEY] = self.stack[-1] if self.stack else OUTSIDE_MODEL

    @contextmanager
    def active(self):
        with ExitStack() as stack:
            if self.model is not None:
                for name, module in self.model.named_modules():
                    stack.enter_context(self._hooks(module, name))
            stack.enter_context(torch.autograd.graph.node_creation_hook(self._stamp))
            _ACTIVE.append(self)
            try:
                yield self
            finally:
                _ACTIVE.remove(self)

    @contextmanager
    def _hooks(self, module: nn.Module, name: str):
        def push(_module, _args):
            self.stack.append(name)

        def pop(_module, _args, _output):
            if self.stack and self.stack[-1] == name:
                self.stack.pop()

        pre = module.register_forward_pre_hook(push)
        post = module.register_forward_hook(pop, always_call=True)
        try:
            yield
        finally:
            pre.remove()
            post.remove()


def current_site() -> tuple[str | None, str | None]:
    """(autograd node name, module path) of the backward node running now, when known."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None, None
    module = node.metadata.get(MODULE_KEY)
    return node.name(), module


_ACTIVE: list[ModuleTracker] = []


def current_module() -> str:
    """Dotted path of the innermost module whose forward is running under semipack.extend."""
    for tracker in reversed(_ACTIVE):
        if tracker.stack:
            return tracker.stack[-1]
    return OUTSIDE_MODEL
