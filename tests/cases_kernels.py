"""Fused-kernel cases that need more than a ``cases_ops`` entry, shared by their oracle tests
and the rule-coverage test (``test_rule_coverage.py``, which runs each once).

``GROUPED_MM``: ``torch._grouped_mm`` runs in float32 only (``test_grouped_mm.py`` compares with
float32 tolerances). ``WEIGHT_NORM``: the fused ``_weight_norm_interface`` is drawn as its
decomposition, so the oracle reads the decomposed graph (``test_weight_norm.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUPED_MM = {
    # rows of a split by offs, one expert matrix each (the MoE forward)
    "2d_x_3d": ((8, 4), (3, 4, 8), [2, 6, 8]),
    # columns of b split by offs, one left matrix each
    "3d_x_2d": ((2, 4, 4), (4, 8), [4, 8]),
    # the shared dim split by offs: one product per group
    "2d_x_2d": ((4, 8), (8, 4), [4, 8]),
    # batched, no offs
    "3d_x_3d": ((2, 4, 4), (2, 4, 8), None),
}


def grouped_mm_operands(shape_a, shape_b, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*shape_a, generator=g).requires_grad_()
    b = torch.randn(*shape_b, generator=g).requires_grad_()
    return a, b


def grouped_mm_loss(case: str) -> tuple[Tensor, list[Tensor]]:
    """The weighted sum of ``_grouped_mm(a, b, offs)`` for ``GROUPED_MM[case]``, and [a, b]."""
    shape_a, shape_b, ends = GROUPED_MM[case]
    a, b = grouped_mm_operands(shape_a, shape_b)
    offs = None if ends is None else torch.tensor(ends, dtype=torch.int32)
    out = torch._grouped_mm(a, b, offs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    return (out * weights).sum(), [a, b]


#: (dim, shape of g): the dims with a fused kernel on CPU (others, and dim=-1, record the
#: decomposition itself).
WEIGHT_NORM = [(0, (3, 1, 1)), (2, (1, 1, 2))]


def weight_norm_losses(dim: int, g_shape) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(fused loss, decomposed loss, [v, g]): ``torch._weight_norm(v, g, dim)`` weighted, and the
    same sum over ``v * (g / norm_except_dim(v, 2, dim))``."""
    g0 = torch.Generator().manual_seed(0)
    v = torch.randn(3, 4, 2, generator=g0, dtype=torch.float64, requires_grad=True)
    g = torch.randn(g_shape, generator=g0, dtype=torch.float64).requires_grad_()
    weights = torch.randn(3, 4, 2, generator=g0, dtype=torch.float64)
    fused = (torch._weight_norm(v, g, dim) * weights).sum()
    decomposed = (v * (g / torch.norm_except_dim(v, 2, dim)) * weights).sum()
    return fused, decomposed, [v, g]
