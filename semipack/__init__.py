"""semipack: semiring backpropagation for PyTorch.

with semipack.extend(model, semipack.MaxProd()):
    loss = lossfunc(model(x), y)
    loss.backward()
p.grad, p.semiring_grad
"""

from . import rules  # noqa: F401  (registers the built-in op rules)
from .api import extend, grad
from .errors import MessageLostError, SemipackError, UnsupportedOpError
from .explain import Branches, TokenTypeTable, branches
from .messages import Message, OpCall, register_rule, registered_ops, scoped_rules
from .semirings import (
    Boolean,
    Entropy,
    Extremes,
    KBest,
    LogCount,
    LogSum,
    MaxProd,
    Real,
    Semiring,
    SignedLog,
    SignedMaxProd,
    TopPath,
)

__version__ = "0.1.0"

__all__ = [
    "Boolean",
    "Branches",
    "Entropy",
    "Extremes",
    "KBest",
    "LogCount",
    "LogSum",
    "MaxProd",
    "Message",
    "MessageLostError",
    "OpCall",
    "Real",
    "SemipackError",
    "Semiring",
    "SignedLog",
    "SignedMaxProd",
    "TokenTypeTable",
    "TopPath",
    "UnsupportedOpError",
    "branches",
    "extend",
    "grad",
    "register_rule",
    "registered_ops",
    "scoped_rules",
]
