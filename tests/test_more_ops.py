"""Op rules beyond the core model zoo, each checked against autograd and the brute-force oracle.

Every function here is a small graph; the oracle builds its scalar DAG from autograd's own
Jacobians, so the checks are independent of semipack's rules.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torchvision
from cases_ops import FUNCTIONS, function_leaf
from helpers import SEMIRINGS, assert_readout_matches, oracle_readouts
from oracle import build_graph

import semipack


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_op_rule_matches_oracle(name: str, semiring_name: str) -> None:
    fn, shape = FUNCTIONS[name]
    x = function_leaf(*shape)
    _matches_oracle(fn(x), x, semiring_name, name)


def _matches_oracle(out: torch.Tensor, x: torch.Tensor, semiring_name: str, name: str) -> None:
    """semipack's value at ``x`` for a weighted sum of ``out`` equals the brute-force oracle's
    (and, for Real, autograd's)."""
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    loss = (out * weights).sum()
    (expected,) = oracle_readouts(build_graph(loss), [x], semiring_name)
    (actual,) = semipack.grad(loss, x, SEMIRINGS[semiring_name](), retain_graph=True)
    assert_readout_matches(semiring_name, expected, actual, name)
    if semiring_name == "real":
        torch.testing.assert_close(actual, torch.autograd.grad(loss, x)[0], rtol=1e-10, atol=1e-12)


UNSUPPORTED = {
    "aten.grid_sampler_2d_backward.default": lambda x: F.grid_sample(
        x, torch.zeros(1, 2, 2, 2, dtype=torch.float64), align_corners=False
    ),
    "aten._cdist_backward.default": lambda x: torch.cdist(x[0, 0], x[0, 1]),
    "aten._pdist_backward.default": lambda x: F.pdist(x[0, 0]),
    "aten.linalg_lu_solve.default": lambda x: torch.linalg.solve(x[0, 0], x[0, 1, :, 0]),
    "aten.fractional_max_pool2d_backward.default": lambda x: F.fractional_max_pool2d(
        x, 2, output_size=1, _random_samples=torch.full((1, 2, 2), 0.5, dtype=torch.float64)
    ),
    "aten.xlogy.Tensor": lambda x: torch.xlogy(x, x.abs() + 1),
    "aten.special_xlog1py.default": lambda x: torch.special.xlog1py(x, x.abs()),
    "aten.put.default": lambda x: x.take(torch.tensor([0, 2])),
    "aten.linalg_cross.default": lambda x: torch.linalg.cross(x[0, 0], x[0, 1]),
    "aten._ctc_loss_backward.default": lambda x: F.ctc_loss(
        x[0, :, :1].log_softmax(-1), torch.tensor([[1, 2]]), torch.tensor([2]), torch.tensor([2])
    ),
    # ops inside a backward formula that would need a rule of their own here
    "aten.abs.default": lambda x: torch.logcumsumexp(x, -1),
}


_BOXES = [torch.tensor([[0.0, 0.0, 2.0, 2.0]], dtype=torch.float64)]

#: torchvision's detection ops: their backward kernels have no rule
UNSUPPORTED |= {
    "torchvision._roi_align_backward.default": lambda x: torchvision.ops.roi_align(
        x, _BOXES, output_size=2
    ),
    "torchvision._roi_pool_backward.default": lambda x: torchvision.ops.roi_pool(
        x, _BOXES, output_size=2
    ),
    "torchvision._ps_roi_align_backward.default": lambda x: torchvision.ops.ps_roi_align(
        x.repeat(1, 2, 1, 1), _BOXES, output_size=2
    ),
    "torchvision._deform_conv2d_backward.default": lambda x: torchvision.ops.deform_conv2d(
        x,
        torch.zeros(1, 18, 3, 3, dtype=torch.float64),
        torch.ones(2, 2, 3, 3, dtype=torch.float64),
        padding=1,
    ),
}


def test_sgn_of_a_real_input_is_sign(semiring_name: str) -> None:
    """``sgn`` of a real input is ``sign`` (derivative 0: no path through it); its formula
    builds an efficient zero tensor from a meta copy of the gradient, which raised (trial 68).
    The brute-force oracle cannot read a zero tensor: ``sign``'s values, oracle-tested above,
    are the reference, and autograd's for Real."""
    x = function_leaf(2, 3)
    sr = SEMIRINGS[semiring_name]()
    for through in (lambda f: f(x) * 3 + x.exp(), lambda f: f(x) * 3):
        got = semipack.grad(through(torch.sgn).sum(), x, sr)[0]
        want = semipack.grad(through(torch.sign).sum(), x, sr)[0]
        assert_readout_matches(semiring_name, want, got, "sgn")
        if semiring_name == "real":
            (plain,) = torch.autograd.grad(through(torch.sgn).sum(), x)
            torch.testing.assert_close(got, plain, rtol=0, atol=0)


@pytest.mark.parametrize("op", list(UNSUPPORTED))
def test_ops_without_rules_raise_naming_the_op(op: str) -> None:
    """Known gaps fail loudly, never with a silently wrong number."""
    x = function_leaf(1, 2, 3, 3)
    with pytest.raises(semipack.UnsupportedOpError) as info:
        semipack.grad(UNSUPPORTED[op](x).sum(), x, semipack.MaxProd())
    assert info.value.op == op


def test_matrix_exp_names_its_node() -> None:
    """matrix_exp's backward builds a block matrix of the message and plain tensors (a
    ``cat``): no semiring meaning, so it raises, naming the op and the autograd node."""
    x = function_leaf(3, 3)
    with pytest.raises(semipack.MessageLostError) as info:
        semipack.grad(torch.linalg.matrix_exp(x).sum(), x, semipack.MaxProd())
    assert str(info.value).startswith(
        "aten.cat.default in the backward of LinalgMatrixExpBackward0: a non-zero plain tensor "
        "was combined with a semiring message"
    )


def test_boolean_keeps_edges_that_only_float64_resolves() -> None:
    """A target probability one ulp below 1: the edge 1 - p = 2.2e-16 exists in float64.

    Boolean states are bool tensors; the Jacobian must still be built in the gradient's
    precision (it once was built in float32, where 1 - p rounds to 0 and the path vanished).
    """
    logits = torch.tensor([[-46.965, -36.451, 0.0]], dtype=torch.float64, requires_grad=True)
    loss = F.cross_entropy(logits, torch.tensor([2]))
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    assert grad[0, 2] != 0
    (reach,) = semipack.grad(loss, logits, semipack.Boolean(), retain_graph=True)
    assert torch.equal(reach, grad != 0)
    (count,) = semipack.grad(loss, logits, semipack.LogCount())
    assert torch.equal(count, torch.zeros_like(count))  # one path to each logit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", ["small", "large", "large channels last"])
def test_relu_cut_equals_where_bitwise(dtype, size) -> None:
    """The ReLU rule's cut (``threshold_backward`` and an infinite offset, or for dense
    states the native or compiled select of ``kernels/cuts.py``, instead of ``torch.where``
    on a bool mask) gives where's bits for every zero a semiring has, with NaN, infinite and
    threshold-equal inputs, and NaN, infinite and -0.0 message entries, in either layout, into
    a new tensor and into the state's own memory (a donated state)."""
    from semipack.kernels.cuts import cut_below
    from semipack.kernels.native import native_available
    from semipack.rules.pointwise import _ReluCut

    gen = torch.Generator().manual_seed(3)
    shape = (3, 5, 10, 70) if size == "small" else (4, 8, 10, 70)  # 10500 entries: a tail
    x = torch.randn(*shape, generator=gen, dtype=dtype)
    part = torch.randn(*shape, generator=gen, dtype=dtype)
    # one pass: the native loop for float32 at any size, else compiled for large states only
    one_pass = size != "small" or (dtype == torch.float32 and native_available())
    assert (cut_below(part, x, 0.0, -math.inf) is not None) == one_pass
    for step, value in [(101, math.nan), (103, math.inf), (107, -math.inf), (7, 0.0), (11, 0.5)]:
        x.view(-1)[::step] = value
    for step, value in [(37, math.nan), (41, math.inf), (43, -0.0), (47, -math.inf)]:
        part.view(-1)[::step] = value
    if size == "large channels last":
        x = x.contiguous(memory_format=torch.channels_last)
        part = part.contiguous(memory_format=torch.channels_last)
    for threshold in (0.0, 0.5, -1.0):
        cut = _ReluCut(x, threshold)
        for zero in (0.0, -0.0, -math.inf, math.inf, 3.0):
            want = torch.where(x <= threshold, zero, part)
            got = cut(part, zero)
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
            assert torch.equal(got.signbit(), want.signbit()), (threshold, zero)
            assert got.stride() == part.stride()
            own = part.clone(memory_format=torch.preserve_format)
            written = cut(own, zero, in_place=True)
            # the zeros torch's cut or the one-pass select writes; others take where
            plus_zero = zero == 0.0 and math.copysign(1.0, zero) > 0
            if zero in (math.inf, -math.inf) or plus_zero:
                assert written.data_ptr() == own.data_ptr()
            assert written.stride() == part.stride()
            assert torch.equal(written.isnan(), want.isnan())
            assert torch.equal(written.nan_to_num(), want.nan_to_num())
            assert torch.equal(written.signbit(), want.signbit()), (threshold, zero)


def _adjacency() -> torch.Tensor:
    """A 4 x 4 sparse constant as a graph network's adjacency: uncoalesced (entry (0, 1) is
    stored twice, its derivative the sum), with a stored 0 (no edge) and a negative weight."""
    indices = torch.tensor([[0, 0, 1, 2, 2, 3, 0], [1, 2, 0, 3, 2, 1, 1]])
    values = torch.tensor([0.5, -1.5, 2.0, 0.0, 0.7, 1.2, 0.25], dtype=torch.float64)
    return torch.sparse_coo_tensor(indices, values, (4, 4))


SPARSE_PRODUCTS = {
    "sparse.mm(S, h)": lambda s, h: torch.sparse.mm(s, h),
    "h.T @ S": lambda s, h: h.t() @ s,
    "CSR S @ h": lambda s, h: s.coalesce().to_sparse_csr() @ h,
    "sparse.addmm(h, S, h)": lambda s, h: torch.sparse.addmm(h, s, h),
}


@pytest.mark.parametrize("name", list(SPARSE_PRODUCTS))
def test_a_sparse_constant_operand_matches_oracle(name: str, semiring_name: str) -> None:
    """A GCN's ``torch.sparse.mm(adjacency, h)``: every semiring but Real failed with a raw
    error (a data pointer of a sparse tensor, ``log_`` on SparseCPU; trial 54). The product
    runs over the stored entries."""
    x = function_leaf(4, 2)
    _matches_oracle(SPARSE_PRODUCTS[name](_adjacency(), x.sin()), x, semiring_name, name)


def test_a_batched_sparse_product_is_refused_by_name() -> None:
    s = torch.stack([_adjacency().to_dense()] * 2).to_sparse()
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(semipack.UnsupportedOpError, match=r"batched product with a torch\.sparse"):
        semipack.grad(torch.bmm(s, x).sum(), x, semipack.MaxProd())


class _TiedLookup(torch.nn.Module):
    """A table looked up and used again as the output projection (tied weights)."""

    def __init__(self, max_norm: float | None = None) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3, max_norm=max_norm)
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, ids):
        return self.lin(self.emb(ids)) @ self.emb.weight.T


@pytest.mark.parametrize(
    "options",
    [{}, {"per_sample": True}, {"extensions": False}, {"max_norm": 1.0}],
    ids=["extension", "per sample", "generic rules", "max_norm"],
)
def test_int32_ids_give_what_int64_ids_give(options: dict) -> None:
    """PyTorch's embedding takes int32 ids; their distinct rows (``torch.unique``) came out
    int32, which ``index_copy_`` refuses: a raw RuntimeError (trial 54). The int64 run is the
    reference (its values are checked against the oracle above)."""
    options = dict(options)
    max_norm = options.pop("max_norm", None)
    got = {}
    for dtype in (torch.int64, torch.int32):
        torch.manual_seed(0)
        model = _TiedLookup(max_norm).double()
        ids = torch.tensor([[0, 3], [1, 3]], dtype=dtype)
        with semipack.extend(model, semipack.Entropy(), **options):
            model(ids).pow(2).sum().backward()
        weight = model.emb.weight
        got[dtype] = [weight.grad, weight.semiring_grad]
        if options.get("per_sample"):
            got[dtype].append(weight.semiring_grad_batch)
    for want, have in zip(got[torch.int64], got[torch.int32], strict=True):
        assert torch.equal(want, have)
    w = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 2, 2]])
    (want,) = semipack.grad(F.embedding(ids, w).sum(), w, semipack.LogSum())
    (have,) = semipack.grad(F.embedding(ids.int(), w).sum(), w, semipack.LogSum())
    assert torch.equal(want, have)


def test_embedding_scaled_by_frequency_is_refused() -> None:
    """``scale_grad_by_freq`` divides each row's gradient by how often its id occurs: a
    statistic of the batch, not a local derivative (no edge weight to draw)."""
    emb = torch.nn.Embedding(5, 3, scale_grad_by_freq=True)
    for extensions in (True, False):
        with (
            pytest.raises(semipack.UnsupportedOpError) as info,
            semipack.extend(emb, semipack.MaxProd(), extensions=extensions),
        ):
            emb(torch.tensor([[0, 1, 1]])).sum().backward()
        assert info.value.op == "aten.embedding_dense_backward.default"
        assert "scale_grad_by_freq scales gradients by a statistic" in str(info.value)


class _FillsOnes(torch.autograd.Function):
    """``x.sum()`` with a backward that fills the message into a tensor of ones: an added
    constant, which no semiring draws."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        return torch.ones(ctx.shape, dtype=grad.dtype).index_fill(0, torch.tensor([0]), grad)


def test_a_message_filled_into_non_zero_values_is_refused() -> None:
    """``index_fill`` with a message as its value takes a message or exact zeros (``trace``'s
    formula) as the rest; other values would add a constant to the message."""
    x = function_leaf(3)
    with pytest.raises(
        semipack.UnsupportedOpError, match="index_fill of a message into a tensor with non-zero"
    ):
        semipack.grad(_FillsOnes.apply(x), x, semipack.MaxProd())
