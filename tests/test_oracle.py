"""semipack's non-Real semirings checked against an independent brute-force oracle.

The oracle (``tests/oracle.py``) rebuilds the scalar graph from PyTorch's own backward formulas
and computes each semiring both by dynamic programming and by listing every path. The first
group of tests checks the oracle itself; the property-based group then draws random tiny
float64 models with hypothesis and compares every leaf's readout, semiring by semiring.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers import ORACLE_NAME, SEMIRINGS, assert_readout_matches, mismatch, oracle_readouts
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from oracle import (
    SEMIRING_NAMES,
    PathLimitExceeded,
    Readout,
    build_graph,
    dynamic_programming,
    enumerate_paths,
    node_jacobians,
    path_counts,
    values_from_paths,
)
from torch import Tensor, nn

import semipack

DTYPE = torch.float64

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------------------------
# Random tiny models
# --------------------------------------------------------------------------------------------

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "softplus": F.softplus,
    "leaky_relu": F.leaky_relu,
    "elu": F.elu,
}
LOSSES = ("sum", "mse", "cross_entropy")


@dataclass(frozen=True)
class CommonSpec:
    """Choices every model kind shares."""

    seed: int
    batch: int
    activation: str
    loss: str
    n_out: int
    layer_norm: bool
    residual: bool


@dataclass(frozen=True)
class MLPSpec:
    common: CommonSpec
    widths: tuple[int, ...]  # input width, then one width per hidden layer (depth 1-3)


@dataclass(frozen=True)
class AttentionSpec:
    common: CommonSpec
    seq: int
    dim: int
    causal: bool


@dataclass(frozen=True)
class ConvSpec:
    common: CommonSpec
    in_channels: int
    out_channels: int
    size: int
    kernel: int
    stride: int
    padding: int
    dilation: int
    pool: str  # "none", "max" or "avg"
    pool_stride: int


@dataclass(frozen=True)
class EmbeddingSpec:
    common: CommonSpec
    vocab: int
    dim: int
    ids: tuple[tuple[int, ...], ...]  # (batch, seq) token ids; repeats and unused rows on purpose


ModelSpec = MLPSpec | AttentionSpec | ConvSpec | EmbeddingSpec


class MLP(nn.Module):
    """Linear + activation layers, residual where the width is unchanged, optional LayerNorm."""

    def __init__(self, spec: MLPSpec) -> None:
        super().__init__()
        self.spec = spec
        w = spec.widths
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(w))
        self.norm = nn.LayerNorm(w[-1]) if spec.common.layer_norm else None
        self.head = nn.Linear(w[-1], spec.common.n_out)

    def forward(self, x: Tensor) -> Tensor:
        act = ACTIVATIONS[self.spec.common.activation]
        h = x
        for layer in self.layers:
            new = act(layer(h))
            h = new + h if self.spec.common.residual and new.shape == h.shape else new
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h)


class Attention(nn.Module):
    """Hand-written single-head attention, so each step is its own autograd node."""

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.spec = spec
        d = spec.dim
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm = nn.LayerNorm(d) if spec.common.layer_norm else None
        self.head = nn.Linear(spec.seq * d, spec.common.n_out)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-2, -1) * self.spec.dim**-0.5
        if self.spec.causal:
            future = torch.ones(self.spec.seq, self.spec.seq, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        h = torch.softmax(scores, dim=-1) @ v
        if self.spec.common.residual:
            h = h + x
        if self.norm is not None:
            h = self.norm(h)
        h = ACTIVATIONS[self.spec.common.activation](h)
        return self.head(h.flatten(1))


def conv_output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


class ConvNet(nn.Module):
    """conv2d, activation, optional 2x2 pooling, then a linear head."""

    def __init__(self, spec: ConvSpec) -> None:
        super().__init__()
        self.spec = spec
        self.conv = nn.Conv2d(
            spec.in_channels,
            spec.out_channels,
            spec.kernel,
            stride=spec.stride,
            padding=spec.padding,
            dilation=spec.dilation,
        )
        side = conv_output_size(spec.size, spec.kernel, spec.stride, spec.padding, spec.dilation)
        if spec.pool != "none":
            side = conv_output_size(side, 2, spec.pool_stride, 0, 1)
        self.head = nn.Linear(spec.out_channels * side * side, spec.common.n_out)

    def forward(self, x: Tensor) -> Tensor:
        h = ACTIVATIONS[self.spec.common.activation](self.conv(x))
        if self.spec.pool == "max":
            h = F.max_pool2d(h, 2, stride=self.spec.pool_stride)
        elif self.spec.pool == "avg":
            h = F.avg_pool2d(h, 2, stride=self.spec.pool_stride)
        return self.head(h.flatten(1))


class EmbeddingNet(nn.Module):
    """Embedding lookup (ids fixed in the spec), optional LayerNorm, activation, linear head."""

    def __init__(self, spec: EmbeddingSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embedding = nn.Embedding(spec.vocab, spec.dim)
        self.norm = nn.LayerNorm(spec.dim) if spec.common.layer_norm else None
        self.head = nn.Linear(len(spec.ids[0]) * spec.dim, spec.common.n_out)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embedding(ids)
        if self.norm is not None:
            h = self.norm(h)
        h = ACTIVATIONS[self.spec.common.activation](h)
        return self.head(h.flatten(1))


@dataclass
class Case:
    """A built model, its scalar loss and the leaves (name, tensor) to compare."""

    model: nn.Module
    loss: Tensor
    leaves: list[tuple[str, Tensor]]

    @property
    def tensors(self) -> list[Tensor]:
        return [t for _, t in self.leaves]


def _init_parameters(model: nn.Module, generator: torch.Generator) -> None:
    """Draw every parameter from N(0, 0.8²) so LayerNorm weights are random too."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.8 * torch.randn(p.shape, generator=generator, dtype=DTYPE))


def _loss(logits: Tensor, name: str, generator: torch.Generator) -> Tensor:
    if name == "sum":
        return logits.sum()
    if name == "mse":
        target = torch.randn(logits.shape, generator=generator, dtype=DTYPE)
        return F.mse_loss(logits, target)
    labels = torch.randint(logits.shape[-1], (logits.shape[0],), generator=generator)
    return F.cross_entropy(logits, labels)


def build_case(spec: ModelSpec) -> Case:
    """Build the model, its input and its loss deterministically from ``spec``."""
    common = spec.common
    generator = torch.Generator().manual_seed(common.seed)
    model: nn.Module
    x: Tensor
    if isinstance(spec, MLPSpec):
        model = MLP(spec)
        x = torch.randn(common.batch, spec.widths[0], generator=generator, dtype=DTYPE)
    elif isinstance(spec, AttentionSpec):
        model = Attention(spec)
        x = torch.randn(common.batch, spec.seq, spec.dim, generator=generator, dtype=DTYPE)
    elif isinstance(spec, ConvSpec):
        model = ConvNet(spec)
        shape = (common.batch, spec.in_channels, spec.size, spec.size)
        x = torch.randn(shape, generator=generator, dtype=DTYPE)
    else:
        model = EmbeddingNet(spec)
        x = torch.tensor(spec.ids)
    model = model.to(DTYPE)
    _init_parameters(model, generator)
    leaves = [(f"param {name}", p) for name, p in model.named_parameters()]
    if x.is_floating_point():
        x.requires_grad_(True)
        leaves.insert(0, ("input", x))
    loss = _loss(model(x), common.loss, generator)
    return Case(model, loss, leaves)


# --------------------------------------------------------------------------------------------
# Hypothesis strategies
# --------------------------------------------------------------------------------------------


@st.composite
def common_specs(draw: st.DrawFn, max_batch: int = 3) -> CommonSpec:
    loss = draw(st.sampled_from(LOSSES))
    return CommonSpec(
        seed=draw(st.integers(0, 2**31 - 1)),
        batch=draw(st.integers(1, max_batch)),
        activation=draw(st.sampled_from(sorted(ACTIVATIONS))),
        loss=loss,
        n_out=draw(st.integers(2, 3)),  # >= 2 so cross_entropy's softmax is never over 1 class
        layer_norm=draw(st.booleans()),
        residual=draw(st.booleans()),
    )


@st.composite
def mlp_specs(
    draw: st.DrawFn, max_width: int = 4, max_depth: int = 3, max_batch: int = 3
) -> MLPSpec:
    depth = draw(st.integers(1, max_depth))
    widths = tuple(
        draw(st.lists(st.integers(2, max_width), min_size=depth + 1, max_size=depth + 1))
    )
    return MLPSpec(draw(common_specs(max_batch)), widths)


@st.composite
def attention_specs(draw: st.DrawFn, max_batch: int = 3) -> AttentionSpec:
    return AttentionSpec(
        draw(common_specs(max_batch)),
        seq=draw(st.integers(2, 3)),
        dim=draw(st.integers(2, 3)),
        causal=draw(st.booleans()),
    )


@st.composite
def conv_specs(draw: st.DrawFn, max_batch: int = 3) -> ConvSpec:
    size = draw(st.sampled_from([4, 5]))
    kernel = draw(st.integers(2, 3))
    stride = draw(st.integers(1, 2))
    padding = draw(st.integers(0, 1))
    dilation = draw(st.integers(1, 2))
    side = conv_output_size(size, kernel, stride, padding, dilation)
    assume(side >= 1)
    pool = draw(st.sampled_from(["none", "max", "avg"])) if side >= 2 else "none"
    return ConvSpec(
        draw(common_specs(max_batch)),
        in_channels=draw(st.integers(1, 2)),
        out_channels=draw(st.integers(1, 2)),
        size=size,
        kernel=kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        pool=pool,
        pool_stride=draw(st.integers(1, 2)),
    )


@st.composite
def embedding_specs(draw: st.DrawFn, max_batch: int = 3) -> EmbeddingSpec:
    common = draw(common_specs(max_batch))
    vocab = draw(st.integers(3, 5))
    seq = draw(st.integers(2, 3))
    row = st.lists(st.integers(0, vocab - 1), min_size=seq, max_size=seq).map(tuple)
    ids = tuple(draw(st.lists(row, min_size=common.batch, max_size=common.batch)))
    return EmbeddingSpec(common, vocab=vocab, dim=draw(st.integers(2, 3)), ids=ids)


SPEC_STRATEGIES: dict[str, st.SearchStrategy[ModelSpec]] = {
    "mlp": mlp_specs(),
    "attention": attention_specs(),
    "conv": conv_specs(),
    "embedding": embedding_specs(),
}

#: Small enough that every path can be listed one by one.
TINY_SPEC_STRATEGY: st.SearchStrategy[ModelSpec] = st.one_of(
    mlp_specs(max_width=3, max_depth=2, max_batch=2),
    attention_specs(max_batch=1),
    conv_specs(max_batch=1),
    embedding_specs(max_batch=2),
)


# --------------------------------------------------------------------------------------------
# 1. The oracle checks itself
# --------------------------------------------------------------------------------------------


def _single_node_cases() -> list[tuple[str, Callable[..., Tensor], list[tuple[int, ...]]]]:
    """Functions whose output's grad_fn is one autograd node, with their input shapes."""
    return [
        ("mul_broadcast", lambda a, b: a * b, [(2, 3), (3,)]),
        ("square", lambda a: a * a, [(4,)]),
        ("softmax", lambda a: torch.softmax(a, dim=-1), [(2, 3)]),
        ("addmm_bias_broadcast", lambda a, w, b: torch.addmm(b, a, w), [(2, 3), (3, 4), (4,)]),
        (
            "layer_norm",
            lambda a, w, b: F.layer_norm(a, (3,), w, b),
            [(2, 3), (3,), (3,)],
        ),
        (
            "conv2d",
            lambda a, w: F.conv2d(a, w, stride=2, padding=1, dilation=2),
            [(1, 2, 4, 4), (2, 2, 2, 2)],
        ),
        ("tanh", torch.tanh, [(5,)]),
        ("mse_loss", lambda a, b: F.mse_loss(a, b), [(2, 2), (2, 2)]),
    ]


@pytest.mark.parametrize(
    ("name", "fn", "shapes"), _single_node_cases(), ids=[c[0] for c in _single_node_cases()]
)
def test_node_jacobians_match_functional_jacobian(
    name: str, fn: Callable[..., Tensor], shapes: list[tuple[int, ...]]
) -> None:
    """The one-hot backward calls reproduce torch.autograd.functional.jacobian exactly."""
    generator = torch.Generator().manual_seed(7)
    inputs = [torch.randn(s, generator=generator, dtype=DTYPE, requires_grad=True) for s in shapes]
    out = fn(*inputs)
    node = out.grad_fn
    blocks = node_jacobians(node)
    assert len(blocks) == 1, "single-output ops only"
    # Sum the blocks of every next_functions entry that leads to the same leaf (a * a).
    per_leaf = [torch.zeros(out.numel(), t.numel(), dtype=DTYPE) for t in inputs]
    for j, (child, _) in enumerate(node.next_functions):
        if child is None:
            continue
        leaf_index = next(i for i, t in enumerate(inputs) if t is child.variable)
        per_leaf[leaf_index] += torch.from_numpy(blocks[0][j])
    reference = torch.autograd.functional.jacobian(fn, tuple(inputs))
    for leaf_index, t in enumerate(inputs):
        expected = reference[leaf_index].reshape(out.numel(), t.numel())
        torch.testing.assert_close(per_leaf[leaf_index], expected, rtol=1e-12, atol=1e-14)


def test_square_keeps_parallel_edges() -> None:
    """x * x yields two next_functions entries, each an edge block of weight diag(x)."""
    x = torch.tensor([1.5, -2.0], dtype=DTYPE, requires_grad=True)
    out = x * x
    blocks = node_jacobians(out.grad_fn)[0]
    assert len(blocks) == 2
    for block in blocks:
        assert block is not None
        torch.testing.assert_close(torch.from_numpy(block), torch.diag(x.detach()))


def test_multi_output_node_jacobian() -> None:
    """unbind has one forward output per slice; each gets its own Jacobian row block."""
    x = torch.arange(6, dtype=DTYPE).reshape(3, 2).requires_grad_(True)
    parts = x.unbind(0)
    blocks = node_jacobians(parts[0].grad_fn)
    assert len(blocks) == 3
    for i, per_input in enumerate(blocks):
        expected = torch.zeros(2, 6, dtype=DTYPE)
        expected[0, 2 * i] = expected[1, 2 * i + 1] = 1.0
        torch.testing.assert_close(torch.from_numpy(per_input[0]), expected)


@dataclass(frozen=True)
class HandCase:
    """A function of x = [-0.5, 2.0] and the hand-derived readouts for its scalar output."""

    name: str
    fn: Callable[[Tensor], Tensor]
    expected: dict[str, list[float] | tuple[list[float], list[float]] | list[bool]]


LOG2 = math.log(2.0)
# (3x + x).sum(): two paths to each x_i, weights 3 and 1 (the sum node contributes 1).
ENTROPY_3_1 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))

HAND_CASES = [
    # (x + x).sum(): root -> add_i (weight 1) -> x_i twice (weight 1 each): two paths of
    # product 1. MaxProd 1, LogSum log 2, LogCount log 2, Entropy log 2 (uniform over 2).
    HandCase(
        "x_plus_x",
        lambda x: (x + x).sum(),
        {
            "real": [2.0, 2.0],
            "max_prod": [1.0, 1.0],
            "signed_max_prod": ([1.0, 1.0], [1.0, 1.0]),
            "log_sum": [LOG2, LOG2],
            "log_count": [LOG2, LOG2],
            "boolean": [True, True],
            "entropy": [LOG2, LOG2],
        },
    ),
    # (2 * x).sum(): one edge of weight 2 per entry, one path. MaxProd 2, LogSum log 2,
    # LogCount log 1 = 0, Entropy 0.
    HandCase(
        "two_times_x",
        lambda x: (2 * x).sum(),
        {
            "real": [2.0, 2.0],
            "max_prod": [2.0, 2.0],
            "signed_max_prod": ([2.0, 2.0], [2.0, 2.0]),
            "log_sum": [LOG2, LOG2],
            "log_count": [0.0, 0.0],
            "boolean": [True, True],
            "entropy": [0.0, 0.0],
        },
    ),
    # (x * x).sum(): two parallel edges of weight x_i, so two paths of product x_i.
    # x = [-0.5, 2]: MaxProd |x| = [0.5, 2], signed extremes both x_i, LogSum log(2|x|) =
    # [0, log 4], LogCount log 2, Entropy log 2, Real 2x = [-1, 4].
    HandCase(
        "x_times_x",
        lambda x: (x * x).sum(),
        {
            "real": [-1.0, 4.0],
            "max_prod": [0.5, 2.0],
            "signed_max_prod": ([-0.5, 2.0], [-0.5, 2.0]),
            "log_sum": [0.0, math.log(4.0)],
            "log_count": [LOG2, LOG2],
            "boolean": [True, True],
            "entropy": [LOG2, LOG2],
        },
    ),
    # (3 * x - x).sum(): paths of product 3 and -1. Signed extremes (3, -1), MaxProd 3,
    # LogSum log 4, Entropy of (3/4, 1/4), Real 2.
    HandCase(
        "three_x_minus_x",
        lambda x: (3 * x - x).sum(),
        {
            "real": [2.0, 2.0],
            "max_prod": [3.0, 3.0],
            "signed_max_prod": ([3.0, 3.0], [-1.0, -1.0]),
            "log_sum": [math.log(4.0), math.log(4.0)],
            "log_count": [LOG2, LOG2],
            "boolean": [True, True],
            "entropy": [ENTROPY_3_1, ENTROPY_3_1],
        },
    ),
    # relu(x).sum() with x_0 < 0: relu's derivative there is exactly 0, so x_0 has no path
    # (MaxProd 0, LogSum/LogCount -inf, Entropy NaN, Boolean False); x_1 has one path of 1.
    HandCase(
        "relu_cuts_a_path",
        lambda x: torch.relu(x).sum(),
        {
            "real": [0.0, 1.0],
            "max_prod": [0.0, 1.0],
            "signed_max_prod": ([0.0, 1.0], [0.0, 1.0]),
            "log_sum": [-math.inf, 0.0],
            "log_count": [-math.inf, 0.0],
            "boolean": [False, True],
            "entropy": [math.nan, 0.0],
        },
    ),
    # (x * x * x).sum() = ((x*x)*x).sum(): the outer mul a*b (a = x*x, b = x) has an edge of
    # weight b = x_i into a_i and one of weight a = x_i² into x_i; a_i has two edges of weight
    # x_i into x_i. Three paths, every product x_i²: MaxProd x² = [0.25, 4], signed extremes
    # both x², LogSum log(3x²) = [log 0.75, log 12], LogCount log 3, Entropy log 3 (uniform),
    # Real 3x² = [0.75, 12].
    HandCase(
        "x_cubed",
        lambda x: (x * x * x).sum(),
        {
            "real": [0.75, 12.0],
            "max_prod": [0.25, 4.0],
            "signed_max_prod": ([0.25, 4.0], [0.25, 4.0]),
            "log_sum": [math.log(0.75), math.log(12.0)],
            "log_count": [math.log(3.0), math.log(3.0)],
            "boolean": [True, True],
            "entropy": [math.log(3.0), math.log(3.0)],
        },
    ),
    # (x * x + 3 * x).sum(): paths x_i, x_i (the square) and 3. For x_0 = -0.5: products
    # {-0.5, -0.5, 3}: signed (3, -0.5), MaxProd 3, LogSum log 4, Entropy of (1/8, 1/8, 3/4),
    # Real 2 x_0 + 3 = 2. For x_1 = 2: {2, 2, 3}: signed (3, 2), LogSum log 7,
    # Entropy of (2/7, 2/7, 3/7), Real 7.
    HandCase(
        "x_squared_plus_three_x",
        lambda x: (x * x + 3 * x).sum(),
        {
            "real": [2.0, 7.0],
            "max_prod": [3.0, 3.0],
            "signed_max_prod": ([3.0, 3.0], [-0.5, 2.0]),
            "log_sum": [math.log(4.0), math.log(7.0)],
            "log_count": [math.log(3.0), math.log(3.0)],
            "boolean": [True, True],
            "entropy": [
                -(2 * 0.125 * math.log(0.125) + 0.75 * math.log(0.75)),
                -(2 * (2 / 7) * math.log(2 / 7) + (3 / 7) * math.log(3 / 7)),
            ],
        },
    ),
]


def _hand_expected(case: HandCase, semiring_name: str) -> Readout:
    value = case.expected[semiring_name]
    if semiring_name == "signed_max_prod":
        assert isinstance(value, tuple)
        return (torch.tensor(value[0], dtype=DTYPE), torch.tensor(value[1], dtype=DTYPE))
    if semiring_name == "boolean":
        return torch.tensor(value, dtype=torch.bool)
    return torch.tensor(value, dtype=DTYPE)


def _hand_x() -> Tensor:
    return torch.tensor([-0.5, 2.0], dtype=DTYPE, requires_grad=True)


@pytest.mark.parametrize("semiring_name", SEMIRING_NAMES)
@pytest.mark.parametrize("case", HAND_CASES, ids=[c.name for c in HAND_CASES])
def test_oracle_hand_computed(case: HandCase, semiring_name: str) -> None:
    """The oracle's DP and its path enumeration both give the hand-derived values."""
    x = _hand_x()
    graph = build_graph(case.fn(x))
    expected = _hand_expected(case, semiring_name)
    dp = dynamic_programming(graph, [x], semiring_name)[0]
    listed = values_from_paths(graph, enumerate_paths(graph), [x], semiring_name)[0]
    assert_readout_matches(semiring_name, expected, _as_extremes(dp), "oracle DP")
    assert_readout_matches(semiring_name, expected, _as_extremes(listed), "oracle paths")


@pytest.mark.parametrize("case", HAND_CASES, ids=[c.name for c in HAND_CASES])
def test_semipack_hand_computed(case: HandCase, semiring_name: str) -> None:
    """semipack gives the same hand-derived values (TopPath: MaxProd's)."""
    x = _hand_x()
    (actual,) = semipack.grad(case.fn(x), [x], SEMIRINGS[semiring_name]())
    expected = _hand_expected(case, ORACLE_NAME[semiring_name])
    assert_readout_matches(semiring_name, expected, actual, "semipack")


@pytest.mark.parametrize("semiring_name", list(SEMIRINGS))
def test_implicit_broadcast_is_drawn_as_an_expand(semiring_name: str) -> None:
    """``torch.dist(a, b)`` with ``b`` broadcast reduces over the copies inside one node: its
    values are the oracle's on ``torch.dist(a, b.expand_as(a))``, each copy a path of its own
    (README, "Semantics"). By hand, for ``b``: four paths of |±0.5| (MaxProd 0.5, LogCount
    log 4), where the node's summed partial derivative is -1."""
    a = torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=DTYPE, requires_grad=True)
    b = torch.tensor([0.0], dtype=DTYPE, requires_grad=True)
    want = oracle_readouts(build_graph(torch.dist(a, b.expand_as(a))), [a, b], semiring_name)
    got = semipack.grad(torch.dist(a, b), [a, b], SEMIRINGS[semiring_name]())
    for name, exp, act in zip("ab", want, got, strict=True):
        assert_readout_matches(semiring_name, exp, act, f"dist, {name}")
    if semiring_name == "max_prod":
        assert float(got[1]) == pytest.approx(0.5)
    if semiring_name == "log_count":
        assert float(got[1]) == pytest.approx(math.log(4))


def _as_extremes(readout: Readout) -> object:
    """Give an oracle (largest, smallest) pair the attribute names semipack's Extremes has."""
    if isinstance(readout, tuple):
        return semipack.Extremes(*readout)
    return readout


def _compare_dp_with_paths(spec: ModelSpec) -> None:
    case = build_case(spec)
    graph = build_graph(case.loss)
    try:
        paths = enumerate_paths(graph, max_paths=20_000)
    except PathLimitExceeded:
        assume(False)
        return
    for semiring_name in SEMIRING_NAMES:
        dp = dynamic_programming(graph, case.tensors, semiring_name)
        listed = values_from_paths(graph, paths, case.tensors, semiring_name)
        for (leaf_name, _), exp, got in zip(case.leaves, listed, dp, strict=True):
            assert_readout_matches(
                semiring_name, exp, _as_extremes(got), f"oracle DP vs paths, {leaf_name}, {spec}"
            )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=TINY_SPEC_STRATEGY)
def test_oracle_dp_matches_path_enumeration(spec: ModelSpec) -> None:
    """On tiny models, the DP equals evaluating each definition over the explicit path list."""
    _compare_dp_with_paths(spec)


@settings(max_examples=20, deadline=None)
@given(spec=st.one_of(*SPEC_STRATEGIES.values()))
def test_oracle_real_matches_autograd(spec: ModelSpec) -> None:
    """The oracle's Real DP is the gradient: validates graph building (sum_to, parallel edges)."""
    case = build_case(spec)
    graph = build_graph(case.loss)
    expected = torch.autograd.grad(case.loss, case.tensors, retain_graph=True)
    got = dynamic_programming(graph, case.tensors, "real")
    for (leaf_name, _), exp, value in zip(case.leaves, expected, got, strict=True):
        assert_readout_matches("real", exp, value, f"oracle vs autograd, {leaf_name}")


def test_oracle_counts_are_exact_integers() -> None:
    """A 2-layer width-2 MLP has a hand-countable number of paths into its first weight.

    loss = sum(W2 @ tanh(W1 @ x)) with batch 1: W1[j, i] -> h_j -> (loss via W2[:, j]) gives one
    path through each of the 2 outputs, so every W1 entry has exactly 2 paths; W2 entries 1.
    """
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, generator=generator, dtype=DTYPE)
    w1 = torch.randn(2, 2, generator=generator, dtype=DTYPE, requires_grad=True)
    w2 = torch.randn(2, 2, generator=generator, dtype=DTYPE, requires_grad=True)
    loss = (torch.tanh(x @ w1.T) @ w2.T).sum()
    counts = path_counts(build_graph(loss), [w1, w2])
    assert torch.equal(counts[0], torch.full((2, 2), 2, dtype=torch.int64))
    assert torch.equal(counts[1], torch.ones(2, 2, dtype=torch.int64))


def test_building_the_graph_keeps_saved_tensors() -> None:
    """Calling backward nodes directly frees nothing: a plain backward still works afterwards."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, generator=generator, dtype=DTYPE, requires_grad=True)
    w = torch.randn(3, 3, generator=generator, dtype=DTYPE, requires_grad=True)
    loss = torch.softmax(torch.tanh(x @ w), dim=-1).pow(2).sum()
    graph = build_graph(loss)
    build_graph(loss)  # twice, to be sure nothing was consumed the first time
    loss.backward()  # no retain_graph: raises if any saved tensor had been freed
    assert x.grad is not None and w.grad is not None
    expected = dynamic_programming(graph, [x, w], "real")
    torch.testing.assert_close(expected[0], x.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(expected[1], w.grad, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------------------------
# 2. semipack against the oracle on random models
# --------------------------------------------------------------------------------------------


def _semipack_readouts(case: Case, semiring_name: str) -> Sequence[object]:
    semiring = SEMIRINGS[semiring_name]()
    return semipack.grad(case.loss, case.tensors, semiring, retain_graph=True)


def check_semipack_against_oracle(spec: ModelSpec, semiring_names: Sequence[str]) -> None:
    """Every leaf's readout, for each semiring, equals the oracle's DP readout."""
    case = build_case(spec)
    graph = build_graph(case.loss)
    for semiring_name in semiring_names:
        expected = oracle_readouts(graph, case.tensors, semiring_name)
        actual = _semipack_readouts(case, semiring_name)
        assert len(actual) == len(expected)
        for (leaf_name, _), exp, act in zip(case.leaves, expected, actual, strict=True):
            assert_readout_matches(semiring_name, exp, act, f"{leaf_name}, {spec}")
        if semiring_name == "log_count":
            # Tiny graphs have few paths, so exp(log count) must round to the exact integer.
            for (leaf_name, _), count, act in zip(
                case.leaves, path_counts(graph, case.tensors), actual, strict=True
            ):
                rounded = torch.round(act.detach().double().exp()).to(torch.int64)
                assert torch.equal(rounded, count), mismatch(
                    f"log_count {leaf_name}, {spec}", count, rounded, "path counts differ"
                )


# hypothesis runs many examples per test call, so the semiring is a parameter, not the fixture
@pytest.mark.parametrize("semiring_name", list(SEMIRINGS))
@pytest.mark.parametrize("kind", sorted(SPEC_STRATEGIES))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_semipack_matches_oracle(kind: str, semiring_name: str, data: st.DataObject) -> None:
    """Property: semipack.grad equals the oracle for every leaf of random tiny models."""
    spec = data.draw(SPEC_STRATEGIES[kind], label="spec")
    check_semipack_against_oracle(spec, [semiring_name])


@settings(max_examples=10, deadline=None)
@given(spec=mlp_specs(), semiring_name=st.sampled_from(list(SEMIRINGS)))
def test_extend_matches_oracle(spec: MLPSpec, semiring_name: str) -> None:
    """The ``extend`` API sets p.semiring_grad to the oracle's readout and .grad as autograd."""
    case = build_case(spec)
    graph = build_graph(case.loss)
    params = list(case.model.parameters())
    expected = oracle_readouts(graph, params, semiring_name)
    plain = torch.autograd.grad(case.loss, params, retain_graph=True)
    with semipack.extend(case.model, SEMIRINGS[semiring_name]()):
        case.loss.backward()
    for (name, p), exp, grad in zip(case.model.named_parameters(), expected, plain, strict=True):
        assert_readout_matches(semiring_name, exp, p.semiring_grad, f"extend, {name}, {spec}")
        assert p.grad is not None
        torch.testing.assert_close(p.grad, grad, rtol=1e-12, atol=1e-14)
