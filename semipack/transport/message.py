"""The tensor subclass that carries a semiring message through the autograd engine.

autograd hands a ``Message`` to every backward formula as if it were the incoming gradient. Each
aten op the formula applies to it lands in ``__torch_dispatch__``, which looks up the op's rule:
the rule computes the regular gradient (``real``) with the op itself, and the semiring state
(``parts``) with the semiring's plus and times. The engine's own accumulation (``aten.add``)
becomes the semiring's plus the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..semirings.base import Semiring, State


class Message(torch.Tensor):
    """A backward message: the regular gradient (optional) and the semiring state of a tensor.

    Attributes:
        gradient: the ordinary gradient, or ``None`` when regular gradients are switched off.
        parts: the semiring state, one tensor per component, each of the message's shape.
        semiring: the semiring the state belongs to.
    """

    gradient: Tensor | None
    parts: State
    semiring: Semiring

    @staticmethod
    def __new__(
        cls,
        real: Tensor | None,
        parts: State,
        semiring: Semiring,
        dtype: torch.dtype | None = None,
    ) -> Message:
        ref = real if real is not None else parts[0]
        if dtype is None:
            if real is None:
                raise ValueError("a Message without a real gradient needs an explicit dtype")
            dtype = real.dtype
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            ref.shape,
            strides=ref.stride(),
            dtype=dtype,
            device=ref.device,
            requires_grad=False,
        )
        shape = ref.shape
        self.gradient = real
        self.parts = tuple(p if p.shape == shape else p.expand(shape) for p in parts)
        self.semiring = semiring
        return self

    def __init__(self, *args, **kwargs) -> None:  # attributes are set in __new__
        super().__init__()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from ..rules.registry import dispatch

        return dispatch(func, args, kwargs or {})

    def __repr__(self) -> str:  # printing must not dispatch ops on the wrapper
        return (
            f"Message({self.semiring!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"regular_grad={'yes' if self.gradient is not None else 'no'})"
        )

    def readout(self):
        """The user-facing semiring value (see each semiring's ``readout``)."""
        return self.semiring.readout(self.parts)

    @classmethod
    def seed(cls, gradient: Tensor, semiring: Semiring, regular: bool) -> Message:
        """The message at a backward root: the given gradient, lifted as edge weights.

        For the usual scalar loss the gradient is 1, which lifts to the semiring's one.
        """
        gradient = gradient.detach()
        return cls(gradient if regular else None, semiring.lift(gradient), semiring, gradient.dtype)
