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

#: The package's own semirings: tested against the oracles, so ``base.check_definition``
#: passes them by. Exactly these classes: a subclass or another class in the package is checked.
BUILT_IN = frozenset(
    (Boolean, Entropy, KBest, LogCount, LogSum, MaxProd, Product, Real, SignedMaxProd, TopPath)
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
