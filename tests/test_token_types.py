"""``TokenTypeTable``: branch values pooled by token type, checked against numbers worked out by
hand and, on a tiny BERT, against per-token loops over ``split.values`` (a different route from
the table's: readouts of the unsummed branches, then a max or log-sum-exp by hand, one token at a
time)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_bert_config
from torch import Tensor, nn

import semipack
from semipack.explain import TokenTypeTable, attention_branch

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("single_thread")
NAMES = ("first", "repeated", "other")


def test_a_small_table_worked_out_by_hand() -> None:
    values = {
        "a": torch.tensor([[1.0, 3.0], [2.0, 0.0]]),
        "b": torch.tensor([[2.0, 1.0], [2.0, 5.0]]),
    }
    types = torch.tensor([[0, 1], [1, -1]])  # the last token is left out
    table = TokenTypeTable.from_values(values, types, NAMES)
    assert table.type_names == NAMES and table.branch_names == ("a", "b")
    assert table.counts.tolist() == [1, 2, 0]
    # type 0: the token (a=1, b=2); type 1: (3, 1) and the tie (2, 2), split half and half
    torch.testing.assert_close(table.mean[:2], torch.tensor([[1.0, 2.0], [2.5, 1.5]], dtype=F64))
    torch.testing.assert_close(table.share[:2], torch.tensor([[0.0, 1.0], [0.75, 0.25]], dtype=F64))
    assert table.mean[2].isnan().all() and table.share[2].isnan().all()  # a type with no token


def test_pooling_tables_is_the_table_of_all_their_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    values = {b: torch.rand(7, 5, generator=gen) for b in ("q", "k", "v")}
    types = torch.randint(0, 3, (7, 5), generator=gen)
    types[:3] = torch.where(types[:3] == 2, 0, types[:3])  # the first part has no type 2
    whole = TokenTypeTable.from_values(values, types, NAMES)
    parts = [
        TokenTypeTable.from_values({b: v[rows] for b, v in values.items()}, types[rows], NAMES)
        for rows in (slice(0, 3), slice(3, 7))
    ]
    pooled = TokenTypeTable.pool(parts)
    assert parts[0].counts[2] == 0 and pooled.counts.tolist() == whole.counts.tolist()
    torch.testing.assert_close(pooled.mean, whole.mean)
    torch.testing.assert_close(pooled.share, whole.share)


def _bert_split(semiring: semipack.Semiring) -> tuple[semipack.Branches, Tensor]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertModel._from_config(tiny_bert_config(), attn_implementation="eager")
    model = model.double().eval()
    ids = torch.tensor([[3, 5, 3, 2, 7], [4, 1, 6, 4, 9], [8, 2, 5, 6, 1]])
    with semipack.extend(model, semiring):
        with semipack.branches(model.encoder.layer[0].attention) as split:
            out = model(input_ids=ids).last_hidden_state
        out[:, 0].sum().backward()
    return split, ids


def _types(ids: Tensor) -> Tensor:
    types = torch.where(ids == ids[:, :1], 1, 2)
    types[:, 0] = 0
    return types


def test_a_bert_table_equals_per_token_loops_over_the_branch_values() -> None:
    split, ids = _bert_split(semipack.MaxProd())
    types = _types(ids)
    table = TokenTypeTable.from_branches(split, types, NAMES, short=attention_branch)
    assert table.branch_names == ("query", "key", "value", "residual")
    short = {attention_branch(name): name for name in split.names}
    for t, type_name in enumerate(NAMES):
        tokens = [(e, i) for e in range(ids.shape[0]) for i in range(ids.shape[1])]
        tokens = [(e, i) for e, i in tokens if types[e, i] == t]
        best = {branch: [] for branch in table.branch_names}
        for e, i in tokens:
            per_branch = {b: float(split.values[short[b]][e, i].max()) for b in best}
            top = max(per_branch.values())
            winners = [b for b, v in per_branch.items() if v == top]
            for b in best:
                best[b].append((per_branch[b], 1 / len(winners) if b in winners else 0.0))
        assert int(table.counts[t]) == len(tokens), type_name
        for j, b in enumerate(table.branch_names):
            mean = sum(v for v, _ in best[b]) / len(tokens)
            share = sum(s for _, s in best[b]) / len(tokens)
            assert math.isclose(float(table.mean[t, j]), mean, rel_tol=1e-12), (type_name, b)
            assert math.isclose(float(table.share[t, j]), share, rel_tol=1e-12), (type_name, b)
    # the root reads position 0 only; a later token's query and residual feed only its own
    # position, so they carry no path
    assert (table.mean[1:, [0, 3]] == 0).all()


def test_branches_that_share_a_short_name_are_joined_by_the_semirings_plus() -> None:
    """LogSum: the union of the query, key and value paths over a token's units is the
    log-sum-exp over branches and units of the per-unit values."""
    split, ids = _bert_split(semipack.LogSum())

    def joined(name: str) -> str:
        return "residual" if attention_branch(name) == "residual" else "attention"

    table = TokenTypeTable.from_branches(split, _types(ids), NAMES, short=joined)
    assert table.branch_names == ("attention", "residual")
    projections = [v for k, v in split.values.items() if not k.endswith("output")]
    union = torch.stack(projections).logsumexp(0).logsumexp(-1)  # [examples, tokens]
    residual = split.values["encoder.layer.0.attention.output"].logsumexp(-1)
    by_hand = TokenTypeTable.from_values(
        {"attention": union, "residual": residual}, _types(ids), NAMES
    )
    torch.testing.assert_close(table.mean, by_hand.mean, equal_nan=True)
    torch.testing.assert_close(table.share, by_hand.share, equal_nan=True)


class _TwoUses(nn.Module):
    """Two consumers of h, of which the loss below reads only the first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self.a(h), self.b(h)


def test_a_branch_no_path_reached_holds_no_path() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 3), _TwoUses()).double()
    x = torch.randn(2, 4, 2, dtype=F64)
    with semipack.extend(net, semipack.MaxProd()):
        with semipack.branches(net[1]) as split:
            used, _ = net(x)
        used.sum().backward()
    assert split.names == ["1.a", "1.b"] and list(split.messages) == ["1.a"]
    table = TokenTypeTable.from_branches(split, torch.zeros(2, 4, dtype=torch.long), ["all"])
    assert table.mean[0, 1] == 0 and table.mean[0, 0] > 0
    assert table.share[0].tolist() == [1.0, 0.0]


def test_mistakes_are_named() -> None:
    good = {"a": torch.ones(2, 3)}
    types = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"branch 'a' has values of shape \(3, 2\)"):
        TokenTypeTable.from_values({"a": torch.ones(3, 2)}, types, NAMES)
    with pytest.raises(TypeError, match="integer labels"):
        TokenTypeTable.from_values(good, types.float(), NAMES)
    with pytest.raises(ValueError, match="label 3 has no name"):
        TokenTypeTable.from_values(good, types + 3, NAMES)
    with pytest.raises(ValueError, match="at least one branch"):
        TokenTypeTable.from_values({}, types, NAMES)
    with pytest.raises(ValueError, match="run the backward first"):
        TokenTypeTable.from_branches(semipack.Branches(), types, NAMES)
    with pytest.raises(ValueError, match="different token types or branches"):
        TokenTypeTable.pool(
            [
                TokenTypeTable.from_values(good, types, NAMES),
                TokenTypeTable.from_values({"b": torch.ones(2, 3)}, types, NAMES),
            ]
        )
    with pytest.raises(ValueError, match="at least one table"):
        TokenTypeTable.pool([])
    # KBest reads k values per token: not one number per token
    split, ids = _bert_split(semipack.KBest(2))
    with pytest.raises(ValueError, match=r"has values of shape \(3, 5, 2\)"):
        TokenTypeTable.from_branches(split, _types(ids), NAMES)
    split, ids = _bert_split(semipack.SignedMaxProd())
    with pytest.raises(ValueError, match="not one number per token"):
        TokenTypeTable.from_branches(split, _types(ids), NAMES)


def test_text_markdown_and_bar_chart(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    values = {"query": torch.tensor([[0.2, 0.0]]), "key": torch.tensor([[0.1, 0.3]])}
    table = TokenTypeTable.from_values(values, torch.tensor([[0, 1]]), NAMES[:2])
    text = str(table)
    assert "query" in text and "repeated" in text and "100.0%" in text
    reference = {"first": {"query": 0.17}, "repeated": {"key": 0.27}}
    markdown = table.to_markdown(reference)
    assert markdown.splitlines()[0] == "| token type | tokens | query | key |"
    assert "| first | 1 | 0.2 (100%), paper 0.17 | 0.1 (0%) |" in markdown
    path = tmp_path / "bars.png"
    fig = table.bar_chart(path, reference=reference, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    drawn = [(b.get_x() + b.get_width() / 2, b.get_height()) for b in fig.axes[0].patches]
    assert [round(h, 6) for _, h in drawn] == [0.2, 0.0, 0.1, 0.3]  # query bars, then key
    marks = [line.get_ydata()[0] for line in fig.axes[0].lines]
    assert sorted(marks) == [0.17, 0.27]
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    assert table.bar_chart(ax=ax) is ax.figure and len(ax.patches) == 4


def test_nan_and_minus_inf_values_stay_in_their_own_type_and_branch() -> None:
    """NaN (no value) leaves its branch's mean and never wins; a token with no value at all is
    left out; ``-inf`` (log of no path) makes only its own mean ``-inf``."""
    nan, inf = math.nan, math.inf
    values = {
        "q": torch.tensor([[1.0, nan, 3.0, nan, -inf]]),
        "k": torch.tensor([[2.0, 5.0, nan, nan, 0.5]]),
    }
    table = TokenTypeTable.from_values(values, [[0, 0, 1, 1, 2]], NAMES)  # types as lists
    assert table.counts.tolist() == [2, 1, 1]  # token 3 has no value
    assert table.branch_counts.tolist() == [[1, 2], [1, 0], [1, 1]]
    want_mean = torch.tensor([[1.0, 3.5], [3.0, nan], [-inf, 0.5]], dtype=F64)
    torch.testing.assert_close(table.mean, want_mean, equal_nan=True)
    want_share = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]], dtype=F64)
    torch.testing.assert_close(table.share, want_share)


def test_pooling_with_nan_values_weights_each_branch_by_its_own_tokens() -> None:
    gen = torch.Generator().manual_seed(3)
    values = {b: torch.rand(6, 5, generator=gen, dtype=F64) for b in ("q", "k")}
    values["q"][values["q"] < 0.3] = math.nan
    types = torch.randint(0, 3, (6, 5), generator=gen)
    whole = TokenTypeTable.from_values(values, types, NAMES)
    parts = [
        TokenTypeTable.from_values({b: v[rows] for b, v in values.items()}, types[rows], NAMES)
        for rows in (slice(0, 2), slice(2, 6))
    ]
    pooled = TokenTypeTable.pool(parts)
    assert not whole.mean.isnan().any()
    torch.testing.assert_close(pooled.mean, whole.mean)
    torch.testing.assert_close(pooled.share, whole.share)
    assert pooled.branch_counts.tolist() == whole.branch_counts.tolist()


def test_empty_type_names_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one token type name"):
        TokenTypeTable.from_values({"a": torch.ones(1, 2)}, [[-1, -1]], [])


def test_a_padding_token_no_branch_reaches_is_left_out() -> None:
    """The last token is masked out of attention and the output read is token 0's: no branch
    reaches it, so it counts in no type, whatever its label."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertModel._from_config(tiny_bert_config(), attn_implementation="eager")
    model = model.double().eval()
    ids = torch.tensor([[3, 5, 3, 2, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    with semipack.extend(model, semipack.MaxProd()):
        with semipack.branches(model.encoder.layer[0].attention) as split:
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out[:, 0].sum().backward()
    types = torch.tensor([[0, 2, 1, 2, 2]])
    table = TokenTypeTable.from_branches(split, types, NAMES, short=attention_branch)
    assert table.counts.tolist() == [1, 1, 2]
    kept = TokenTypeTable.from_branches(
        split, torch.tensor([[0, 2, 1, 2, -1]]), NAMES, short=attention_branch
    )
    torch.testing.assert_close(table.mean, kept.mean)
    torch.testing.assert_close(table.share, kept.share)


def test_the_printout_keeps_small_means_readable() -> None:
    """A MaxProd mean of 7e-05 printed as 0.000 beside its 100% share (trial 76)."""
    values = {"query": torch.tensor([7e-5, 7e-5]), "key": torch.tensor([1e-6, 2e-6])}
    table = TokenTypeTable.from_values(values, torch.tensor([0, 0]), ["word"])
    mean_row = str(table).splitlines()[1]
    assert "7e-05" in mean_row and "1.5e-06" in mean_row


def test_projections_of_other_names_are_not_read_as_the_residual() -> None:
    """``attention_branch`` read every name it did not know as the residual: a block's
    ``to_q``, ``to_k`` and ``to_v`` were joined with its residual add into one column, 100%
    (trial 84, Funnel's ``q_head``). Linear uses keep their module's name; and a mean of nine
    characters ran into the token count, and Markdown rounded small means to 0.000."""
    torch.manual_seed(0)

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.to_q, self.to_k, self.to_v, self.out = (torch.nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            scores = self.to_q(x) @ self.to_k(x).transpose(-1, -2)
            return x + self.out(torch.softmax(scores, -1) @ self.to_v(x))

    block = Attention().double()
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8).double(), block)
    ids = torch.randint(0, 20, (1, 6))
    with semipack.extend(model, semipack.MaxProd()):
        with semipack.branches(block) as split:
            out = model(ids)
        out[0, 0].sum().backward()
    table = semipack.TokenTypeTable.from_branches(
        split, torch.zeros(1, 6, dtype=torch.long), ["all"], short=attention_branch
    )
    assert table.branch_names == ("to_q", "to_k", "to_v", "residual")
    assert attention_branch("layer.0.attention.self.query") == "query"
    # a second call of a projection, and nn.MultiheadAttention(batch_first=True)'s one
    # transpose of its input for the three projections (trial 86: a column of its own, and
    # the residual)
    assert attention_branch("attn.q_proj#2", "linear") == "query"
    assert attention_branch("layer.self_attn", "transpose") == "qkv"
    small = semipack.TokenTypeTable.from_values(
        {"query": torch.tensor([[4.342e-07]]), "value": torch.tensor([[0.5]])},
        torch.tensor([[0]]),
        ["A"],
    )
    assert str(small).splitlines()[1].split() == ["mean", "A", "1", "4.342e-07", "0.5"]
    assert "| A | 1 | 4.342e-07 (0%) | 0.5 (100%) |" in small.to_markdown()
