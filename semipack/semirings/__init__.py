"""Built-in semirings. Each is a small class; see ``base.Semiring`` for how to add one."""

from .base import Semiring, State, register_built_in
from .boolean import Boolean
from .entropy import Entropy, EntropyFlow
from .k_best import KBest
from .log_sum import LogCount, LogSum
from .max_prod import MaxProd
from .product import Product
from .real import Real
from .signed_max_prod import Extremes, SignedLog, SignedMaxProd
from .top_path import TopPath

# tested against the oracles: ``base.check_definition`` passes exactly these classes by
register_built_in(
    Boolean, Entropy, KBest, LogCount, LogSum, MaxProd, Product, Real, SignedMaxProd, TopPath
)

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
