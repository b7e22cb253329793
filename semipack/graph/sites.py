"""Names for the scalar nodes of a tensor: which layer, head, token or neuron an entry is.

Extensions stamp the autograd node they create with a ``Site`` per output, so path readouts can
say "encoder.layer.3.attention: head 5, query token 7, key token 2" instead of a flat index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SITE_KEY = "semipack.sites"
#: How readouts name the extended model's own forward (its module path is empty).
ROOT_MODULE = "<root module>"


@dataclass(frozen=True)
class Site:
    """The module that produced a tensor, what the tensor is, and the meaning of its dims."""

    module: str
    tensor: str
    dims: tuple[str, ...]

    def describe(self, index: tuple[int, ...]) -> str:
        """A readable name of entry ``index`` of the site's tensor: module, tensor, named dims.
        Names that do not fit the tensor's rank (a layout the site did not expect: a layer
        norm over a 4-D tensor, ids of three dims) give way to ``dim0``, ``dim1``, ...: an
        entry is never described by another entry's names."""
        dims = self.dims if len(self.dims) == len(index) else [f"dim{k}" for k in range(len(index))]
        named = ", ".join(f"{d} {i}" for d, i in zip(dims, index, strict=True))
        where = self.module if self.module else ROOT_MODULE
        return f"{where}: {self.tensor} [{named}]"


def stamp(output: torch.Tensor | tuple, sites: tuple[Site, ...]) -> None:
    """Attach site names to the autograd node that produced ``output``."""
    first = output[0] if isinstance(output, tuple) else output
    if first.grad_fn is not None:
        first.grad_fn.metadata[SITE_KEY] = sites
