"""Per-op semiring rules. Importing this package registers every built-in rule."""

from . import (  # noqa: F401  (imported for their registrations)
    arithmetic,
    attention,
    contractions,
    convolution,
    embedding,
    interpolation,
    normalization,
    pointwise,
    pooling,
    resampling,
    scan,
    softmax,
    structural,
    unfolding,
)
from .registry import OpCall, register_rule, registered_ops, rule_for

__all__ = ["OpCall", "register_rule", "registered_ops", "rule_for"]
