"""Per-op semiring rules. Importing this package registers every built-in rule."""

from ..messages import FORWARD_ROUTES, OpCall, register_rule, registered_ops, rule_for
from . import (  # noqa: F401  (imported for their registrations)
    arithmetic,
    attention,
    contractions,
    convolution,
    drawings,
    embedding,
    inspection,
    interpolation,
    normalization,
    packing,
    pointwise,
    pooling,
    recurrent,
    recurrent_cells,
    resampling,
    scan,
    softmax,
    structural,
    unfolding,
    weight_norm,
)
from .drawings import DRAWINGS, drawing_routes

__all__ = [
    "DRAWINGS",
    "FORWARD_ROUTES",
    "OpCall",
    "drawing_routes",
    "register_rule",
    "registered_ops",
    "rule_for",
]
