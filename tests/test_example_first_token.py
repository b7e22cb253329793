"""``examples/first_token_repeat.py`` on small untrained models (no real training here): the data
recipe, the model, one training step, and the analysis, whose batched backward must give every
example the values of a backward from its own logit alone, equal to the brute-force oracle of
the model with the attention block's input untied per use."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from oracle import build_graph, dynamic_programming
from torch import Tensor

import semipack
from semipack.explain import TokenTypeTable, attention_branch

pytest.importorskip("transformers")
pytest.importorskip("tqdm")
pytestmark = pytest.mark.usefixtures("single_thread")

_PATH = Path(__file__).resolve().parent.parent / "examples" / "first_token_repeat.py"
_SPEC = importlib.util.spec_from_file_location("first_token_repeat", _PATH)
ftr = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = ftr  # its dataclass looks its module up there
_SPEC.loader.exec_module(ftr)


def test_the_data_follow_the_authors_recipe() -> None:
    ids, labels = ftr.make_data(ftr.POINTS, torch.Generator().manual_seed(0))
    assert ids.shape == (10_000, 10) and labels.shape == (10_000,)
    assert ids.min() >= 1 and ids.max() <= 19  # token 0 is never used
    copies = (ids[:, 1:] == ids[:, :1]).sum(1)
    assert (copies[labels == 1] == 1).all() and (copies[labels == 0] == 0).all()
    assert int(labels.sum()) == 5_000
    # the repeat's position and the first token cover their whole ranges
    where = (ids[:, 1:] == ids[:, :1]).long().argmax(1)[labels == 1] + 1
    assert set(where.tolist()) == set(range(1, 10)) and set(ids[:, 0].tolist()) == set(range(1, 20))
    split = ftr.split_data(ids, labels)
    assert [len(split[k][0]) for k in ("train", "val", "test")] == [7_000, 1_000, 2_000]
    assert torch.equal(torch.cat([split[k][0] for k in ("train", "val", "test")]), ids)
    again, _ = ftr.make_data(ftr.POINTS, torch.Generator().manual_seed(0))
    assert torch.equal(again, ids)  # the data set is a function of its seed


def test_token_types() -> None:
    ids = torch.tensor([[4, 2, 4, 9], [7, 1, 2, 3]])
    assert ftr.token_types(ids).tolist() == [[0, 2, 1, 2], [0, 2, 2, 2]]


def test_the_model_has_the_papers_size_and_a_step_trains_it() -> None:
    model = ftr.build_model(0)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers) == (16, 2, 1)
    assert cfg.intermediate_size == 32 and cfg.vocab_size == 20 and cfg.num_labels == 2
    ids, labels = ftr.make_data(8, torch.Generator().manual_seed(1))
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = ftr.train_step(model, optimizer, ids, labels)
    assert isinstance(loss, float) and loss > 0
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert "classifier.weight" in changed
    assert "bert.encoder.layer.0.attention.self.query.weight" in changed
    assert 0.0 <= ftr.accuracy(model, ids, labels) <= 1.0


def _one_by_one(model, ids: Tensor, labels: Tensor, drawing: str) -> dict[str, Tensor]:
    """Branch -> ``[examples, tokens]``: one backward per example, each token's best unit read
    off the unsummed branch values (``split.values``) with ``amax``."""
    rows = {b: [] for b in ftr.BRANCH_NAMES}
    for e in range(ids.shape[0]):
        split = ftr.branch_split(model, ids[e : e + 1], labels[e : e + 1], drawing)
        for name, value in split.values.items():
            rows[attention_branch(name)].append(value[0].amax(-1))
    return {b: torch.stack(r) for b, r in rows.items()}


@pytest.mark.parametrize("drawing", ftr.DRAWINGS)
def test_the_batched_analysis_equals_one_backward_per_example(drawing: str) -> None:
    model = ftr.build_model(3)
    ids, labels = ftr.make_data(12, torch.Generator().manual_seed(2))
    table = ftr.analyse(model, ids, labels, drawing, batch=5)  # batches of 5, 5 and 2
    by_hand = TokenTypeTable.from_values(
        _one_by_one(model, ids, labels, drawing), ftr.token_types(ids), ftr.TYPE_NAMES
    )
    assert table.branch_names == ftr.BRANCH_NAMES and table.type_names == ftr.TYPE_NAMES
    assert table.counts.tolist() == by_hand.counts.tolist()
    torch.testing.assert_close(table.mean, by_hand.mean, rtol=1e-5, atol=0)
    torch.testing.assert_close(table.share, by_hand.share)


def _untied_oracle(model, ids: Tensor, label: int, drawing: str) -> dict[str, Tensor]:
    """Branch -> ``[tokens, hidden]``: the float64 oracle of the model whose query, key and
    value projections and residual add each read their own copy of the embeddings' output."""
    model = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        h = model.bert.embeddings(input_ids=ids)
    copies = {b: h.clone().requires_grad_() for b in ftr.BRANCH_NAMES}
    attention = model.bert.encoder.layer[0].attention
    for b in ("query", "key", "value"):
        linear = getattr(attention.self, b)
        linear.forward = lambda _, w=linear.weight, c=linear.bias, x=copies[b]: (
            torch.nn.functional.linear(x, w, c)
        )
    add_back = attention.output.forward
    attention.output.forward = lambda out, _: add_back(out, copies["residual"])

    def logit() -> Tensor:
        hidden = model.bert.encoder(h).last_hidden_state
        return model.classifier(model.bert.pooler(hidden))[0, label]

    if drawing == "atomic":  # the model's own graph, no semipack in the forward
        root = logit()
    else:  # softmax written out as exp(s - logsumexp(s)), every op in plain autograd
        with semipack.extend(model, semipack.MaxProd(), drawing=drawing, extensions=False):
            root = logit()
    leaves = [copies[b] for b in ftr.BRANCH_NAMES]
    found = dynamic_programming(build_graph(root), leaves, "max_prod")
    return {b: v[0] for b, v in zip(ftr.BRANCH_NAMES, found, strict=True)}


@pytest.mark.parametrize("drawing", ftr.DRAWINGS)
def test_the_branch_values_equal_the_untied_oracle(drawing: str) -> None:
    model = ftr.build_model(4).double()
    ids, labels = ftr.make_data(2, torch.Generator().manual_seed(5))
    split = ftr.branch_split(model, ids, labels, drawing)
    got = {attention_branch(k): v for k, v in split.values.items()}
    for e in range(2):
        want = _untied_oracle(model, ids[e : e + 1], int(labels[e]), drawing)
        for b in ftr.BRANCH_NAMES:
            torch.testing.assert_close(got[b][e], want[b], rtol=1e-10, atol=0, msg=b)


def test_the_script_runs_end_to_end(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    argv = ["--seeds", "0", "--points", "200", "--epochs", "1", "--out", str(tmp_path)]
    assert ftr.main(argv) == 0
    printed = capsys.readouterr().out
    assert "seed 0: test accuracy" in printed and "drawing='decomposed'" in printed
    assert (tmp_path / "first_token_repeat.png").stat().st_size > 1000
    markdown = (tmp_path / "first_token_repeat.md").read_text()
    assert markdown.count("| first |") == 2 and "paper 0.17" in markdown
