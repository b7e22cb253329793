"""Names for the scalar nodes of a tensor: which layer, head, token or neuron an entry is.

Extensions stamp the autograd node they create with a ``Site`` per output, so path readouts can
say "encoder.layer.3.attention: head 5, query token 7, key token 2" instead of a flat index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SITE_KEY = "semipack.sites"


@dataclass(frozen=True)
class Site:
    """The module that produced a tensor, what the tensor is, and the meaning of its dims."""

    module: str
    tensor: str
    dims: tuple[str, ...]

    def describe(self, index: tuple[int, ...]) -> str:
        """A readable name of entry ``index`` of the site's tensor: module, tensor, named dims."""
        named = ", ".join(f"{d} {i}" for d, i in zip(self.dims, index, strict=False))
        where = self.module if self.module else "<root module>"
        return f"{where}: {self.tensor} [{named}]"


def stamp(output: torch.Tensor | tuple, sites: tuple[Site, ...]) -> None:
    """Attach site names to the autograd node that produced ``output``."""
    first = output[0] if isinstance(output, tuple) else output
    if first.grad_fn is not None:
        first.grad_fn.metadata[SITE_KEY] = sites
