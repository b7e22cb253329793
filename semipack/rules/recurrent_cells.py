"""One step of an LSTM, GRU or Elman RNN cell: recomputed forward, and its semiring messages.

The graph of a step is the one PyTorch's native CPU implementation records (see
``semipack.rules.recurrent`` for the whole drawing); the functions here walk that graph backwards
with the semiring's own primitives (``scale`` by an edge weight, ``plus`` where uses meet,
``matmul`` through a weight matrix), so they hold for every semiring, user-defined ones included.
The fused CUDA cell kernels (``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell``) are the
elementwise middle of such a step, and their backward rules live here too.

Shapes: ``b`` rows (batch entries active at this step), ``H`` hidden units, ``P`` the size of the
hidden output (``H``, or ``proj_size`` for an LSTM with projections), ``G`` = gates x ``H``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..messages import OpCall, register_rule
from ..semirings.base import Semiring, State

aten = torch.ops.aten


class CellKind(enum.Enum):
    """The recurrence, numbered as cuDNN, MIOpen and oneDNN number their modes."""

    RNN_RELU = 0
    RNN_TANH = 1
    LSTM = 2
    GRU = 3

    @property
    def gates(self) -> int:
        """Number of gates stacked in the weight matrices (LSTM 4, GRU 3, RNN 1)."""
        return {CellKind.LSTM: 4, CellKind.GRU: 3}.get(self, 1)


@dataclass
class CellWeights:
    """The parameters of one layer and direction, in the precision edge weights are built in.

    ``w_ih`` [G, in], ``w_hh`` [G, P], ``b_ih`` / ``b_hh`` [G] or None, ``w_hr`` [P, H] (LSTM
    projections) or None.
    """

    w_ih: Tensor
    w_hh: Tensor
    b_ih: Tensor | None
    b_hh: Tensor | None
    w_hr: Tensor | None = None


# --- states: tuples of same-shaped tensors, one per semiring component -------------------------


def state_rows(state: State, start: int, stop: int) -> State:
    """Rows ``start:stop`` of every component of ``state``."""
    return tuple(c[start:stop] for c in state)


def state_cat(states: Sequence[State], dim: int) -> State:
    """Concatenate states component by component along ``dim``."""
    return tuple(torch.cat(parts, dim) for parts in zip(*states, strict=True))


def state_chunk(state: State, chunks: int, dim: int) -> list[State]:
    """Split every component of ``state`` into ``chunks`` along ``dim``."""
    return [tuple(parts) for parts in zip(*(c.chunk(chunks, dim) for c in state), strict=True)]


def state_t(state: State) -> State:
    """Transpose the last two dims of every component."""
    return tuple(c.transpose(-1, -2) for c in state)


# --- the recomputed forward of one step (no autograd) -----------------------------------------


@dataclass
class LstmStep:
    """What an LSTM step's edges weigh: the activated gates [b, H] each, the cell state it read
    [b, H], tanh of the cell state it wrote [b, H], and the unprojected output [b, H] (only
    kept with projections)."""

    i: Tensor
    f: Tensor
    g: Tensor
    o: Tensor
    c_prev: Tensor
    tanh_c: Tensor
    h_raw: Tensor | None


@dataclass
class GruStep:
    """What a GRU step's edges weigh: reset and update gates, the new gate, the hidden part of
    the new gate's pre-activation (W_hn h + b_hn), and the hidden state it read; all [b, H]."""

    r: Tensor
    z: Tensor
    n: Tensor
    hh_n: Tensor
    h_prev: Tensor


def lstm_step(gx: Tensor, h: Tensor, c: Tensor, w: CellWeights) -> tuple[Tensor, Tensor, LstmStep]:
    """(h', c', saved) from the input gates ``gx`` = W_ih x + b_ih [b, 4H], h [b, P], c [b, H]."""
    gates = F.linear(h, w.w_hh, w.b_hh) + gx
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    c_new = f * c + i * g
    tanh_c = c_new.tanh()
    h_raw = o * tanh_c
    h_new = h_raw if w.w_hr is None else h_raw.matmul(w.w_hr.t())
    return h_new, c_new, LstmStep(i, f, g, o, c, tanh_c, None if w.w_hr is None else h_raw)


def gru_step(gx: Tensor, h: Tensor, w: CellWeights) -> tuple[Tensor, GruStep]:
    """(h', saved) from the input gates ``gx`` = W_ih x + b_ih [b, 3H] and h [b, H]."""
    x_r, x_z, x_n = gx.chunk(3, 1)
    h_r, h_z, h_n = F.linear(h, w.w_hh, w.b_hh).chunk(3, 1)
    r = (h_r + x_r).sigmoid()
    z = (h_z + x_z).sigmoid()
    n = (x_n + h_n * r).tanh()
    h_new = (h - n) * z + n
    return h_new, GruStep(r, z, n, h_n, h)


def rnn_step(gx: Tensor, h: Tensor, w: CellWeights, kind: CellKind) -> Tensor:
    """h' = act(W_hh h + b_hh + gx) [b, H]."""
    pre = F.linear(h, w.w_hh, w.b_hh) + gx
    return pre.relu() if kind is CellKind.RNN_RELU else pre.tanh()


# --- messages through the elementwise middle of a step ----------------------------------------


def lstm_gate_messages(
    sr: Semiring,
    m_h_raw: State,
    m_c: State,
    step: LstmStep,
    record: Callable[[State], State] | None = None,
) -> tuple[State, State]:
    """Messages on the gate pre-activations [b, 4H] and on the cell state read [b, H].

    ``m_h_raw`` arrives on o * tanh(c') (before any projection), ``m_c`` on c' from its other
    uses (the next step, c_n). Edges, as the native graph has them: h = o * t (o: weight t,
    t: weight o), t = tanh(c') (1 - t²), c' = f * c + i * g (f: c, c: f, i: g, g: i), then the
    sigmoid / tanh of each gate (s(1 - s), 1 - g²). ``record`` sees the whole message on c'.
    """
    m_o = sr.scale(m_h_raw, step.tanh_c)
    m_tanh = sr.scale(m_h_raw, step.o)
    m_c = sr.plus(m_c, sr.scale(m_tanh, 1 - step.tanh_c * step.tanh_c))
    if record is not None:
        m_c = record(m_c)
    m_f = sr.scale(m_c, step.c_prev)
    m_c_prev = sr.scale(m_c, step.f)
    m_i = sr.scale(m_c, step.g)
    m_g = sr.scale(m_c, step.i)
    pre = [
        sr.scale(m_i, step.i * (1 - step.i)),
        sr.scale(m_f, step.f * (1 - step.f)),
        sr.scale(m_g, 1 - step.g * step.g),
        sr.scale(m_o, step.o * (1 - step.o)),
    ]
    return state_cat(pre, 1), m_c_prev


def gru_gate_messages(sr: Semiring, m_h: State, step: GruStep) -> tuple[State, State, State]:
    """Messages on the input gates [b, 3H], on the hidden gates W_hh h + b_hh [b, 3H], and on
    h through its direct use [b, H].

    The native graph computes h' = (h - n) * z + n: n reaches h' on two edges (weight -z through
    the subtraction and the product, weight 1 through the sum), h on one (z), z on one (h - n).
    Then n = tanh(x_n + hh_n * r), r = sigmoid(x_r + hh_r), z = sigmoid(x_z + hh_z).
    """
    m_diff = sr.scale(m_h, step.z)
    m_z = sr.scale(m_h, step.h_prev - step.n)
    minus_one = torch.full((), -1.0, dtype=step.n.dtype, device=step.n.device)
    m_n = sr.plus(m_h, sr.scale(m_diff, minus_one))
    m_pn = sr.scale(m_n, 1 - step.n * step.n)
    m_hh_n = sr.scale(m_pn, step.r)
    m_r = sr.scale(m_pn, step.hh_n)
    m_pr = sr.scale(m_r, step.r * (1 - step.r))
    m_pz = sr.scale(m_z, step.z * (1 - step.z))
    return state_cat([m_pr, m_pz, m_pn], 1), state_cat([m_pr, m_pz, m_hh_n], 1), m_diff


def rnn_gate_messages(sr: Semiring, m_h: State, h_new: Tensor, kind: CellKind) -> State:
    """Message on the pre-activation [b, H]: relu passes where h' > 0, tanh weighs 1 - h'²."""
    if kind is CellKind.RNN_RELU:
        return sr.scale(m_h, (h_new > 0).to(h_new.dtype))
    return sr.scale(m_h, 1 - h_new * h_new)


# --- the fused CUDA cells (CUDA/XPU without cuDNN, and nn.LSTMCell / nn.GRUCell there) --------


def state_or_zero(call: OpCall, value: Tensor | None, shape: Sequence[int]) -> State:
    """The state of an optional gradient argument; one that never arrived is "no path"."""
    return call.zeros(shape) if value is None else call.state(value, shape)


def wrap_outputs(
    call: OpCall, reals: Sequence[Tensor | None] | None, states: Sequence[State | None]
) -> tuple[Tensor | None, ...]:
    """Each output as a message (its regular gradient and state); where there is no state (an
    input without a message, such as an absent bias) the regular result alone."""
    reals = list(reals) if reals is not None else [None] * len(states)
    return tuple(r if s is None else call.wrap(r, s) for r, s in zip(reals, states, strict=True))


def _fused_lstm_messages(call: OpCall) -> tuple[State, State, State | None]:
    """(gates [b, 4H], cx [b, H], bias [4H] or None) from the saved activated gates.

    The kernel's workspace holds sigmoid(i), sigmoid(f), tanh(g), sigmoid(o) side by side; cx
    and cy are the cell states it read and wrote.
    """
    dtype = call.weight_dtype
    cx, cy = call["cx"].to(dtype), call["cy"].to(dtype)
    i, f, g, o = call["workspace"].to(dtype).chunk(4, 1)
    step = LstmStep(i, f, g, o, cx, cy.tanh(), None)
    m_h = state_or_zero(call, call["grad_hy"], cx.shape)
    m_c = state_or_zero(call, call["grad_cy"], cx.shape)
    m_gates, m_cx = lstm_gate_messages(call.semiring, m_h, m_c, step)
    m_bias = call.semiring.sum(m_gates, [0]) if call["has_bias"] else None
    return m_gates, m_cx, m_bias


@register_rule(aten._thnn_fused_lstm_cell_backward_impl.default)
def fused_lstm_cell_backward(call: OpCall):
    """Returns (gates, cx, bias): the gates message serves both the input and the hidden gates
    (the kernel sums them), the bias message both biases. The composite
    ``_thnn_fused_lstm_cell_backward`` that autograd calls duplicates them before any rule
    sees them."""
    m_gates, m_cx, m_bias = _fused_lstm_messages(call)
    return wrap_outputs(call, call.run_regular(), [m_gates, m_cx, m_bias])


@register_rule(aten._thnn_fused_gru_cell_backward.default)
def fused_gru_cell_backward(call: OpCall):
    """Returns (input gates, hidden gates, hx, input bias, hidden bias).

    The workspace [b, 5H] holds r, z, n, hx and W_hn hx + b_hn (the kernel adds the biases, so
    the hidden gates it receives are W_hh hx without b_hh).
    """
    dtype = call.weight_dtype
    r, z, n, hx, hh_n = call["workspace"].to(dtype).chunk(5, 1)
    sr = call.semiring
    m_h = call.state(call["grad_hy"])
    m_in, m_hid, m_hx = gru_gate_messages(sr, m_h, GruStep(r, z, n, hh_n, hx))
    biases = [sr.sum(m_in, [0]), sr.sum(m_hid, [0])] if call["has_bias"] else [None, None]
    return wrap_outputs(call, call.run_regular(), [m_in, m_hid, m_hx, *biases])
