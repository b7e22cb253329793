"""Built-in semirings. Each is a small class; see ``base.Semiring`` for how to add one."""

from .base import Semiring, State
from .boolean import Boolean
from .entropy import Entropy, EntropyFlow
from .k_best import KBest
from .log_sum import LogCount, LogSum
from .max_prod import MaxProd
from .product import Product
from .real import Real
from .signed_max_prod import Extremes, SignedLog, SignedMaxProd
from .top_path import TopPath

__all__ = [
    "Boolean",
    "Entropy",
    "EntropyFlow",
    "Extremes",
    "KBest",
    "LogCount",
    "LogSum",
    "MaxProd",
    "Product",
    "Real",
    "Semiring",
    "SignedLog",
    "SignedMaxProd",
    "State",
    "TopPath",
]
