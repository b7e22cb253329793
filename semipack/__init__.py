"""semipack: semiring backpropagation for PyTorch.

with semipack.extend(model, semipack.MaxProd()):
    loss = lossfunc(model(x), y)
    loss.backward()
p.grad, p.semiring_grad
"""

from . import distributed, rules  # noqa: F401  (rules registers the built-in op rules)
from .api import extend, grad
from .errors import (
    MessageLostError,
    ModuleHooksError,
    PerSampleError,
    SemipackError,
    StateShapeError,
    UnsupportedOpError,
)
from .explain import (
    AttentionLayer,
    Branches,
    LayerFlow,
    TokenTypeTable,
    branches,
    explain_layers,
)
from .kernels.weight_cache import set_weight_cache_bytes
from .messages import Message, OpCall, register_rule, registered_ops, scoped_rules
from .monitor import Monitor
from .semirings import (
    Boolean,
    Entropy,
    EntropyFlow,
    Extremes,
    KBest,
    LogCount,
    LogSum,
    MaxProd,
    Product,
    Real,
    Semiring,
    SignedLog,
    SignedMaxProd,
    TopPath,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionLayer",
    "Boolean",
    "Branches",
    "Entropy",
    "EntropyFlow",
    "Extremes",
    "KBest",
    "LayerFlow",
    "LogCount",
    "LogSum",
    "MaxProd",
    "Message",
    "MessageLostError",
    "ModuleHooksError",
    "Monitor",
    "OpCall",
    "PerSampleError",
    "Product",
    "Real",
    "SemipackError",
    "Semiring",
    "SignedLog",
    "SignedMaxProd",
    "StateShapeError",
    "TokenTypeTable",
    "TopPath",
    "UnsupportedOpError",
    "branches",
    "distributed",
    "explain_layers",
    "extend",
    "grad",
    "register_rule",
    "registered_ops",
    "scoped_rules",
    "set_weight_cache_bytes",
]
