"""``x @ W`` with a parameter ``W`` (or a view of one, ``x @ W.T``): the linear layer's messages.

Models write their projections as matrix products as often as with ``F.linear``: Falcon's
``FalconLinear`` computes ``input @ self.weight.T``, hand-written layers ``x @ self.W``. Through
the generic rules such a product is a merged-batch ``mm`` (``matmul`` folds ``[N, T, k]`` into
``[N·T, k]``), whose per-sample rows cannot be split by example, so ``per_sample=True`` refused
those models; it also had no site names. Here the call is a linear layer with weight ``W.T``:
the same messages and per-sample rows as ``LinearFunction``, transposed back to ``W``'s layout.
The inner graph runs ``torch.matmul`` itself, so ``.grad`` is bitwise a plain backward's.

Only products whose right operand is a 2-D parameter, or a view of one, are taken (an
activation on the right, ``h.T @ h``, may carry the batch, which the rows of a weight must not);
everything else stays with the generic rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from ..rules.per_sample import parameter_projection
from ..semirings.base import State
from .base import BackwardCall, ExtensionFunction, Sites, bilinear_reads, extends, per_sample_rule
from .linear import LinearFunction


def _transposed(state: State | None) -> State | None:
    """A weight state ``[..., O, I]`` in the layout of the product's operand, ``[..., I, O]``."""
    return None if state is None else tuple(p.transpose(-1, -2) for p in state)


def _as_linear(call: BackwardCall) -> BackwardCall:
    """The call as ``F.linear(x, W.T)`` (no bias), for ``LinearFunction``'s messages."""
    x, other = call.inputs
    return replace(call, inputs=[x, other.t(), None], needs=(*call.needs, False))


@per_sample_rule
class MatmulFunction(ExtensionFunction):
    """(x, W) -> x @ W with W: [k, n], x: [..., k]; messages of ``F.linear(x, W.T)``."""

    direct_regular_grads = True

    reads = (0, 1)
    read_for = staticmethod(bilinear_reads)

    @staticmethod
    def messages(call: BackwardCall) -> tuple[State | None, ...]:
        m_x, m_w, _ = LinearFunction.messages(_as_linear(call))
        return m_x, _transposed(m_w)

    @classmethod
    def per_sample(cls, call: BackwardCall) -> list[State | None]:
        _, m_w, _ = LinearFunction.per_sample(_as_linear(call))
        return [None, _transposed(m_w)]

    @staticmethod
    def sites(out: Tensor) -> Sites:
        return LinearFunction.sites(out)


def _addmm_as_linear(call: BackwardCall) -> BackwardCall:
    """The call ``addmm(b, x, W)`` as ``F.linear(x, W.T, b)``, for ``LinearFunction``."""
    bias, x, other = call.inputs
    need_b, need_x, need_w = call.needs
    return replace(call, inputs=[x, other.t(), bias], needs=(need_x, need_w, need_b))


def _addmm_reads(needs: Sequence[bool]) -> tuple[int, ...]:
    """``read_for`` of ``addmm(b, x, W)``: ``x`` for W's message, ``W`` for x's."""
    return tuple(i for i, other in ((1, 2), (2, 1)) if needs[other])


@per_sample_rule
class AddmmFunction(ExtensionFunction):
    """(b, x, W) -> b + x @ W with W: [k, n], x: [m, k], b: [n]; messages of
    ``F.linear(x, W.T, b)``. Hugging Face's ``Conv1D`` (GPT-2's projections) calls
    ``torch.addmm(bias, x.view(-1, k), weight)``: through the generic rules it had no site
    names and no per-sample rows."""

    direct_regular_grads = True

    reads = (1, 2)
    read_for = staticmethod(_addmm_reads)
    batched_inputs = (1,)

    @staticmethod
    def messages(call: BackwardCall) -> tuple[State | None, ...]:
        m_x, m_w, m_b = LinearFunction.messages(_addmm_as_linear(call))
        return m_b, m_x, _transposed(m_w)

    @classmethod
    def per_sample(cls, call: BackwardCall) -> list[State | None]:
        _, m_w, m_b = LinearFunction.per_sample(_addmm_as_linear(call))
        return [m_b, None, _transposed(m_w)]

    @staticmethod
    def sites(out: Tensor) -> Sites:
        return (("output", ("row", "neuron")),)


def _addmm_handler(addmm):
    def handler(input: Tensor, mat1: Tensor, mat2: Tensor, **kwargs) -> Tensor:
        fused = (
            not kwargs  # beta=, alpha=, out=
            and isinstance(input, Tensor)
            and isinstance(mat1, Tensor)
            and mat1.dim() == 2
            and parameter_projection(mat1, mat2)
            and tuple(input.shape) == (mat2.shape[1],)
            and input.dtype == mat1.dtype
        )
        if not fused:
            return addmm(input, mat1, mat2, **kwargs)
        return AddmmFunction.run(torch.addmm, [input, mat1, mat2])

    handler.__doc__ = (
        f"``{addmm.__name__}`` inside ``extend``: ``b + x @ W`` with a parameter ``W`` as a "
        "linear layer."
    )
    return handler


addmm = extends(torch.addmm)(_addmm_handler(torch.addmm))
tensor_addmm = extends(Tensor.addmm)(_addmm_handler(Tensor.addmm))


def _matmul_handler(matmul):
    def handler(input: Tensor, other: Tensor, **kwargs) -> Tensor:
        if kwargs or not parameter_projection(input, other):  # out=, or not a projection
            return matmul(input, other, **kwargs)
        return MatmulFunction.run(torch.matmul, [input, other])

    handler.__doc__ = f"``{matmul.__name__}`` inside ``extend``: ``x @ W`` as a linear layer."
    return handler


matmul = extends(torch.matmul)(_matmul_handler(torch.matmul))
linalg_matmul = extends(torch.linalg.matmul)(_matmul_handler(torch.linalg.matmul))
matmul_operator = extends(Tensor.__matmul__)(_matmul_handler(Tensor.__matmul__))
tensor_matmul = extends(Tensor.matmul)(_matmul_handler(Tensor.matmul))
