"""Fused recurrent kernels (oneDNN, cuDNN, MIOpen), drawn as their reference decomposition.

Whatever kernel PyTorch picks for ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``, the graph is the one its
native CPU implementation records (float64, or ``torch.backends.mkldnn`` off), so every kernel
gives the same semiring values:

- per layer and direction, the input gates of all steps at once, ``gx = linear(x, W_ih, b_ih)``;
  then per step, in the direction's order:
- **LSTM**: ``gates = linear(h, W_hh, b_hh) + gx[t]`` (all four gates at once), chunked into
  i, f, g, o; ``i, f, o = sigmoid(.)``, ``g = tanh(.)``; ``c' = f * c + i * g``;
  ``h' = o * tanh(c')``, and with ``proj_size`` ``h' = (o * tanh(c')) @ W_hrᵀ``;
- **GRU**: ``x_r, x_z, x_n = gx[t]``; ``hh_r, hh_z, hh_n = linear(h, W_hh, b_hh)``;
  ``r = sigmoid(hh_r + x_r)``, ``z = sigmoid(hh_z + x_z)``, ``n = tanh(x_n + hh_n * r)``,
  ``h' = (h - n) * z + n``: as recorded, not ``(1 - z) * n + z * h``, so n reaches h' on two
  edges (weights -z and 1) and the path count through n doubles;
- **RNN**: ``h' = tanh(linear(h, W_hh, b_hh) + gx[t])`` (or relu);
- a packed sequence runs step t on its first ``batch_sizes[t]`` sequences, the others keep their
  state; bidirectional layers concatenate both directions' outputs along features; h_n / c_n stack
  the final states of every layer and direction; dropout between layers is the ordinary dropout
  op (oneDNN and the native path apply it outside the kernel; inside cuDNN / MIOpen its mask cannot
  be recovered, so the rule raises).

Slices, stacks and concatenations only move entries (one edge of weight 1 each), so they do not
change any path product; every other op above is an edge set of its own.

The rules compute the regular gradient with the kernel's own backward (``.grad`` is bitwise a
plain backward's) and the semiring state by recomputing the forward of the layer from the kernel's
saved inputs, without autograd (ops inside ``__torch_dispatch__`` record no graph), and walking
the steps backwards with the semiring's ``scale`` / ``plus`` / ``matmul`` (``recurrent_cells``).
The recomputed activations are about the kernel's own workspace and live only during the rule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..graph.provenance import current_site
from ..graph.sites import Site
from ..messages import OpCall, register_rule
from ..semirings.base import Semiring, State
from .recurrent_cells import (
    CellKind,
    CellWeights,
    GruStep,
    LstmStep,
    gru_gate_messages,
    gru_step,
    lstm_gate_messages,
    lstm_step,
    rnn_gate_messages,
    rnn_step,
    state_cat,
    state_chunk,
    state_or_zero,
    state_rows,
    state_t,
    wrap_outputs,
)

aten = torch.ops.aten


@dataclass(frozen=True)
class Schedule:
    """Which rows each step reads, for inputs laid out as packed rows [N, features].

    Step t covers rows ``offsets[t] : offsets[t] + sizes[t]`` of the input and output, and the
    first ``sizes[t]`` batch entries of the state (sizes never grow with t). A padded [T, B]
    sequence is the packed one with every size B.
    """

    sizes: tuple[int, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        """Row offset of each time step in the packed rows."""
        out, total = [], 0
        for s in self.sizes:
            out.append(total)
            total += s
        return tuple(out)

    def order(self, reverse: bool) -> list[int]:
        """The time steps in the order the backward visits them (last first, reversed
        for the backward direction of a bidirectional layer)."""
        steps = list(range(len(self.sizes)))
        return steps[::-1] if reverse else steps


@dataclass
class Tracer:
    """Names the states inside a fused kernel for path-recording semirings (TopPath): each
    step's hidden (and cell) state becomes a node of the path readout, as the native graph's
    ops are. A no-op for every other semiring."""

    sr: Semiring
    module: str | None = None
    enabled: bool = field(init=False)

    def __post_init__(self) -> None:
        self.enabled = self.sr.trace is not None  # a path-recording pass (Semiring.bound_to)
        if self.enabled:
            self.module = current_site()[1]

    def record(self, m: State, what: str) -> State:
        """Give the entries of state ``m`` fresh path ids named ``what`` (path-recording
        semirings only)."""
        if not self.enabled:
            return m
        where = self.module if self.module is not None else "<unnamed>"
        site = Site(where, what, ("batch", "unit"))
        return self.sr.trace.relabel_state(self.sr, m, what, self.module, site)


# --- one direction of one layer ---------------------------------------------------------------


@dataclass
class DirectionRun:
    """The recomputed forward of one direction: per step what its edges weigh, and the state
    each step read (``h_prev`` [b, P] per step)."""

    steps: list[LstmStep | GruStep | Tensor]
    h_prev: list[Tensor]


def run_direction(
    kind: CellKind,
    w: CellWeights,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    sched: Schedule,
    reverse: bool,
) -> tuple[Tensor, Tensor, Tensor | None, DirectionRun]:
    """Forward of one direction over packed rows x [N, in]: (output [N, P], h_n [B, P],
    c_n [B, H] or None, what the backward needs)."""
    gx = F.linear(x, w.w_ih, w.b_ih)
    h, c = h0.clone(), None if c0 is None else c0.clone()
    out = x.new_empty(x.shape[0], h0.shape[-1])
    n_steps = len(sched.sizes)
    run = DirectionRun([None] * n_steps, [None] * n_steps)
    for t in sched.order(reverse):
        rows, start = sched.sizes[t], sched.offsets[t]
        gx_t, h_t = gx[start : start + rows], h[:rows].clone()
        if kind is CellKind.LSTM:
            h_new, c_new, saved = lstm_step(gx_t, h_t, c[:rows].clone(), w)
            c[:rows] = c_new
        elif kind is CellKind.GRU:
            h_new, saved = gru_step(gx_t, h_t, w)
        else:
            h_new = saved = rnn_step(gx_t, h_t, w, kind)
        h[:rows] = h_new
        out[start : start + rows] = h_new
        run.steps[t], run.h_prev[t] = saved, h_t
    return out, h, c, run


@dataclass
class DirectionMessages:
    """Messages of one direction: to its input rows [N, in], h0 [B, P], c0 [B, H] (LSTM) and
    its parameters (in ``CellWeights`` order, None for absent ones)."""

    x: State
    h0: State
    c0: State | None
    weights: list[State | None]


def _step_messages(
    sr: Semiring,
    kind: CellKind,
    w: CellWeights,
    m_h: State,
    m_c: State | None,
    saved,
    record_cell: Callable[[State], State],
) -> tuple[State, State, State, State | None]:
    """(input gates, hidden gates, h before the step, c before the step) for one step, given
    the messages on the step's hidden output m_h [b, P] and on its cell state m_c [b, H] from
    the cell state's later uses."""
    if kind is CellKind.LSTM:
        m_raw = m_h if w.w_hr is None else sr.matmul(m_h, w.w_hr)
        m_gates, m_c_prev = lstm_gate_messages(sr, m_raw, m_c, saved, record_cell)
        return m_gates, m_gates, sr.matmul(m_gates, w.w_hh), m_c_prev
    if kind is CellKind.GRU:
        m_gx, m_hh, m_direct = gru_gate_messages(sr, m_h, saved)
        return m_gx, m_hh, sr.plus(m_direct, sr.matmul(m_hh, w.w_hh)), None
    m_pre = rnn_gate_messages(sr, m_h, saved, kind)
    return m_pre, m_pre, sr.matmul(m_pre, w.w_hh), None


def _replace_rows(state: State, rows: int, head: State) -> State:
    """``state`` with its first ``rows`` entries replaced by ``head`` (out of place)."""
    return tuple(torch.cat([h, s[rows:]], 0) for h, s in zip(head, state, strict=True))


def direction_messages(
    sr: Semiring,
    kind: CellKind,
    w: CellWeights,
    x: Tensor,
    run: DirectionRun,
    sched: Schedule,
    reverse: bool,
    m_out: State,
    m_hn: State,
    m_cn: State | None,
    tracer: Tracer,
    label: str,
) -> DirectionMessages:
    """Walk one direction's steps backwards from the messages on its output rows m_out [N, P]
    and final states m_hn [B, P], m_cn [B, H]."""
    m_h, m_c = m_hn, m_cn
    n_steps = len(sched.sizes)
    m_gx: list[State] = [()] * n_steps
    m_hh: list[State] = [()] * n_steps
    m_hout: list[State] = [()] * n_steps
    for t in reversed(sched.order(reverse)):
        rows, start = sched.sizes[t], sched.offsets[t]
        m_h_t = sr.plus(state_rows(m_h, 0, rows), state_rows(m_out, start, start + rows))
        m_h_t = tracer.record(m_h_t, f"{label} hidden state, step {t}")
        m_c_t = None if m_c is None else state_rows(m_c, 0, rows)
        m_gx[t], m_hh[t], m_h_prev, m_c_prev = _step_messages(
            sr,
            kind,
            w,
            m_h_t,
            m_c_t,
            run.steps[t],
            functools.partial(tracer.record, what=f"{label} cell state, step {t}"),
        )
        m_hout[t] = m_h_t
        m_h = _replace_rows(m_h, rows, m_h_prev)
        if m_c is not None:
            m_c = _replace_rows(m_c, rows, m_c_prev)
    return _parameter_messages(sr, w, x, run, m_gx, m_hh, m_hout, m_h, m_c)


def _parameter_messages(
    sr: Semiring,
    w: CellWeights,
    x: Tensor,
    run: DirectionRun,
    m_gx: list[State],
    m_hh: list[State],
    m_hout: list[State],
    m_h0: State,
    m_c0: State | None,
) -> DirectionMessages:
    """Messages to the input and the parameters, over all steps at once: every step is a
    separate use of W_hh (and every row of x a separate row of the input linear), so their
    contributions meet in one semiring matmul over the rows."""
    gx_all, hh_all = state_cat(m_gx, 0), state_cat(m_hh, 0)  # [N, G], rows in step order
    h_prev = torch.cat(run.h_prev, 0)  # [N, P]
    m_x = sr.matmul(gx_all, w.w_ih)
    weights: list[State | None] = [
        sr.matmul(state_t(gx_all), x),
        sr.matmul(state_t(hh_all), h_prev),
        None if w.b_ih is None else sr.sum(gx_all, [0]),
        None if w.b_hh is None else sr.sum(hh_all, [0]),
        None,
    ]
    if w.w_hr is not None:
        h_raw = torch.cat([s.h_raw for s in run.steps], 0)  # [N, H]
        weights[4] = sr.matmul(state_t(state_cat(m_hout, 0)), h_raw)
    return DirectionMessages(m_x, m_h0, m_c0, weights)


# --- a stack of layers (cuDNN, MIOpen) --------------------------------------------------------


@dataclass
class StackSpec:
    """A whole recurrent module as a fused kernel sees it."""

    kind: CellKind
    layers: int
    directions: int
    sched: Schedule
    weights: list[CellWeights]  # index layer * directions + direction


def stack_messages(
    sr: Semiring,
    spec: StackSpec,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    m_out: State,
    m_hn: State,
    m_cn: State | None,
    tracer: Tracer,
) -> tuple[State, list[DirectionMessages]]:
    """Messages to the input rows x [N, in] and to every layer and direction, given messages
    on the output rows m_out [N, D*P], h_n [L*D, B, P] and c_n [L*D, B, H].

    The forward is recomputed one layer at a time, keeping only each layer's input; the
    backward recomputes a layer's steps again just before walking them, so at most one layer's
    activations are held at once.
    """
    inputs = [x]
    for layer in range(spec.layers - 1):
        inputs.append(_layer_forward(spec, layer, inputs[-1], h0, c0)[0])
    per_direction: list[DirectionMessages | None] = [None] * (spec.layers * spec.directions)
    m_layer_out = m_out
    for layer in reversed(range(spec.layers)):
        _, runs = _layer_forward(spec, layer, inputs[layer], h0, c0)
        m_dirs = state_chunk(m_layer_out, spec.directions, -1)
        m_input = None
        for d in range(spec.directions):
            k = layer * spec.directions + d
            got = direction_messages(
                sr,
                spec.kind,
                spec.weights[k],
                inputs[layer],
                runs[d],
                spec.sched,
                d == 1,
                m_dirs[d],
                tuple(c[k] for c in m_hn),
                None if m_cn is None else tuple(c[k] for c in m_cn),
                tracer,
                f"layer {layer}{' reverse' if d == 1 else ''}",
            )
            per_direction[k] = got
            m_input = got.x if m_input is None else sr.plus(m_input, got.x)
        del runs
        m_layer_out = m_input
    return m_layer_out, per_direction


def _layer_forward(
    spec: StackSpec, layer: int, x: Tensor, h0: Tensor, c0: Tensor | None
) -> tuple[Tensor, list[DirectionRun]]:
    outs, runs = [], []
    for d in range(spec.directions):
        k = layer * spec.directions + d
        out, _, _, run = run_direction(
            spec.kind, spec.weights[k], x, h0[k], None if c0 is None else c0[k], spec.sched, d == 1
        )
        outs.append(out)
        runs.append(run)
    return torch.cat(outs, -1), runs


# --- the rules --------------------------------------------------------------------------------


@register_rule(aten.mkldnn_rnn_layer_backward.default)
def mkldnn_rnn_layer_backward(call: OpCall):
    """oneDNN's LSTM: one layer and direction per call, time-major input [T, B, in]; dropout
    and the layer stack are ordinary ops around it. Returns (input, W_ih, W_hh, b_ih, b_hh,
    hx, cx)."""
    kind = CellKind(call["mode"])
    if kind is not CellKind.LSTM:
        raise call.error(f"oneDNN {kind.name} layers are not supported (only LSTM is)")
    if call["batch_sizes"]:
        raise call.error("a packed sequence inside a oneDNN RNN layer is not supported")
    dtype = call.weight_dtype
    x = call["input"].to(dtype)
    steps, batch = x.shape[0], x.shape[1]
    has_bias = bool(call["has_biases"])
    w = CellWeights(
        call["weight1"].to(dtype),
        call["weight2"].to(dtype),
        call["weight3"].to(dtype) if has_bias else None,
        call["weight4"].to(dtype) if has_bias else None,
    )
    h0, c0 = call["hx_"].to(dtype), call["cx_tmp"].to(dtype)
    sched = Schedule((batch,) * steps)
    reverse = bool(call["reverse"])
    rows = x.reshape(steps * batch, -1)
    _, _, _, run = run_direction(kind, w, rows, h0, c0, sched, reverse)
    m_out = state_or_zero(call, call["grad_output"], call["output"].shape)
    got = direction_messages(
        call.semiring,
        kind,
        w,
        rows,
        run,
        sched,
        reverse,
        tuple(c.reshape(steps * batch, -1) for c in m_out),
        state_or_zero(call, call["grad_hy"], h0.shape),
        state_or_zero(call, call["grad_cy"], c0.shape),
        Tracer(call.semiring),
        "reverse" if reverse else "forward",
    )
    del run
    m_x = tuple(c.reshape(x.shape) for c in got.x)
    return wrap_outputs(call, call.run_regular(), [m_x, *got.weights[:4], got.h0, got.c0])


def _stack_spec(
    call: OpCall, kind: CellKind, proj_size: int, sched: Schedule, dtype: torch.dtype
) -> StackSpec:
    """The layer weights from the flat list the fused kernel takes: per layer and direction
    [w_ih, w_hh, (b_ih, b_hh), (w_hr)], ``weight_stride0`` tensors each."""
    flat, stride = list(call["weight"]), call["weight_stride0"]
    has_proj = proj_size > 0
    has_bias = stride - 2 - int(has_proj) == 2
    directions = 2 if call["bidirectional"] else 1
    weights = []
    for k in range(len(flat) // stride):
        p = [t.to(dtype) for t in flat[k * stride : (k + 1) * stride]]
        weights.append(
            CellWeights(
                p[0],
                p[1],
                p[2] if has_bias else None,
                p[3] if has_bias else None,
                p[-1] if has_proj else None,
            )
        )
    return StackSpec(kind, call["num_layers"], directions, sched, weights)


def _time_major_rows(call: OpCall, t: Tensor) -> tuple[Tensor, Schedule]:
    """A kernel input or output as packed rows [N, features], and its schedule: packed data
    already is; [T, B, ...] (or [B, T, ...] with ``batch_first``) is flattened time-major."""
    if call["batch_sizes"]:
        return t, Schedule(tuple(int(s) for s in call["batch_sizes"]))
    if call["batch_first"]:
        t = t.transpose(0, 1)
    return t.reshape(t.shape[0] * t.shape[1], -1), Schedule((t.shape[1],) * t.shape[0])


def _fused_stack_backward(call: OpCall, proj_size: int):
    """cuDNN / MIOpen: the whole module in one kernel. Returns (input, hx, cx, [weights])."""
    kind = CellKind(call["mode"])
    if call["dropout"] and call["train"] and call["num_layers"] > 1:
        raise call.error(
            "dropout between layers inside a fused RNN kernel cannot be replayed (its mask "
            "stays inside the kernel); disable the fused kernel (torch.backends.cudnn.flags("
            "enabled=False)) so that dropout runs as an ordinary op, or use eval mode"
        )
    dtype = call.weight_dtype
    rows, sched = _time_major_rows(call, call["input"].to(dtype))
    spec = _stack_spec(call, kind, proj_size, sched, dtype)
    h0 = call["hx"].to(dtype)
    c0 = call["cx"].to(dtype) if kind is CellKind.LSTM else None
    m_out = state_or_zero(call, call["grad_output"], call["output"].shape)
    m_out = tuple(_time_major_rows(call, c)[0] for c in m_out)
    m_hn = state_or_zero(call, call["grad_hy"], h0.shape)
    m_cn = None if c0 is None else state_or_zero(call, call["grad_cy"], c0.shape)
    m_x, per_direction = stack_messages(
        call.semiring, spec, rows, h0, c0, m_out, m_hn, m_cn, Tracer(call.semiring)
    )
    return _fused_stack_outputs(call, spec, m_x, per_direction, c0 is not None)


def _fused_stack_outputs(
    call: OpCall,
    spec: StackSpec,
    m_x: State,
    per_direction: list[DirectionMessages],
    has_cell: bool,
):
    """The kernel's outputs (input, hx, cx, [weights]) as messages, in its own layouts; an
    output the kernel was not asked for (``output_mask``) carries no state."""
    x = call["input"]
    if call["batch_first"] and not call["batch_sizes"]:
        m_x = tuple(c.reshape(x.shape[1], x.shape[0], -1).transpose(0, 1) for c in m_x)
    m_x = tuple(c.reshape(x.shape) for c in m_x)
    m_hx = tuple(torch.stack(c, 0) for c in zip(*(d.h0 for d in per_direction), strict=True))
    m_cx = None
    if has_cell:
        m_cx = tuple(torch.stack(c, 0) for c in zip(*(d.c0 for d in per_direction), strict=True))
    m_weights = [
        m for d, w in zip(per_direction, spec.weights, strict=True) for m in _present(d, w)
    ]
    mask = list(call["output_mask"])
    regular = call.run_regular()
    if regular is None:
        regular = (None, None, None, [None] * len(m_weights) if mask[3] else [])
    states = [m if wanted else None for m, wanted in zip((m_x, m_hx, m_cx), mask, strict=False)]
    outs = wrap_outputs(call, regular[:3], states)
    if not mask[3]:
        return (*outs, list(regular[3]))
    return (*outs, list(wrap_outputs(call, regular[3], m_weights)))


def _present(messages: DirectionMessages, w: CellWeights) -> list[State]:
    """The messages of the parameters a layer has, in the kernel's flat order."""
    params = (w.w_ih, w.w_hh, w.b_ih, w.b_hh, w.w_hr)
    return [m for m, p in zip(messages.weights, params, strict=True) if p is not None]


@register_rule(aten._cudnn_rnn_backward.default)
def cudnn_rnn_backward(call: OpCall):
    """cuDNN RNN/LSTM/GRU layers, drawn as the native cell equations."""
    return _fused_stack_backward(call, int(call["proj_size"]))


@register_rule(aten.miopen_rnn_backward.default)
def miopen_rnn_backward(call: OpCall):
    """MIOpen RNN/LSTM/GRU layers, drawn as the native cell equations."""
    return _fused_stack_backward(call, 0)
