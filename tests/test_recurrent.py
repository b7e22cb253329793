"""LSTM, GRU and RNN through semiring backprop, whatever kernel PyTorch picks.

The reference is PyTorch's native CPU implementation in float64 (a decomposition into linear,
sigmoid, tanh, mul and add ops), whose scalar graph the brute-force oracle rebuilds from
autograd's own Jacobians. Every fused kernel must give that graph's values:

- oneDNN (CPU float32 LSTM, the default here): against the oracle within float32 tolerance and
  against the float32 native path (``torch.backends.mkldnn.flags(enabled=False)``);
- cuDNN / MIOpen and the CUDA fused cells: their backward ops are dispatched on the CPU with
  state-only messages (regular gradients off, so the CUDA kernels never run) and checked against
  the oracle; the ``gpu`` tests run the real kernels against the CPU values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from helpers import ORACLE_NAME, SEMIRINGS, MinProd, assert_readout_matches, oracle_readouts
from oracle import Readout, build_graph, dynamic_programming
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import semipack
from semipack.messages.message import Message

aten = torch.ops.aten

#: ``torch.backends.mkldnn.flags`` also sets oneDNN's TF32 switch, which warns without an Intel GPU.
pytestmark = pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread avoids OpenMP contention on a loaded machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --------------------------------------------------------------------------------------------
# Cases: a module, its input, whether h0 (c0) are given, which outputs enter the loss
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], nn.Module]
    steps: int = 3
    batch: int = 2
    features: int = 2
    packed: tuple[int, ...] | None = None  # batch sizes of a packed input
    given_state: bool = False
    uses: tuple[str, ...] = ("output",)  # of "output", "h_n", "c_n"

    def build(self, dtype: torch.dtype, device: str = "cpu") -> tuple[nn.Module, list[Tensor]]:
        """The module (fixed parameters) and the leaves: input, given states, parameters."""
        torch.manual_seed(0)
        module = self.make().to(dtype=dtype, device=device)
        gen = torch.Generator().manual_seed(1)
        if self.packed is not None:
            shape = (sum(self.packed), self.features)
        elif getattr(module, "batch_first", False):
            shape = (self.batch, self.steps, self.features)
        else:
            shape = (self.steps, self.batch, self.features)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        leaves = [x.to(dtype=dtype, device=device).requires_grad_(True)]
        for shape in _state_shapes(module, self) if self.given_state else []:
            state = torch.randn(shape, generator=gen, dtype=torch.float64)
            leaves.append(state.to(dtype=dtype, device=device).requires_grad_(True))
        return module, leaves + list(module.parameters())


def _is_cell(module: nn.Module) -> bool:
    return isinstance(module, (nn.LSTMCell, nn.GRUCell, nn.RNNCell))


def _state_shapes(module: nn.Module, case: Case) -> list[tuple[int, ...]]:
    batch = case.packed[0] if case.packed else case.batch
    hidden = module.hidden_size
    if _is_cell(module):
        n = 2 if isinstance(module, nn.LSTMCell) else 1
        return [(batch, hidden)] * n
    layers = module.num_layers * (2 if module.bidirectional else 1)
    out = getattr(module, "proj_size", 0) or hidden
    if isinstance(module, nn.LSTM):
        return [(layers, batch, out), (layers, batch, hidden)]
    return [(layers, batch, hidden)]


def run_case(case: Case, module: nn.Module, leaves: list[Tensor]) -> dict[str, Tensor]:
    """The module's outputs by name. A cell runs two steps (input [2, batch, features])."""
    x = leaves[0]
    n_states = len(_state_shapes(module, case)) if case.given_state else 0
    states = leaves[1 : 1 + n_states]
    if _is_cell(module):
        hidden = tuple(states) if len(states) == 2 else (states[0] if states else None)
        for t in range(x.shape[0]):
            hidden = module(x[t], hidden)
        if isinstance(hidden, tuple):
            return {"h_n": hidden[0], "c_n": hidden[1]}
        return {"h_n": hidden}
    if case.packed is not None:
        x = PackedSequence(x, torch.tensor(case.packed))
    hidden = None
    if states:
        hidden = tuple(states) if len(states) == 2 else states[0]
    out, final = module(x, hidden)
    outputs = {"output": out.data if case.packed is not None else out}
    if isinstance(final, tuple):
        outputs["h_n"], outputs["c_n"] = final
    else:
        outputs["h_n"] = final
    return outputs


def loss_weights(outputs: dict[str, Tensor], uses: tuple[str, ...]) -> dict[str, Tensor]:
    """Fixed random weights (float64 on the CPU) for the outputs that enter the loss."""
    gen = torch.Generator().manual_seed(2)
    return {
        name: torch.randn(outputs[name].shape, generator=gen, dtype=torch.float64) for name in uses
    }


def weighted_loss(outputs: dict[str, Tensor], weights: dict[str, Tensor]) -> Tensor:
    total = None
    for name, w in weights.items():
        out = outputs[name]
        term = (out * w.to(dtype=out.dtype, device=out.device)).sum()
        total = term if total is None else total + term
    return total


def _lstm(**kw) -> Callable[[], nn.Module]:
    return functools.partial(nn.LSTM, 2, 3, **kw)


NATIVE_CASES = [
    Case("lstm_2layer_bidir", _lstm(num_layers=2, bidirectional=True), given_state=True,
         uses=("output", "h_n", "c_n")),
    Case("lstm_proj", _lstm(proj_size=2), uses=("output", "c_n")),
    Case("gru_2layer_batch_first", functools.partial(nn.GRU, 2, 3, 2, batch_first=True),
         given_state=True, uses=("h_n",)),
    Case("rnn_tanh_no_bias", functools.partial(nn.RNN, 2, 3, bias=False), uses=("output",)),
    Case("rnn_relu_packed_bidir",
         functools.partial(nn.RNN, 2, 3, nonlinearity="relu", bidirectional=True),
         packed=(2, 2, 1), given_state=True, uses=("output", "h_n")),
    Case("lstm_packed_2layer", _lstm(num_layers=2), packed=(3, 2, 1), uses=("output", "c_n")),
    Case("lstm_cell", functools.partial(nn.LSTMCell, 2, 3), given_state=True,
         uses=("h_n", "c_n")),
    Case("gru_cell", functools.partial(nn.GRUCell, 2, 3), steps=2, uses=("h_n",)),
    Case("rnn_relu_cell", functools.partial(nn.RNNCell, 2, 3, nonlinearity="relu"), steps=2,
         given_state=True, uses=("h_n",)),
]  # fmt: skip

#: LSTMs oneDNN runs in float32 (no projections, no packed input).
ONEDNN_CASES = [
    NATIVE_CASES[0],
    Case("lstm_no_bias_batch_first_state_only",
         _lstm(bias=False, batch_first=True), given_state=True, uses=("h_n", "c_n")),
    Case("lstm_reverse_cell_state_only", _lstm(bidirectional=True), uses=("c_n",)),
]  # fmt: skip

CASES = {c.name: c for c in NATIVE_CASES + ONEDNN_CASES}


@functools.cache
def oracle_values(case_name: str) -> dict[str, list[Readout]]:
    """Every semiring's readouts for the case's leaves, from the float64 native graph."""
    case = CASES[case_name]
    module, leaves = case.build(torch.float64)
    outputs = run_case(case, module, leaves)
    graph = build_graph(weighted_loss(outputs, loss_weights(outputs, case.uses)))
    values = {s: dynamic_programming(graph, leaves, s) for s in set(ORACLE_NAME.values())}
    return {s: values[ORACLE_NAME[s]] for s in SEMIRINGS}


def semipack_values(
    case: Case, dtype: torch.dtype, device: str = "cpu", kernel: str | None = None
) -> dict[str, list[object]]:
    """Every semiring's readouts for the case run in ``dtype``; asserts that the backward
    graph contains ``kernel`` (an autograd node name) or, for None, no fused RNN node."""
    module, leaves = case.build(dtype, device)
    outputs = run_case(case, module, leaves)
    loss = weighted_loss(outputs, loss_weights(outputs, case.uses))
    names = node_names(loss)
    if kernel is None:
        assert not names & FUSED_NODES, f"{case.name}: expected the native path, got {names}"
    else:
        assert kernel in names, f"{case.name}: expected {kernel}, got {sorted(names)}"
    values = {}
    for name, make in SEMIRINGS.items():
        values[name] = list(semipack.grad(loss, leaves, make(), retain_graph=True))
    values["autograd"] = list(torch.autograd.grad(loss, leaves))
    return values


FUSED_NODES = {
    "MkldnnRnnLayerBackward0",
    "CudnnRnnBackward0",
    "MiopenRnnBackward0",
    "ThnnFusedLstmCellBackward0",
    "ThnnFusedGruCellBackward0",
}


def node_names(t: Tensor) -> set[str]:
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        stack.extend(fn for fn, _ in node.next_functions)
    return names


# --------------------------------------------------------------------------------------------
# Comparing in float32 precision
# --------------------------------------------------------------------------------------------


def _no_path(name: str, t: Tensor) -> Tensor:
    if name in ("real", "max_prod", "signed_max_prod"):
        return t == 0
    if name == "entropy":
        return torch.isnan(t)
    return t == -math.inf


def assert_close_readout(name: str, expected: object, actual: object, where: str) -> None:
    """Same "no path" entries exactly, values within float32 tolerance (Boolean: equal)."""
    name = ORACLE_NAME[name]
    if name == "signed_max_prod":
        pairs = [(expected[0], actual.largest), (expected[1], actual.smallest)]
    else:
        pairs = [(expected, actual)]
    for exp, act in pairs:
        act = act.detach().cpu()
        assert act.shape == exp.shape, f"{name} {where}: shape {act.shape} != {exp.shape}"
        if name == "boolean":
            assert torch.equal(act, exp.bool()), f"{name} {where}: {act} != {exp}"
            continue
        exp, act = exp.double(), act.double()
        if name != "real":
            mask = _no_path(name, exp)
            assert torch.equal(mask, _no_path(name, act)), f"{name} {where}: no-path entries"
            exp, act = exp[~mask], act[~mask]
        scale = max(1.0, exp.abs().max().item()) if exp.numel() else 1.0
        atol = 2e-4 if name in ("log_sum", "log_count", "entropy") else 2e-5 * scale
        torch.testing.assert_close(act, exp, rtol=2e-4, atol=atol, msg=f"{name} {where}")


# --------------------------------------------------------------------------------------------
# The native path (float64) against the oracle
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", NATIVE_CASES, ids=lambda c: c.name)
def test_native_path_matches_oracle(case: Case) -> None:
    expected = oracle_values(case.name)
    got = semipack_values(case, torch.float64)
    for name in SEMIRINGS:
        for i, (exp, act) in enumerate(zip(expected[name], got[name], strict=True)):
            assert_readout_matches(name, exp, act, f"{case.name} leaf {i}")
    for act, ref in zip(got["real"], got["autograd"], strict=True):
        torch.testing.assert_close(act, ref, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------
# oneDNN (CPU float32 LSTM)
# --------------------------------------------------------------------------------------------


def test_onednn_is_the_default_here() -> None:
    """The float32 tests below exercise oneDNN only if it is on (the semiring tests check the
    node of each graph too)."""
    assert torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


@pytest.mark.parametrize("case", ONEDNN_CASES, ids=lambda c: c.name)
def test_onednn_lstm_matches_float64_oracle(case: Case) -> None:
    expected = oracle_values(case.name)
    got = semipack_values(case, torch.float32, kernel="MkldnnRnnLayerBackward0")
    for name in SEMIRINGS:
        for i, (exp, act) in enumerate(zip(expected[name], got[name], strict=True)):
            exp = _as_pair(exp)
            assert_close_readout(name, exp, act, f"{case.name} leaf {i}")
    for act, ref in zip(got["real"], got["autograd"], strict=True):
        torch.testing.assert_close(act, ref, rtol=1e-5, atol=1e-6)


def _as_pair(readout: Readout) -> object:
    return readout if not isinstance(readout, tuple) else (readout[0], readout[1])


@pytest.mark.parametrize("case", ONEDNN_CASES, ids=lambda c: c.name)
def test_onednn_matches_float32_native_path(case: Case) -> None:
    fused = semipack_values(case, torch.float32, kernel="MkldnnRnnLayerBackward0")
    with torch.backends.mkldnn.flags(enabled=False):
        native = semipack_values(case, torch.float32, kernel=None)
    for name in SEMIRINGS:
        for i, (exp, act) in enumerate(zip(native[name], fused[name], strict=True)):
            if name == "signed_max_prod":
                exp = (exp.largest, exp.smallest)
            assert_close_readout(name, exp, act, f"{case.name} leaf {i}")


def test_onednn_dropout_between_layers_uses_the_kernels_mask() -> None:
    """Train-mode dropout between oneDNN layers is an ordinary op: same seed, same mask as
    the native path, same values."""
    values, outputs = [], []
    for enabled in (True, False):
        torch.manual_seed(0)
        lstm = nn.LSTM(2, 4, num_layers=3, dropout=0.5)
        x = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.backends.mkldnn.flags(enabled=enabled):
            torch.manual_seed(5)
            out, (_, c_n) = lstm(x)
        assert ("MkldnnRnnLayerBackward0" in node_names(out)) is enabled
        loss = out.sum() + c_n[0].sum()
        outputs.append(out.detach())
        leaves = [x, *lstm.parameters()]
        values.append(
            {n: semipack.grad(loss, leaves, s(), retain_graph=True) for n, s in _SOME.items()}
        )
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)
    assert (outputs[0] == 0).sum() == 0  # the last layer's output is not dropped
    for name in _SOME:
        for i, (exp, act) in enumerate(zip(values[1][name], values[0][name], strict=True)):
            assert_close_readout(name, exp, act, f"dropout leaf {i}")


_SOME = {
    "max_prod": semipack.MaxProd,
    "log_count": semipack.LogCount,
    "entropy": semipack.Entropy,
    "boolean": semipack.Boolean,
}


def test_bfloat16_lstm_matches_float32_native_path() -> None:
    """oneDNN also runs bfloat16 LSTMs (where the CPU supports it): the edges are the same, so
    reachability is exact and path counts agree to float32 rounding of their logs; path
    products agree to bfloat16 precision."""
    case = ONEDNN_CASES[0]
    module, leaves = case.build(torch.float32)
    low, low_leaves = case.build(torch.bfloat16)
    values = []
    for mod, lv, enabled in ((low, low_leaves, True), (module, leaves, False)):
        with torch.backends.mkldnn.flags(enabled=enabled):
            outputs = run_case(case, mod, lv)
        loss = weighted_loss(
            {k: v.float() for k, v in outputs.items()}, loss_weights(outputs, case.uses)
        )
        values.append({n: semipack.grad(loss, lv, _SOME[n](), retain_graph=True) for n in _SOME})
    for i, (low_value, value) in enumerate(zip(*(v["boolean"] for v in values), strict=True)):
        assert torch.equal(low_value, value), f"boolean leaf {i}"
    for name, rtol in (("log_count", 1e-6), ("max_prod", 3e-2)):
        for i, (low_value, value) in enumerate(zip(*(v[name] for v in values), strict=True)):
            assert low_value.dtype == torch.float32
            torch.testing.assert_close(low_value, value, rtol=rtol, atol=0, msg=f"{name} {i}")


class Tagger(nn.Module):
    """Embedding, bidirectional LSTM, per-token classifier: the usual sequence labeller."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3)
        self.lstm = nn.LSTM(3, 4, num_layers=2, bidirectional=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.lstm(self.embed(tokens))[0])


def _tagger_backward(semiring: semipack.Semiring | None, **kw) -> dict[str, tuple]:
    """(.grad, .semiring_grad) per parameter after one backward (plain if semiring is None)."""
    torch.manual_seed(0)
    model = Tagger()
    tokens = torch.tensor([[1, 4], [2, 2], [6, 0]])
    labels = torch.tensor([[0, 2], [1, 1], [2, 0]])
    if semiring is None:
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
    else:
        with semipack.extend(model, semiring, **kw):
            out = model(tokens).flatten(0, 1)
            torch.nn.functional.cross_entropy(out, labels.flatten()).backward()
    return {n: (p.grad, getattr(p, "semiring_grad", None)) for n, p in model.named_parameters()}


@pytest.mark.parametrize("make", [semipack.MaxProd, semipack.Entropy, semipack.Real])
def test_extend_keeps_grad_bitwise_and_matches_native(make) -> None:
    plain = _tagger_backward(None)
    fused = _tagger_backward(make())
    with torch.backends.mkldnn.flags(enabled=False):
        native = _tagger_backward(make())
    name = {semipack.MaxProd: "max_prod", semipack.Entropy: "entropy"}.get(make, "real")
    for param, (grad, value) in fused.items():
        assert torch.equal(grad, plain[param][0]), param
        assert value is not None and value.shape == grad.shape, param
        assert_close_readout(name, native[param][1], value, param)
    for param, (grad, _) in plain.items():
        if make is semipack.Real:
            torch.testing.assert_close(fused[param][1], grad, rtol=1e-5, atol=1e-6)


def test_extend_without_regular_grads() -> None:
    with_regular = _tagger_backward(semipack.LogSum())
    without = _tagger_backward(semipack.LogSum(), regular_grads=False)
    for param, (grad, value) in without.items():
        assert grad is None, param
        assert torch.equal(value, with_regular[param][1]), param


def test_top_path_through_onednn_names_the_recurrent_states() -> None:
    torch.manual_seed(0)
    lstm = nn.LSTM(2, 3, num_layers=2, bidirectional=True)
    x = torch.randn(4, 2, 2, generator=torch.Generator().manual_seed(1), requires_grad=True)
    top = semipack.TopPath()
    results = {}
    for enabled in (True, False):
        with torch.backends.mkldnn.flags(enabled=enabled), semipack.extend(lstm, top):
            out, (_, c_n) = lstm(x)
            assert ("MkldnnRnnLayerBackward0" in node_names(out)) is enabled
            (out[-1].sum() + c_n.sum()).backward()
        results[enabled] = (x.semiring_grad.clone(), top.path(x))
    (fused_value, fused_path), (native_value, native_path) = results[True], results[False]
    torch.testing.assert_close(fused_value, native_value, rtol=1e-4, atol=0)
    assert fused_path.index == native_path.index
    assert math.isclose(fused_path.value, fused_value.max().item(), rel_tol=1e-5)
    assert math.isclose(fused_path.value, native_path.value, rel_tol=1e-4)
    steps = [step.description for step in fused_path.steps]
    assert any("hidden state, step" in s or "cell state, step" in s for s in steps), steps
    assert "MkldnnRnnLayer" in str(fused_path)


def test_user_semiring_through_onednn() -> None:
    case = ONEDNN_CASES[0]
    values = []
    for enabled in (True, False):
        module, leaves = case.build(torch.float32)
        with torch.backends.mkldnn.flags(enabled=enabled):
            outputs = run_case(case, module, leaves)
        loss = weighted_loss(outputs, loss_weights(outputs, case.uses))
        assert ("MkldnnRnnLayerBackward0" in node_names(loss)) is enabled
        values.append(semipack.grad(loss, leaves, MinProd()))
    for fused, native in zip(*values, strict=True):
        assert torch.equal(torch.isinf(fused), torch.isinf(native))
        torch.testing.assert_close(fused, native, rtol=1e-4, atol=0)


def test_onednn_rule_rejects_other_modes() -> None:
    """oneDNN only runs LSTMs today; a GRU call (mode 3) must not be read as an LSTM."""
    sr = semipack.MaxProd()
    msg = Message(None, sr.lift(torch.ones(3, 1, 2)), sr, torch.float32)
    h = torch.zeros(1, 2)
    with pytest.raises(semipack.UnsupportedOpError) as info:
        aten.mkldnn_rnn_layer_backward(
            torch.zeros(3, 1, 2), torch.zeros(6, 2), torch.zeros(6, 2), torch.zeros(6),
            torch.zeros(6), h, h, torch.zeros(3, 1, 2), h, h, msg, None, None, False, 3, 2, 1,
            True, True, False, [], False, torch.empty(0, dtype=torch.uint8),
        )  # fmt: skip
    assert info.value.op == "aten.mkldnn_rnn_layer_backward.default"
    assert "oneDNN GRU layers are not supported (only LSTM is)" in str(info.value)


def test_pack_padded_sequence_outside_extend_raises() -> None:
    """Its backward copies the message into a fresh plain tensor: an error, never a number
    (inside ``semipack.extend`` the packing is recorded as indexing, see below)."""
    x = torch.randn(3, 2, 2, requires_grad=True)
    packed = pack_padded_sequence(x, torch.tensor([3, 2]))
    with pytest.raises(semipack.UnsupportedOpError) as info:
        semipack.grad(nn.LSTM(2, 3)(packed)[0].data.sum(), x, semipack.MaxProd())
    assert info.value.op == "aten.copy_.default"
    assert "PackPaddedSequenceBackward0" in str(info.value)


def pack_by_indexing(x: Tensor, lengths: Tensor) -> PackedSequence:
    """``pack_padded_sequence(x, lengths, enforce_sorted=False)`` built by indexing x [T, B, F]
    with the packed positions, so its backward is an indexing rule."""
    steps, batch = x.shape[:2]
    index = torch.arange(steps * batch).view(steps, batch)
    where = pack_padded_sequence(index, lengths, enforce_sorted=False)
    return PackedSequence(
        x.flatten(0, 1)[where.data],
        where.batch_sizes,
        where.sorted_indices,
        where.unsorted_indices,
    )


def test_packing_by_indexing_matches_oracle() -> None:
    torch.manual_seed(0)
    lstm = nn.LSTM(2, 3).double()
    x = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([2, 3])
    out, (h_n, c_n) = lstm(pack_by_indexing(x, lengths))
    ref, (ref_h, _) = lstm(pack_padded_sequence(x, lengths, enforce_sorted=False))
    assert torch.equal(out.data, ref.data) and torch.equal(h_n, ref_h)
    loss = (out.data * torch.linspace(-1, 1, out.data.numel()).view_as(out.data)).sum()
    loss = loss + c_n.sum()
    graph = build_graph(loss)
    for name, make in SEMIRINGS.items():
        (expected,) = oracle_readouts(graph, [x], name)
        (actual,) = semipack.grad(loss, x, make(), retain_graph=True)
        assert_readout_matches(name, expected, actual, "x")


@pytest.mark.parametrize("batch_first", [False, True])
def test_pack_padded_sequence_inside_extend_is_exact(batch_first: bool) -> None:
    """Inside ``extend`` packing is recorded as a gather: the oracle's values on the same graph
    built by hand (``pack_by_indexing``), and ``.grad`` bitwise a plain backward's."""
    torch.manual_seed(0)
    lstm = nn.LSTM(2, 3, batch_first=batch_first).double()
    x = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([2, 4, 3] if batch_first else [2, 3, 1, 3])

    def loss_of(packed: PackedSequence) -> Tensor:
        out, (h_n, _) = lstm(packed)
        padded, _ = pad_packed_sequence(out, batch_first=batch_first)
        return (padded * torch.linspace(-1, 1, padded.numel()).view_as(padded)).sum() + h_n.sum()

    steps_first = x.transpose(0, 1) if batch_first else x
    graph = build_graph(loss_of(pack_by_indexing(steps_first, lengths)))
    plain = torch.autograd.grad(
        loss_of(pack_padded_sequence(x, lengths, batch_first, enforce_sorted=False)), x
    )[0]
    for name, make in SEMIRINGS.items():
        (expected,) = oracle_readouts(graph, [x], name)
        x.grad = None
        with semipack.extend(lstm, make()):
            loss_of(pack_padded_sequence(x, lengths, batch_first, enforce_sorted=False)).backward()
        assert torch.equal(x.grad, plain)
        assert_readout_matches(name, expected, x.semiring_grad, "x")


# --------------------------------------------------------------------------------------------
# cuDNN / MIOpen, dispatched on the CPU
# --------------------------------------------------------------------------------------------


def _mode(module: nn.Module) -> int:
    if isinstance(module, nn.LSTM):
        return 2
    if isinstance(module, nn.GRU):
        return 3
    return 0 if module.nonlinearity == "relu" else 1


def fused_stack_backward(
    op, case: Case, module: nn.Module, leaves: list[Tensor], sr, mask=(True,) * 4, uses=None
):
    """Call the fused kernel's backward op as autograd would, with state-only messages lifted
    from the loss weights (the oracle's root edges); CPU tensors, so only the rule runs."""
    outputs = run_case(case, module, leaves)
    weights = loss_weights(outputs, case.uses)
    msgs = {n: Message(None, sr.lift(weights[n]), sr, torch.float64) for n in uses or weights}
    layers = module.num_layers * (2 if module.bidirectional else 1)
    flat = [w.detach() for w in module._flat_weights]
    shapes = _state_shapes(module, case)
    given = {i: leaves[1 + i].detach() for i in range(len(shapes))} if case.given_state else {}
    hx = given.get(0, torch.zeros(shapes[0], dtype=torch.float64))
    cx = given.get(1, torch.zeros(shapes[1], dtype=torch.float64)) if len(shapes) == 2 else None
    proj = [getattr(module, "proj_size", 0)] if op is aten._cudnn_rnn_backward.default else []
    return op(
        leaves[0].detach(), flat, len(flat) // layers, torch.empty(0), hx, cx,
        outputs["output"].detach(), msgs.get("output"), msgs.get("h_n"), msgs.get("c_n"),
        _mode(module), module.hidden_size, *proj, module.num_layers,
        bool(getattr(module, "batch_first", False)), float(module.dropout), module.training,
        module.bidirectional, list(case.packed or []), None, torch.empty(0), list(mask),
    )  # fmt: skip


FUSED_STACK_CASES = [c for c in NATIVE_CASES if not _is_cell(c.make())]


@pytest.mark.parametrize("case", FUSED_STACK_CASES, ids=lambda c: c.name)
def test_cudnn_rule_matches_oracle(case: Case) -> None:
    expected = oracle_values(case.name)
    module, leaves = case.build(torch.float64)
    n_states = len(_state_shapes(module, case))
    for name, make in SEMIRINGS.items():
        dx, dhx, dcx, dw = fused_stack_backward(
            aten._cudnn_rnn_backward.default, case, module, leaves, make()
        )
        got = {0: dx, **{1 + i: m for i, m in enumerate([dhx, dcx][:n_states])}}
        if not case.given_state:
            got = {0: dx}
        params = range(len(leaves) - len(dw), len(leaves))
        got.update(zip(params, dw, strict=True))
        assert sorted(got) == list(range(len(leaves)))
        for i, msg in got.items():
            assert msg.regular_grad is None
            assert_readout_matches(
                name, expected[name][i], msg.semiring.readout(msg.parts), f"{case.name} {i}"
            )


@pytest.mark.parametrize(
    "case", [CASES["gru_2layer_batch_first"], CASES["lstm_2layer_bidir"]], ids=lambda c: c.name
)
def test_miopen_rule_matches_oracle(case: Case) -> None:
    expected = oracle_values(case.name)
    module, leaves = case.build(torch.float64)
    for name in ("max_prod", "entropy", "real"):
        dx, dhx, dcx, dw = fused_stack_backward(
            aten.miopen_rnn_backward.default, case, module, leaves, SEMIRINGS[name]()
        )
        got = [dx, dhx, *([dcx] if dcx is not None else []), *dw]
        for i, msg in enumerate(got):
            assert_readout_matches(
                name, expected[name][i], msg.semiring.readout(msg.parts), f"{case.name} {i}"
            )


def test_cudnn_rule_follows_output_mask_and_missing_gradients() -> None:
    """Only the requested outputs come back; a gradient that never arrived is no path."""
    case = CASES["lstm_2layer_bidir"]
    module, leaves = case.build(torch.float64)
    sr = semipack.LogCount()
    dx, dhx, dcx, dw = fused_stack_backward(
        aten._cudnn_rnn_backward.default, case, module, leaves, sr,
        mask=(True, False, False, False), uses=("h_n",),
    )  # fmt: skip
    assert dhx is None and dcx is None and dw == []
    # Reference: the same loss with only h_n in it, on the native path.
    outputs = run_case(case, module, leaves)
    loss = weighted_loss(outputs, {"h_n": loss_weights(outputs, case.uses)["h_n"]})
    (expected,) = dynamic_programming(build_graph(loss), [leaves[0]], "log_count")
    assert_readout_matches("log_count", expected, dx.semiring.readout(dx.parts), "input")


def test_cudnn_dropout_between_layers_raises() -> None:
    """cuDNN draws its dropout mask inside the kernel: no silently wrong number."""
    case = Case("lstm_dropout", _lstm(num_layers=2, dropout=0.5), uses=("output",))
    module, leaves = case.build(torch.float64)
    module.train()
    with pytest.raises(semipack.UnsupportedOpError) as info:
        fused_stack_backward(
            aten._cudnn_rnn_backward.default, case, module, leaves, semipack.MaxProd()
        )
    assert info.value.op == "aten._cudnn_rnn_backward.default"
    assert "dropout between layers inside a fused RNN kernel cannot be replayed" in str(info.value)
    module.eval()  # no dropout in eval mode: fine
    dx, *_ = fused_stack_backward(
        aten._cudnn_rnn_backward.default, case, module, leaves, semipack.MaxProd()
    )
    assert dx.shape == leaves[0].shape


# --------------------------------------------------------------------------------------------
# The CUDA fused cells, emulated on the CPU
# --------------------------------------------------------------------------------------------


class FusedLstmCellOnCpu(torch.autograd.Function):
    """``_thnn_fused_lstm_cell`` computed on the CPU (its workspace holds the activated gates
    i, f, g, o), with the aten backward op as its backward, so that op's rule runs."""

    @staticmethod
    def forward(ctx, igates, hgates, cx, b_ih, b_hh):
        gates = igates + hgates
        if b_ih is not None:
            gates = gates + b_ih + b_hh
        i, f, g, o = gates.chunk(4, 1)
        i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
        cy = f * cx + i * g
        ctx.save_for_backward(cx, cy, torch.cat([i, f, g, o], 1))
        ctx.has_bias = b_ih is not None
        ctx.set_materialize_grads(False)
        return o * cy.tanh(), cy

    @staticmethod
    def backward(ctx, grad_hy, grad_cy):
        cx, cy, workspace = ctx.saved_tensors
        gates, d_cx, bias = aten._thnn_fused_lstm_cell_backward_impl(
            grad_hy, grad_cy, cx, cy, workspace, ctx.has_bias
        )
        return gates, gates, d_cx, bias, bias


class FusedGruCellOnCpu(torch.autograd.Function):
    """``_thnn_fused_gru_cell`` on the CPU; workspace [r, z, n, hx, W_hn hx + b_hn]."""

    @staticmethod
    def forward(ctx, igates, hgates, hx, b_ih, b_hh):
        if b_ih is not None:
            igates, hgates = igates + b_ih, hgates + b_hh
        i_r, i_z, i_n = igates.chunk(3, 1)
        h_r, h_z, h_n = hgates.chunk(3, 1)
        r, z = (i_r + h_r).sigmoid(), (i_z + h_z).sigmoid()
        n = (i_n + r * h_n).tanh()
        ctx.save_for_backward(torch.cat([r, z, n, hx, h_n], 1))
        ctx.has_bias = b_ih is not None
        return n + z * (hx - n)

    @staticmethod
    def backward(ctx, grad_hy):
        (workspace,) = ctx.saved_tensors
        return aten._thnn_fused_gru_cell_backward(grad_hy, workspace, ctx.has_bias)


def cuda_style_cell(cell: nn.Module, x: Tensor, hidden):
    """One step as PyTorch runs it on CUDA: gate matmuls without bias, then the fused cell."""
    igates = x.matmul(cell.weight_ih.t())
    if isinstance(cell, nn.LSTMCell):
        h, c = hidden
        hgates = h.matmul(cell.weight_hh.t())
        return FusedLstmCellOnCpu.apply(igates, hgates, c, cell.bias_ih, cell.bias_hh)
    hgates = hidden.matmul(cell.weight_hh.t())
    return FusedGruCellOnCpu.apply(igates, hgates, hidden, cell.bias_ih, cell.bias_hh)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_cell_rules_match_oracle(kind: str, bias: bool) -> None:
    torch.manual_seed(0)
    cell_class = nn.LSTMCell if kind == "lstm" else nn.GRUCell
    cell = cell_class(2, 3, bias=bias).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    state = (h0, c0) if kind == "lstm" else h0
    leaves = [x, h0, *([c0] if kind == "lstm" else []), *cell.parameters()]

    def loss_of(step) -> Tensor:
        hidden = state
        for t in range(x.shape[0]):
            hidden = step(cell, x[t], hidden)
        h, c = hidden if kind == "lstm" else (hidden, None)
        w = torch.linspace(-1.5, 2.0, h.numel(), dtype=torch.float64).reshape(h.shape)
        return (h * w).sum() + (c[0].sum() if c is not None else 0)

    native = loss_of(lambda cell, x, hidden: cell(x, hidden))
    assert not node_names(native) & FUSED_NODES
    emulated = loss_of(cuda_style_cell)
    graph = build_graph(native)
    for name, make in SEMIRINGS.items():
        expected = oracle_readouts(graph, leaves, name)
        got = semipack.grad(emulated, leaves, make(), retain_graph=True)
        for i, (exp, act) in enumerate(zip(expected, got, strict=True)):
            assert_readout_matches(name, exp, act, f"{kind} bias={bias} leaf {i}")


# --------------------------------------------------------------------------------------------
# On a GPU: the real cuDNN and fused-cell kernels against the float64 oracle
# --------------------------------------------------------------------------------------------

CUDA_CASES = [
    CASES["lstm_2layer_bidir"],
    CASES["lstm_proj"],
    CASES["gru_2layer_batch_first"],
    CASES["rnn_relu_packed_bidir"],
    CASES["lstm_packed_2layer"],
    CASES["lstm_cell"],
    CASES["gru_cell"],
]


def _cuda_kernel(case: Case, cudnn: bool) -> str | None:
    """The fused node PyTorch records on CUDA (None: native ops only)."""
    module = case.make()
    if isinstance(module, nn.LSTMCell) or (isinstance(module, nn.LSTM) and not cudnn):
        return "ThnnFusedLstmCellBackward0"
    if isinstance(module, nn.GRUCell) or (isinstance(module, nn.GRU) and not cudnn):
        return "ThnnFusedGruCellBackward0"
    return "CudnnRnnBackward0" if cudnn else None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cudnn", [True, False], ids=["cudnn", "no_cudnn"])
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: c.name)
def test_cuda_kernels_match_oracle(case: Case, cudnn: bool) -> None:
    expected = oracle_values(case.name)
    with torch.backends.cudnn.flags(enabled=cudnn, allow_tf32=False):
        got = semipack_values(case, torch.float32, "cuda", kernel=_cuda_kernel(case, cudnn))
    for name in SEMIRINGS:
        for i, (exp, act) in enumerate(zip(expected[name], got[name], strict=True)):
            assert_close_readout(name, _as_pair(exp), act, f"{case.name} leaf {i}")
    for act, ref in zip(got["real"], got["autograd"], strict=True):
        torch.testing.assert_close(act, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cudnn_dropout_raises_and_grad_is_bitwise() -> None:
    torch.manual_seed(0)
    lstm = nn.LSTM(2, 3, num_layers=2, dropout=0.5).cuda()
    x = torch.randn(4, 2, 2, device="cuda", requires_grad=True)
    with pytest.raises(semipack.UnsupportedOpError) as info:
        semipack.grad(lstm(x)[0].sum(), x, semipack.MaxProd())
    assert info.value.op == "aten._cudnn_rnn_backward.default"
    lstm.dropout = 0.0  # cuDNN refuses a backward in eval mode: train mode without dropout
    torch.manual_seed(1)
    lstm(x)[0].sum().backward()
    plain = [p.grad.clone() for p in lstm.parameters()]
    lstm.zero_grad()
    with semipack.extend(lstm, semipack.Entropy()):
        lstm(x)[0].sum().backward()
    for p, ref in zip(lstm.parameters(), plain, strict=True):
        assert torch.equal(p.grad, ref)
        assert p.semiring_grad.shape == p.shape
