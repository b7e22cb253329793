"""Messages and the math on them, written once for op rules and module extensions.

``message`` holds the ``Message`` tensor subclass and ``OpCall``, the call object rules receive;
``rule_table`` the op -> rule table; the other modules the message math shared by rules and
extensions (row-wise exclusive reductions, normalisation, shared-shift BLAS products, dense
Jacobian contraction, convolution windows, top-path traces).
"""

from .message import Message, OpCall, call_by_name, per_component, wrap_outputs
from .rule_table import (
    FORWARD_ROUTES,
    register_rule,
    registered_ops,
    route_forward,
    rule_for,
    scoped_rules,
)

__all__ = [
    "FORWARD_ROUTES",
    "Message",
    "OpCall",
    "call_by_name",
    "per_component",
    "register_rule",
    "registered_ops",
    "route_forward",
    "rule_for",
    "scoped_rules",
    "wrap_outputs",
]
