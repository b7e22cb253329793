"""Branch values averaged by token type: the table and bar chart of the paper's synthetic task.

``semipack.branches`` gives, for every example and token, one value per branch (the query, key,
value and residual uses of an attention block's input, say). A question about a *kind* of
token ("the first token", "its repeat", "the other tokens") needs those numbers pooled over
every token of that kind in every example: the mean value of each branch (the paper's bar
chart plots the mean best-path value, MaxProd) and the share of the tokens whose largest value
is in each branch (which branch their best path leaves by). ``TokenTypeTable`` holds both,
computed with one matrix product over all tokens at once (no loop over examples or tokens).

Shapes: the per-branch values and the type labels are ``[examples, tokens]`` (any shape, as
long as all of them agree); ``mean`` and ``share`` are ``[types, branches]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .branches import Branches

#: Published values: token type -> branch -> number (missing entries are not drawn).
Reference = Mapping[str, Mapping[str, float]]


#: The last part of a projection's module name -> its branch (BERT, Llama, DistilBERT, T5,
#: DeBERTa-v2; GPT-2's ``c_attn`` and DeBERTa's (v1) ``in_proj`` make query, key and value in
#: one call: one branch, ``qkv``).
PROJECTIONS = {
    "query": "query", "key": "key", "value": "value",
    "q_proj": "query", "k_proj": "key", "v_proj": "value",
    "q": "query", "k": "key", "v": "value",
    "q_lin": "query", "k_lin": "key", "v_lin": "value",
    "query_proj": "query", "key_proj": "key", "value_proj": "value",
    "c_attn": "qkv", "in_proj": "qkv", "query_key_value": "qkv",
}  # fmt: skip


def attention_branch(name: str, op: str | None = None) -> str:
    """The short name of an attention block's branch: ``query``, ``key`` or ``value`` for a
    name ending with that projection (``...self.query``, ``...q_proj``, ``...q``), ``qkv``
    for GPT-2's fused ``...c_attn`` and DeBERTa's (v1) ``...in_proj``, the module's own name
    for another linear map (``op``, the call that made the use, ``Branches.ops``: a Funnel's
    ``q_head``, a ``to_q``; trial 84 found them read as the residual, and joined with it), and
    ``residual`` for any other use (in BERT the only other use of the block's input is the
    residual add in ``...attention.output``)."""
    last = name.rsplit(".", 1)[-1]
    if ":" in last:  # one call given the tensor as several arguments (multi-head attention)
        return PROJECTIONS.get(last.rsplit(":", 1)[-1].split("#")[0], "residual")
    last = last.split("#")[0]  # a second call of one projection: the same branch (trial 86)
    if last in PROJECTIONS:
        return PROJECTIONS[last]
    if op == "transpose" and last == "self_attn":  # nn.MultiheadAttention(batch_first=True)
        return "qkv"  # turns its input sequence-first once, for its three projections
    return last if op in _LINEAR_CALLS else "residual"


#: ``Branches.ops`` of a use by a linear map (a projection of its own, not a residual).
_LINEAR_CALLS = frozenset(("linear", "matmul", "__matmul__", "addmm", "mm", "conv1d"))


@dataclass(frozen=True)
class TokenTypeTable:
    """Per token type and branch: the mean branch value and the share of tokens it wins.

    Attributes:
        type_names: the token types, in label order (label ``i`` is ``type_names[i]``).
        branch_names: the branches, in the order of the values given.
        mean: ``[types, branches]`` float64, the mean over every token of that type of the
            branch's value (MaxProd: the mean best-path value through that branch); a NaN value
            (no value: Entropy where no path is) is left out of its branch's mean; NaN where no
            token of the type has a value for the branch.
        share: ``[types, branches]`` float64, the share of the tokens of that type whose largest
            value is that branch's (MaxProd: whose best path leaves by it); a tie splits the
            token evenly between the tied branches, so every row sums to 1 (NaN for a type with
            no token).
        counts: ``[types]`` int64, how many tokens each type has (with at least one value).
        branch_counts: ``[types, branches]`` int64, how many of them have a value (not NaN)
            for each branch: the weights of ``mean`` when tables are pooled (None: ``counts``).
    """

    type_names: tuple[str, ...]
    branch_names: tuple[str, ...]
    mean: Tensor
    share: Tensor
    counts: Tensor
    branch_counts: Tensor | None = None

    @classmethod
    def from_values(
        cls,
        values: Mapping[str, Tensor],
        types: Tensor | Sequence[Any],
        type_names: Sequence[str],
    ) -> TokenTypeTable:
        """Build the table from one value per branch and token.

        Args:
            values: branch name -> ``[examples, tokens]`` values (any shape, the same for every
                branch), higher meaning more (MaxProd's best-path value, LogSum's log flow);
                NaN for no value (left out of that branch's mean, never a token's best).
            types: integer labels shaped like the values (a tensor or nested lists); label
                ``i`` is ``type_names[i]``, a negative label leaves that token out (padding,
                say), and so does a token whose every value is NaN.
            type_names: one name per label (at least one).
        """
        if not values:
            raise ValueError("TokenTypeTable needs the values of at least one branch")
        if len(type_names) == 0:
            raise ValueError("TokenTypeTable needs at least one token type name (type_names)")
        types = torch.as_tensor(types)
        if types.dtype.is_floating_point or types.dtype.is_complex or types.dtype == torch.bool:
            raise TypeError(f"token types must be integer labels, got {types.dtype}")
        for name, value in values.items():
            if not isinstance(value, Tensor) or value.shape != types.shape:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"branch {name!r} has values of shape {shape}, the token types "
                    f"{tuple(types.shape)}: give one value per token"
                )
        labels = types.reshape(-1).long()
        if labels.numel() and int(labels.max()) >= len(type_names):
            raise ValueError(
                f"token type label {int(labels.max())} has no name ({len(type_names)} given)"
            )
        # [tokens, branches]: every token's values, one column per branch
        table = torch.stack([v.detach().reshape(-1).double() for v in values.values()], -1)
        labels = labels.to(table.device)
        valued = ~table.isnan()
        kept = (labels >= 0) & valued.any(-1)
        table, valued, labels = table[kept], valued[kept], labels[kept]
        # [tokens, branches]: the token's best branch (a tie shares the token between branches)
        best = _best(table, valued).double()
        credit = best / best.sum(-1, keepdim=True)
        # pooled by type with index_add (a one-hot product would spread -inf as NaN)
        branch_counts = _by_type(valued.double(), labels, len(type_names))
        counts = _by_type(torch.ones_like(labels, dtype=torch.float64)[:, None], labels,
                          len(type_names))[:, 0]  # fmt: skip
        return cls(
            type_names=tuple(type_names),
            branch_names=tuple(values),
            mean=_by_type(table.masked_fill(~valued, 0.0), labels, len(type_names)) / branch_counts,
            share=_by_type(credit, labels, len(type_names)) / counts[:, None],
            counts=counts.long(),
            branch_counts=branch_counts.long(),
        )

    @classmethod
    def from_branches(
        cls,
        split: Branches,
        types: Tensor | Sequence[Any],
        type_names: Sequence[str],
        short: Callable[[str], str] | None = None,
        dims: int | Sequence[int] = -1,
    ) -> TokenTypeTable:
        """Build the table from a split after its backward.

        Each token's value per branch is the semiring sum over ``dims`` of the split tensor
        (``-1``: every hidden unit of a ``[examples, tokens, hidden]`` tensor; MaxProd: the
        token's best path through that branch), as ``Branches.aggregate`` reads it. ``short``
        renames branches (``attention_branch`` gives query / key / value / residual); branches
        that get the same short name are joined by the semiring's plus (all their paths). A
        branch no path reached holds the semiring's "no path" value (MaxProd's 0 counts in its
        mean; Entropy's NaN does not); a token no branch reaches (padding masked out of
        attention, say) is left out, like a negative label. ``types`` (a tensor or nested
        lists) is shaped like the split tensor without ``dims``.
        """
        if not split.messages:
            raise ValueError("the split has no branch values: run the backward first")
        if short is attention_branch:  # it reads the call that made each use too
            rename = lambda name: attention_branch(name, split.ops.get(name))  # noqa: E731
        else:
            rename = short or (lambda name: name)
        first = next(iter(split.messages.values()))
        sr = first.semiring
        joined: dict[str, Any] = {}
        for name in split.names:
            key = rename(name)
            message = split.messages.get(name)
            if message is None:  # no path left by this use
                state = sr.zeros(first.shape, first.dtype, first.device)
            else:
                state = message.parts
            joined[key] = state if key not in joined else sr.plus(joined[key], state)
        rank = first.dim()
        reduce = sorted(d % rank for d in ([dims] if isinstance(dims, int) else dims))
        values, reached = {}, None
        for key, state in joined.items():
            summed = sr.sum(state, reduce)
            value = sr.readout(summed)
            if not isinstance(value, Tensor):
                raise ValueError(
                    f"{type(sr).__name__} reads out {type(value).__name__}, not one number per "
                    "token: a token-type table takes MaxProd, TopPath, LogSum, LogCount or Entropy"
                )
            values[key] = value.detach()
            some = ~sr.is_zero(summed)
            reached = some if reached is None else reached | some
        types = torch.as_tensor(types)
        if reached is not None and reached.shape == types.shape:  # else from_values says so
            types = types.masked_fill(~reached.to(types.device), -1)  # no path: left out
        return cls.from_values(values, types, type_names)

    @classmethod
    def pool(cls, tables: Sequence[TokenTypeTable]) -> TokenTypeTable:
        """One table over the tokens of all ``tables`` (batches of examples, or runs with
        different seeds): each entry is the token-weighted mean of theirs, exactly the table of
        their tokens taken together. The tables must have the same types and branches."""
        if not tables:
            raise ValueError("TokenTypeTable.pool needs at least one table")
        names = {(t.type_names, t.branch_names) for t in tables}
        if len(names) > 1:
            raise ValueError(f"tables with different token types or branches: {sorted(names)}")
        counts = torch.stack([t.counts for t in tables]).double()[..., None]  # [tables, types, 1]
        valued = torch.stack([_branch_counts(t) for t in tables]).double()  # [.., branches]

        def weighted(grids: list[Tensor], weights: Tensor) -> Tensor:
            # an entry no token gave (NaN there) adds nothing
            stacked = torch.stack(grids).double()  # [tables, types, branches]
            stacked = torch.where(weights > 0, stacked, 0.0)
            return (weights * stacked).sum(0) / weights.sum(0)

        return cls(
            type_names=tables[0].type_names,
            branch_names=tables[0].branch_names,
            mean=weighted([t.mean for t in tables], valued),
            share=weighted([t.share for t in tables], counts),
            counts=counts.sum(0)[:, 0].long(),
            branch_counts=valued.sum(0).long(),
        )

    def __str__(self) -> str:
        # means with 4 significant digits: a MaxProd mean of 7e-05 read 0.000 beside its 100%
        # share (trial 76); each column one wider than its longest cell ("4.342e-07" is nine
        # characters: it ran into the token count, trial 84)
        grids = (("mean", self.mean, "{:.4g}"), ("share", self.share, "{:.1%}"))
        texts = [[fmt.format(v) for v in grid.reshape(-1).tolist()] for _, grid, fmt in grids]
        width = max(8, *(len(b) + 1 for b in self.branch_names), *(len(t) + 1 for t in texts[0]))
        label = max(len(t) for t in self.type_names)
        head = f"{'':6}{'':{label}} {'tokens':>7}" + "".join(
            f"{b:>{width}}" for b in self.branch_names
        )
        lines = [head]
        for what, grid, fmt in grids:
            for i, type_name in enumerate(self.type_names):
                cells = "".join(f"{fmt.format(v):>{width}}" for v in grid[i].tolist())
                first = what if i == 0 else ""
                lines.append(f"{first:6}{type_name:{label}} {int(self.counts[i]):>7}{cells}")
        return "\n".join(lines)

    def to_markdown(self, reference: Reference | None = None) -> str:
        """A Markdown table: one row per token type, one column per branch, each cell the mean
        value and (in brackets) the share of the type's tokens whose best branch it is; with
        ``reference``, the published value follows as ``paper x``."""
        head = "| token type | tokens | " + " | ".join(self.branch_names) + " |"
        lines = [head, "|---|---:|" + "---:|" * len(self.branch_names)]
        for i, type_name in enumerate(self.type_names):
            cells = []
            for j, branch in enumerate(self.branch_names):
                cell = f"{float(self.mean[i, j]):.4g} ({float(self.share[i, j]):.0%})"
                ref = (reference or {}).get(type_name, {}).get(branch)
                if ref is not None:
                    cell += f", paper {ref:.2f}"
                cells.append(cell)
            lines.append(f"| {type_name} | {int(self.counts[i])} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def bar_chart(
        self,
        path: str | Path | None = None,
        ax: Any = None,
        reference: Reference | None = None,
        title: str | None = None,
        ylabel: str = "mean best-path value",
    ) -> Any:
        """Grouped bars of ``mean``: token types along x, one bar per branch (the paper's
        figure), the ``reference`` values marked as black ticks on their bars. Draws into ``ax``
        (a matplotlib Axes) or a new figure; writes it to ``path`` when given (PNG, PDF, ...
        by the suffix). Returns the figure."""
        from matplotlib.figure import Figure  # optional dependency: only the picture needs it

        if ax is None:
            fig = Figure(figsize=(1.4 + 1.3 * len(self.type_names), 3.2))
            ax = fig.subplots()
        else:
            fig = ax.figure
        groups = torch.arange(len(self.type_names), dtype=torch.float64)
        width = 0.8 / len(self.branch_names)
        marked = False
        for j, branch in enumerate(self.branch_names):
            centres = (groups - 0.4 + width * (j + 0.5)).tolist()
            ax.bar(centres, self.mean[:, j].tolist(), width=width, label=branch)
            for i, type_name in enumerate(self.type_names):
                ref = (reference or {}).get(type_name, {}).get(branch)
                if ref is None:
                    continue
                ax.plot(
                    [centres[i] - width / 2, centres[i] + width / 2], [ref, ref], color="black",
                    linewidth=2, label=None if marked else "published",
                )  # fmt: skip
                marked = True
        ax.set_xticks(groups.tolist(), list(self.type_names))
        ax.set_ylabel(ylabel)
        if title:
            ax.set_title(title)
        ax.legend(fontsize=8)
        if path is not None:
            fig.tight_layout()
            fig.savefig(path, dpi=120, bbox_inches="tight")
        return fig


def _best(table: Tensor, valued: Tensor) -> Tensor:
    """``[tokens, branches]`` bool: the branches holding each token's largest value (several
    on a tie), among its values that are not NaN."""
    masked = table.masked_fill(~valued, -math.inf)
    return (masked == masked.amax(-1, keepdim=True)) & valued


def _by_type(rows: Tensor, labels: Tensor, types: int) -> Tensor:
    """``[types, columns]``: the sum of ``rows [tokens, columns]`` over each type's tokens."""
    out = torch.zeros(types, rows.shape[-1], dtype=rows.dtype, device=rows.device)
    return out.index_add_(0, labels, rows)


def _branch_counts(table: TokenTypeTable) -> Tensor:
    """``[types, branches]``: the tokens behind each mean (``counts`` where not kept)."""
    if table.branch_counts is not None:
        return table.branch_counts
    return table.counts[:, None].expand(table.mean.shape)


__all__ = ["Reference", "TokenTypeTable", "attention_branch"]
