"""Ops that inspect a message instead of transforming it (anomaly mode's NaN check).

``torch.autograd.detect_anomaly()`` asks every backward output whether it holds NaN. A message
holds NaN when its regular gradient or a floating state component does, so these return a
plain boolean tensor of the message's shape.
"""

from __future__ import annotations

import torch

from ..messages import OpCall, register_rule

aten = torch.ops.aten


@register_rule(aten.isnan.default)
def isnan(call: OpCall) -> torch.Tensor:
    """``isnan`` of a message (anomaly mode's check): answered on the regular gradient and
    the state, so NaN states are reported as PyTorch reports NaN gradients."""
    msg = call["self"]
    found = torch.zeros(msg.shape, dtype=torch.bool, device=msg.device)
    for part in (msg.regular_grad, *msg.parts):
        if part is not None and part.is_floating_point():
            found |= torch.isnan(part)
    return found
