"""``nn.EmbeddingBag`` / ``F.embedding_bag`` (``rules/embedding.py``): every mode, offsets or
bags as rows, per-sample weights (their own messages too), padding, sparse gradients. Each
semiring's value equals the oracle's path enumeration over PyTorch's own Jacobian (a row a bag
looks up twice is one entry of weight 2, not two edges) and ``.grad`` is a plain backward's,
bitwise. Until the thirty-fourth session the op had no rule."""

from __future__ import annotations

import pytest
import torch
from helpers import ORACLE_NAME, SEMIRINGS, assert_readout_matches, oracle_readouts
from oracle import build_graph
from torch import nn

import semipack

# 1-D lookups with offsets: bags [1, 3, 3], [], [0, 9], [1, 4, 3] (3 twice in the first)
IDS = torch.tensor([1, 3, 3, 0, 9, 1, 4, 3])
OFFSETS = torch.tensor([0, 3, 3, 5])

CASES = [
    # (mode, per-sample weights, padding_idx, 2-D bags, include_last_offset)
    ("sum", False, None, False, False),
    ("sum", True, None, False, False),
    ("sum", True, 3, False, True),
    ("mean", False, None, False, False),
    ("mean", False, 3, True, False),
    ("max", False, None, False, False),
    ("max", False, 3, True, False),
]


def _case(mode: str, weighted: bool, padding: int | None, rows: bool, last: bool, sparse=False):
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(
        10, 4, mode=mode, padding_idx=padding, include_last_offset=last, sparse=sparse
    ).double()
    head = nn.Linear(4, 2).double()
    ids, offsets = (IDS.reshape(2, 4), None) if rows else (IDS, OFFSETS)
    if last:
        offsets = torch.cat([OFFSETS, torch.tensor([IDS.numel()])])
    weights = None
    if weighted:
        seeded = torch.Generator().manual_seed(1)
        weights = torch.rand(ids.shape, dtype=torch.float64, generator=seeded).requires_grad_()

    def loss() -> torch.Tensor:
        return head(bag(ids, offsets, per_sample_weights=weights).tanh()).square().sum()

    leaves = [bag.weight] + ([weights] if weighted else [])
    return nn.ModuleList([bag, head]), loss, leaves


def _clear(model: nn.Module, leaves: list[torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    for leaf in leaves:
        leaf.grad = None


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c))
@pytest.mark.parametrize("semiring_name", sorted(SEMIRINGS))
def test_embedding_bag_matches_the_oracle(semiring_name: str, case: tuple) -> None:
    model, loss, leaves = _case(*case)
    oracle = ORACLE_NAME[semiring_name]
    expected = oracle_readouts(build_graph(loss()), leaves, oracle)
    _clear(model, leaves)
    loss().backward()
    plain = [leaf.grad.clone() for leaf in leaves]
    _clear(model, leaves)
    with semipack.extend(model, SEMIRINGS[semiring_name]()):
        loss().backward()
    for leaf, want, grad in zip(leaves, expected, plain, strict=True):
        assert torch.equal(leaf.grad, grad)
        assert_readout_matches(oracle, want, leaf.semiring_grad, f"embedding_bag {case}")


def test_a_row_looked_up_twice_by_one_bag_is_one_edge_of_weight_two() -> None:
    """Bag [3, 3] reaches row 3 by one Jacobian entry of 2: MaxProd reads 2 there, not 1."""
    table = nn.EmbeddingBag(5, 1, mode="sum")
    with torch.no_grad():
        table.weight.fill_(1.0)
    with semipack.extend(table, semipack.MaxProd()):
        table(torch.tensor([[3, 3]])).sum().backward()
    assert table.weight.semiring_grad[:, 0].tolist() == [0.0, 0.0, 0.0, 2.0, 0.0]


def test_a_sparse_bag_table_keeps_its_sparse_gradient() -> None:
    model, loss, leaves = _case("sum", False, None, False, False, sparse=True)
    loss().backward()
    plain = leaves[0].grad
    _clear(model, leaves)
    with semipack.extend(model, semipack.Real()):
        loss().backward()
    assert leaves[0].grad.layout == torch.sparse_coo
    assert torch.equal(leaves[0].grad.to_dense(), plain.to_dense())
    torch.testing.assert_close(leaves[0].semiring_grad, plain.to_dense(), rtol=1e-12, atol=0)


def test_scale_grad_by_freq_is_refused_by_name() -> None:
    table = nn.EmbeddingBag(5, 2, mode="sum", scale_grad_by_freq=True)
    with semipack.extend(table, semipack.MaxProd()):
        out = table(torch.tensor([[1, 3]])).sum()
        with pytest.raises(semipack.UnsupportedOpError, match="scale_grad_by_freq scales"):
            out.backward()
