"""layer_norm, batch_norm, group_norm, rms_norm's fused kernel: normalisation couples a whole row
(or channel) of entries.

For y_i = g_i * x̂_i + b_i with x̂ = (x - mean) * rstd over n entries, the local derivatives are
∂y_i/∂x_j = g_i * rstd * (δ_ij - 1/n - x̂_i x̂_j / n): every input entry feeds every output entry
of its row. In eval mode batch_norm uses running statistics, so it is a per-channel scaling.
group_norm's rows are the (sample, group) pairs: C/G channels times the spatial positions, with a
gain per channel, so its gain varies along the row and from group to group ([rows, n]).
Real uses the closed form and, on large rows, the other built-in semirings use the fused kernels
of ``kernels.normalization``; everything else contracts the dense Jacobian block by block.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..graph.provenance import current_site
from ..messages import OpCall, register_rule
from ..messages.jacobian import contract_rows, identity_block
from ..messages.normalization import affine_param_messages, normalized_messages
from ..semirings.base import Semiring, State

aten = torch.ops.aten


def normalized_contract(
    sr: Semiring, m: State, x_hat: Tensor, rstd: Tensor, gain: Tensor, gain_per_row: bool
) -> State:
    """Messages through rows of a normalisation; ``m``, ``x_hat``: [rows, n]; ``rstd``: [rows];
    ``gain``: [n] per entry (layer_norm), [rows] per row (``gain_per_row``: batch_norm's
    channels) or [rows, n] per row and entry (group_norm's channels)."""
    fast = normalized_messages(sr, m, x_hat, rstd, gain, gain_per_row)
    if fast is not None:
        return fast
    return normalized_contract_dense(sr, m, x_hat, rstd, gain, gain_per_row)


def normalized_contract_dense(
    sr: Semiring, m: State, x_hat: Tensor, rstd: Tensor, gain: Tensor, gain_per_row: bool
) -> State:
    """``normalized_contract`` through the dense Jacobian: correct for every semiring, O(n^2)."""
    n = x_hat.shape[-1]

    def jac(rows: slice, cols: slice) -> Tensor:
        xh = x_hat[rows]
        eye = identity_block(n, cols, xh.dtype, xh.device)
        centred = eye[None] - (1.0 + xh[:, :, None] * xh[:, None, cols]) / n
        return gain_block(gain, gain_per_row, rows) * rstd[rows, None, None] * centred

    return contract_rows(sr, m, jac, n)


def gains(weight: Tensor | None, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The [n] gains of a norm's entries (layer_norm) or channels (batch_norm): its affine
    weight, flattened, or ones on the input's device for a norm without affine parameters."""
    if weight is not None:
        return weight.to(dtype).reshape(n)
    return torch.ones(n, dtype=dtype, device=device)


def gain_block(gain: Tensor, gain_per_row: bool, rows: slice) -> Tensor:
    """The output entries' gains for a block of rows, shaped to broadcast over [rows, n, cols]."""
    if gain_per_row:
        return gain[rows, None, None]
    if gain.dim() == 2:
        return gain[rows, :, None]
    return gain[None, :, None]


def _outputs(call: OpCall, regular, grad_in, grad_w, grad_b, mask):
    reals = list(regular) if regular is not None else [None, None, None]
    outs = []
    for want, parts, r in zip(mask, (grad_in, grad_w, grad_b), reals, strict=True):
        outs.append(call.wrap(r, parts) if want and parts is not None else r)
    return tuple(outs)


@register_rule(aten.native_layer_norm_backward.default)
def layer_norm_backward(call: OpCall):
    """Layer norm: the exact Jacobian of the normalised row (all pairs in the row) times
    the gain, plus the gain's and bias's edges."""
    msg, x = call["grad_out"], call["input"]
    mask = call["output_mask"]
    n = math.prod(call["normalized_shape"])
    dtype = call.weight_dtype
    rows = x.numel() // n
    x_hat = ((x - call["mean"]) * call["rstd"]).to(dtype).reshape(rows, n)
    rstd = call["rstd"].to(dtype).reshape(rows)
    weight = call["weight"]
    gain = gains(weight, n, dtype, x.device)
    m = tuple(p.reshape(rows, n) for p in msg.parts)
    sr = call.semiring
    grad_in = grad_w = grad_b = None
    if mask[0]:
        grad_in = tuple(
            p.reshape(x.shape) for p in normalized_contract(sr, m, x_hat, rstd, gain, False)
        )
    if mask[1] or mask[2]:
        w, b = affine_param_messages(sr, tuple(p[..., None] for p in m), x_hat[..., None])
        shape = tuple(call["normalized_shape"])
        grad_w = tuple(p.reshape(shape) for p in w) if mask[1] and weight is not None else None
        grad_b = (
            tuple(p.reshape(shape) for p in b) if mask[2] and call["bias"] is not None else None
        )
    return _outputs(call, call.run_regular(), grad_in, grad_w, grad_b, mask)


@register_rule(aten.native_batch_norm_backward.default)
def batch_norm_backward(call: OpCall):
    """Batch norm (train: statistics over the batch couple every entry of a channel;
    eval: a per-channel affine map) and the gain's and bias's edges."""
    msg, mask = call["grad_out"], call["output_mask"]
    if not call["train"]:
        invstd = (call["running_var"].to(call.weight_dtype) + call["eps"]).rsqrt()
        return _batch_norm_eval(call, msg, call["running_mean"], invstd, mask)
    return _batch_norm_train(call, msg, call["save_mean"], call["save_invstd"], mask)


@register_rule(aten.cudnn_batch_norm_backward.default)
@register_rule(aten.miopen_batch_norm_backward.default)
def fused_batch_norm_backward(call: OpCall):
    """cuDNN's and MIOpen's batch norm backward. Autograd calls them for train mode only (eval
    mode takes ``native_batch_norm_backward``), and they return all three gradients; their
    ``save_var`` is the saved inverse standard deviation, as ``save_invstd`` is for the
    native kernel. Drawn as the native kernel's graph."""
    mean, invstd = call["save_mean"], call["save_var"]
    return _batch_norm_train(call, call["grad_output"], mean, invstd, (True, True, True))


def _batch_norm_train(call: OpCall, msg, mean: Tensor, invstd: Tensor, mask):
    """Train mode: the batch's statistics couple every entry of a channel, so the messages
    run over channel rows. ``input``: [N, C, *spatial]; ``mean``, ``invstd``: [C]."""
    x = call["input"]
    dtype = call.weight_dtype
    channels = x.shape[1]
    rows = x.movedim(1, 0).reshape(channels, -1).to(dtype)
    mean, invstd = mean.to(dtype), invstd.to(dtype)
    x_hat = (rows - mean[:, None]) * invstd[:, None]
    weight = call["weight"]
    gain = gains(weight, channels, dtype, x.device)
    m = tuple(p.movedim(1, 0).reshape(channels, -1) for p in msg.parts)
    sr = call.semiring

    def back(parts: State) -> State:
        moved = (channels, x.shape[0], *x.shape[2:])
        return tuple(p.reshape(moved).movedim(0, 1) for p in parts)

    grad_in = grad_w = grad_b = None
    if mask[0]:
        grad_in = back(normalized_contract(sr, m, x_hat, invstd, gain, True))
    if mask[1] or mask[2]:
        w, b = affine_param_messages(sr, tuple(p[None] for p in m), x_hat[None])
        grad_w = w if mask[1] and weight is not None else None
        grad_b = b if mask[2] else None
    return _outputs(call, call.run_regular(), grad_in, grad_w, grad_b, mask)


def _batch_norm_eval(call: OpCall, msg, mean: Tensor, invstd: Tensor, mask):
    """Eval mode: a per-channel affine map, in the input's own layout. Channel rows would copy
    the input and the message (and hand back a strided view) for what broadcasting does in
    place: each output entry has one edge from its input entry (``gain * invstd`` of its
    channel), one from its channel's gain (x̂) and one from the bias."""
    x = call["input"]
    dtype = call.weight_dtype
    channels = x.shape[1]
    per_channel = (1, channels, *([1] * (x.dim() - 2)))
    mean, invstd = mean.to(dtype).reshape(per_channel), invstd.to(dtype).reshape(per_channel)
    weight = call["weight"]
    sr = call.semiring
    grad_in = grad_w = grad_b = None
    if mask[0]:
        gain = gains(weight, channels, dtype, x.device).reshape(per_channel)
        grad_in = sr.scale(msg.parts, gain * invstd)
    if mask[1] or mask[2]:
        rows = (x.shape[0], channels, -1)
        w, b = affine_param_messages(
            sr,
            tuple(p.reshape(rows) for p in msg.parts),
            x.to(dtype).reshape(rows),
            mean.reshape(1, channels, 1),
            invstd.reshape(1, channels, 1),
        )
        grad_w = w if mask[1] and weight is not None else None
        grad_b = b if mask[2] else None
    return _outputs(call, call.run_regular(), grad_in, grad_w, grad_b, mask)


@register_rule(aten.native_group_norm_backward.default)
def group_norm_backward(call: OpCall):
    """Messages of ``group_norm``: a layer norm per (sample, group) with per-channel gains.

    ``grad_out``, ``input``: [N, C, *spatial]; ``mean``, ``rstd``: [N, G]; ``weight``: [C].
    The (sample, group) rows hold n = C/G * HxW entries; the gain of an entry is its channel's.
    """
    msg, x = call["grad_out"], call["input"]
    mask, groups = call["output_mask"], call["group"]
    batch, channels = x.shape[0], x.shape[1]
    dtype = call.weight_dtype
    weight = call["weight"]
    grad_in = grad_w = grad_b = None
    if x.numel() == 0:  # no output entries, so no edges at all
        grad_in = call.zeros(x.shape) if mask[0] else None
        grad_w = call.zeros((channels,)) if mask[1] and weight is not None else None
        grad_b = call.zeros((channels,)) if mask[2] else None
        return _outputs(call, call.run_regular(), grad_in, grad_w, grad_b, mask)
    rows, n = batch * groups, x.numel() // (batch * groups)
    grouped = x.to(dtype).reshape(batch, groups, -1)
    mean, rstd = call["mean"].to(dtype), call["rstd"].to(dtype)
    x_hat = (grouped - mean[..., None]) * rstd[..., None]  # [N, G, n]
    sr = call.semiring
    if mask[0]:
        m = tuple(p.reshape(rows, n) for p in msg.parts)
        gain = _group_gains(weight, batch, groups, n, dtype, x.device)
        out = normalized_contract(sr, m, x_hat.reshape(rows, n), rstd.reshape(rows), gain, False)
        grad_in = tuple(p.reshape(x.shape) for p in out)
    if mask[1] or mask[2]:
        per_channel = (batch, channels, -1)
        m = tuple(p.reshape(per_channel) for p in msg.parts)
        w, b = affine_param_messages(sr, m, x_hat.reshape(per_channel))
        grad_w = w if mask[1] and weight is not None else None
        grad_b = b if mask[2] else None
    return _outputs(call, call.run_regular(), grad_in, grad_w, grad_b, mask)


@register_rule(aten._fused_rms_norm_backward.default)
def fused_rms_norm_backward(call: OpCall):
    """RMS norm's fused kernel (``F.rms_norm`` and ``nn.RMSNorm`` where PyTorch has one: CUDA,
    MPS), drawn as the composite the CPU records, so that values do not depend on the device:
    ``y = (x · r) · w`` with ``r = rsqrt(mean(x²) + eps)`` per row. An input entry x_j reaches
    its own output through ``t_j = x_j · r`` (edge r) and every output of its row through x_j²,
    the row's mean, ``a = mean + eps`` and r (edges 2·x_j, 1/n, 1, -r³/2), then ``t_i`` (edge
    x_i); y_i weighs t_i by w_i and w_i by t_i. TopPath's paths step through the same
    intermediate nodes, recorded as the CPU's nodes name them.

    ``grad_out``, ``input``: [..., *normalized_shape]; ``rstd``: [..., 1 per normalized dim];
    ``weight``: normalized_shape or None."""
    msg, x = call["grad_out"], call["input"]
    mask = call["output_mask"]
    shape = tuple(call["normalized_shape"])
    n = math.prod(shape)
    rows = x.numel() // max(n, 1)
    dtype = call.weight_dtype
    sr = call.semiring
    weight = call["weight"]
    x_rows = x.to(dtype).reshape(rows, n)
    r = call["rstd"].to(dtype).reshape(rows, 1)
    m = tuple(p.reshape(rows, n) for p in msg.parts)
    grad_in = grad_w = None
    if mask[1] and weight is not None:
        t = x_rows * r  # the composite's x · r, which the gain multiplies
        grad_w = tuple(p.reshape(shape) for p in sr.sum(sr.scale(m, t), [0]))
    if mask[0]:
        m_t = sr.scale(m, weight.to(dtype).reshape(1, n)) if weight is not None else m
        m_t = _record(sr, m_t, "Mul")
        direct = sr.scale(m_t, r.expand(rows, n))
        m_r = _record(sr, sr.sum(sr.scale(m_t, x_rows), [1], keepdim=True), "Rsqrt")
        m_a = _record(sr, sr.scale(m_r, -0.5 * r**3), "Add")
        m_mean = _record(sr, m_a, "Mean")  # + eps: an edge of weight 1
        m_square = sr.scale(m_mean, torch.full_like(r, 1.0 / n))
        m_square = _record(sr, tuple(p.expand(rows, n) for p in m_square), "Pow")
        via = sr.scale(m_square, 2.0 * x_rows)
        grad_in = tuple(p.reshape(x.shape) for p in sr.plus(direct, via))
    regular = call.run_regular()
    reals = list(regular) if regular is not None else [None, None]
    return tuple(
        call.wrap(real, parts) if want and parts is not None else real
        for want, parts, real in zip(mask, (grad_in, grad_w), reals, strict=True)
    )


def _record(sr: Semiring, m: State, op: str) -> State:
    """For a path-recording pass, ``m`` recorded as the state of a node of the composite
    (``op`` as the CPU's node is named: ``Mul`` for ``MulBackward0``); else ``m``."""
    trace = sr.trace
    if trace is None:
        return m
    _node, module = current_site()
    return trace.relabel_state(sr, tuple(p.contiguous() for p in m), op, module)


def _group_gains(
    weight: Tensor | None, batch: int, groups: int, n: int, dtype: torch.dtype, device
) -> Tensor:
    """Each row entry's gain, [N·G, n]: its channel's weight; without affine parameters one
    gain of 1 for every row, [n]."""
    if weight is None:
        return torch.ones(n, dtype=dtype, device=device)
    per_channel = weight.to(dtype).reshape(groups, -1, 1)  # [G, C/G, 1]
    spatial = n // per_channel.shape[1]
    per_entry = per_channel.expand(-1, -1, spatial).reshape(1, groups, n)
    return per_entry.expand(batch, groups, n).reshape(batch * groups, n)
