"""Layer-by-layer readouts of a transformer: branch flow, head flow and top paths per layer.

``explain_layers`` runs one semiring backward with a branch split (``semipack.branches``) at
every attention layer's input and at the input of its output projection (the heads' outputs
side by side), and keeps, per layer and token, the value of the paths through each branch
(query, key, value, residual) and through each head, each token's hidden units taken together
(the semiring sum over them: the union of their paths). The result, ``LayerFlow``, prints
per-layer tables and draws the branch shares and a tokens x layers heatmap.

``layer_routes`` follows single paths (``TopPath`` or ``KBest``) across the layers: at which
token each path enters and leaves every layer, by which branch and through which head.
``plot_routes`` draws them.

Shapes: ``[layers, batch, tokens]`` for the totals, ``[layers, batch, tokens, heads]`` for the
heads, ``[batch, tokens]`` for each layer's branch values.
"""

from __future__ import annotations

import csv
import math
import re
import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path as FilePath

import torch
from torch import Tensor, nn

from ..api import extend
from ..errors import ModuleHooksError, SemipackError
from ..graph.sites import ROOT_MODULE
from ..messages.paths import Path, PathStep
from ..semirings import Entropy, KBest, Product, Real, Semiring, SignedMaxProd
from .branches import ADDS, NO_GRAPH_CAUSES, Branches, branches
from .token_types import PROJECTIONS, attention_branch

BRANCH_ORDER = ("query", "key", "value", "residual")


@dataclass
class AttentionLayer:
    """Where one attention layer is split.

    Attributes:
        name: the attention block's module name (``encoder.layer.3.attention``).
        block: the module whose first tensor input is split by branch (its users: the
            query, key and value projections and, for BERT-family blocks, the residual add).
        heads_input: the module whose first tensor input holds the heads' outputs side by
            side, ``[batch, tokens, heads * head_dim]`` (the attention output projection); None
            where no module receives them (``nn.MultiheadAttention``): no per-head values.
        num_heads: the number of heads packed in ``heads_input``'s input.
        head_dim: the width of one head (of the query, key and value projections' outputs).
        batch_first: whether the layer's tensors are ``[batch, tokens, hidden]`` (else
            ``[tokens, batch, hidden]``: ``nn.MultiheadAttention(batch_first=False)``).
        found: whether ``attention_layers`` found the layer by its module names: its split is
            then checked to be drawn as those families' (``explain_layers`` refuses MobileBERT
            and ESM, whose names match), whoever passes it on (the CLI does).
    """

    name: str
    block: nn.Module
    heads_input: nn.Module | None
    num_heads: int
    head_dim: int
    batch_first: bool = True
    found: bool = field(default=False, compare=False)


#: The model families ``attention_layers`` finds by themselves (for messages).
FAMILIES = (
    "BERT-family encoders (BERT, RoBERTa, ELECTRA, MiniLM, DeBERTa: encoder.layer[i].attention), "
    "DistilBERT (transformer.layer[i].attention), Llama-family decoders (Llama, Mistral, Qwen2, "
    "Gemma, Cohere: layers[i].self_attn), Phi (layers[i].self_attn, its output projection "
    "named dense), OPT (decoder.layers[i].self_attn), GPT-2 and "
    "GPTBigCode (h[i].attn), GPT-NeoX and Pythia (layers[i].attention) and torch's "
    "nn.MultiheadAttention (nn.TransformerEncoderLayer)"
)


def attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """The attention layers of a Hugging Face BERT-family encoder (``encoder.layer[i]
    .attention``, split with its residual add), DistilBERT (``transformer.layer[i].attention``,
    the residual add in the layer), Llama-family decoder (``layers[i].self_attn``, split at the
    projections' common input, after the layer's norm: query, key and value only) or GPT-2
    (``h[i].attn``, after ``ln_1``: one fused ``qkv`` branch). Other models: build the
    ``AttentionLayer`` list by hand."""
    _check_model(model, "attention_layers")
    found = []
    for name, module in model.named_modules():
        self_part = getattr(module, "self", None)
        output = getattr(module, "output", None)
        heads = getattr(self_part, "num_attention_heads", None)
        if heads is not None and isinstance(getattr(output, "dense", None), nn.Linear):
            width = self_part.attention_head_size
            found.append(AttentionLayer(name, module, output, heads, width, found=True))
            continue
        o_proj = getattr(module, "o_proj", None)
        if not isinstance(o_proj, nn.Linear) and type(module).__name__ in _OUT_PROJ_ATTENTIONS:
            # OPT: q_proj, k_proj, v_proj, out_proj; Phi: q_proj, k_proj, v_proj, dense
            o_proj = getattr(module, _OUT_PROJ_ATTENTIONS[type(module).__name__], None)
        if isinstance(o_proj, nn.Linear) and hasattr(module, "q_proj"):
            heads = _head_count(name, module)
            width = getattr(module, "head_dim", None) or o_proj.in_features // heads
            found.append(AttentionLayer(name, module, o_proj, heads, int(width), found=True))
            continue
        if type(module).__name__ == "GPTNeoXAttention" and isinstance(
            getattr(module, "dense", None), nn.Linear
        ):  # GPT-NeoX (Pythia): one fused query_key_value, each head's q, k, v together
            heads = int(module.config.num_attention_heads)
            found.append(
                AttentionLayer(name, module, module.dense, heads, module.head_size, found=True)
            )
            continue
        c_proj = getattr(module, "c_proj", None)
        if _is_gpt2_attention(module) and c_proj is not None:
            heads, width = module.num_heads, module.head_dim
            found.append(AttentionLayer(name, module, c_proj, heads, width, found=True))
            continue
        if isinstance(module, nn.MultiheadAttention) and module._qkv_same_embed_dim:
            heads = module.num_heads
            found.append(
                AttentionLayer(
                    name, module, None, heads, module.head_dim, module.batch_first, found=True
                )
            )
            continue
        out_lin = getattr(module, "out_lin", None)
        if isinstance(out_lin, nn.Linear) and hasattr(module, "q_lin"):  # DistilBERT
            heads = int(module.n_heads)
            width = out_lin.in_features // heads
            found.append(AttentionLayer(name, module, out_lin, heads, width, found=True))
    if not found and any(n.endswith("albert_layer_groups") for n, _ in model.named_modules()):
        raise SemipackError(
            f"{type(model).__name__} runs one shared layer at every depth (ALBERT): a split "
            f"takes a module's first call only, so its layers cannot be told apart; semipack "
            f"knows {FAMILIES}"
        )
    if not found:
        raise SemipackError(
            f"no attention layers found in {type(model).__name__}: semipack knows {FAMILIES}; "
            "pass layers=[AttentionLayer(...), ...] for others"
        )
    return found


def _head_count(name: str, module: nn.Module) -> int:
    """The number of heads of a ``q_proj``/``o_proj`` attention module: its own attribute
    first (Swin's stages differ, and its config holds a list), else its config's."""
    for heads in (_stated_heads(module), _stated_heads(getattr(module, "config", None))):
        if heads is not None:
            return heads
    raise SemipackError(
        f"attention module '{name}' ({type(module).__name__}) names no number of heads that "
        f"semipack can read; pass layers=[AttentionLayer(...), ...]"
    )


def _fused_layout(block: nn.Module) -> str:
    """How a fused ``c_attn`` packs query, key and value: ``side by side`` (GPT-2 and its
    copies: ``[q | k | v]``), ``per head`` (GPTBigCode: ``[q_h k_h v_h]`` for each head) or
    ``multi-query`` (GPTBigCode with one key and value head: ``[q | k_0 | v_0]``)."""
    if type(block).__name__ == "GPTBigCodeAttention":
        return "multi-query" if getattr(block, "multi_query", False) else "per head"
    return "side by side"


#: Decoder self-attention modules with ``q_proj``, ``k_proj``, ``v_proj`` and an output
#: projection of another name than ``o_proj``, by class name: its attribute (OPT's
#: ``out_proj``, Phi's ``dense``). An encoder-decoder's modules of that shape (BART, Whisper)
#: also attend to the encoder, which the layer list does not read: not listed.
_OUT_PROJ_ATTENTIONS = {"OPTAttention": "out_proj", "PhiAttention": "dense"}


#: The attention modules whose fused ``c_attn`` semipack reads (``_fused_layout``).
_FUSED_QKV_ATTENTIONS = frozenset(
    (
        "GPT2Attention",
        "ImageGPTAttention",
        "DecisionTransformerGPT2Attention",
        "GPTBigCodeAttention",
    )
)


def _is_gpt2_attention(module: nn.Module) -> bool:
    """GPT-2's self-attention: one fused ``c_attn`` makes query, key and value side by side
    (``[batch, tokens, 3 * hidden]``), ``c_proj`` projects the heads' outputs."""
    return (
        type(module).__name__ in _FUSED_QKV_ATTENTIONS
        and isinstance(getattr(module, "c_attn", None), nn.Module)
        and isinstance(getattr(module, "num_heads", None), int)
        and isinstance(getattr(module, "head_dim", None), int)
        and not getattr(module, "is_cross_attention", False)
    )


def branch_name(consumer: str, layer: str, op: str | None = None, from_input: bool = True) -> str:
    """Short name of a consumer of an attention layer's input: query, key or value for the
    projections (``attention_branch``), residual for BERT's attention output or a module
    enclosing the layer (where the residual add is), else its module name relative to the
    layer, or to the module holding the layer (Phi's MLP beside its attention: ``mlp.fc1`` in
    every layer, one column of a table). A use by the layer's own forward is named by its
    call ``op`` (``Branches.ops``): ``residual`` for an add of a value computed from the input
    (``from_input``: ``x + f(x)``), ``add`` for one of a value from elsewhere (DETR's
    ``h + position``, ``Branches.offsets``), else the call's name (``linear`` for a projection
    the forward makes with ``F.linear``); without ``op`` (an ``nn.MultiheadAttention``, whose
    own call takes query, key and value at once), ``qkv``."""
    short = attention_branch(consumer)
    if short != "residual":
        return short
    if consumer.split("#")[0] == layer:  # the block's own forward
        if op in ADDS:
            return "residual" if from_input else "add"
        return "qkv" if op is None else op
    if layer.startswith(consumer + ".") or consumer == ROOT_MODULE:
        return "residual"  # the enclosing layer adds it back (DistilBERT, a bare encoder layer)
    parent = layer.rpartition(".")[0]
    if consumer.startswith(layer + "."):
        relative = consumer[len(layer) + 1 :]
    elif parent and consumer.startswith(parent + "."):
        relative = consumer[len(parent) + 1 :]
    else:
        relative = consumer
    return "residual" if relative == "output" else relative


@dataclass
class LayerFlow:
    """One semiring's readouts at every attention layer's input, per token.

    Attributes:
        semiring: the semiring's class name (``MaxProd``, ``LogSum``, ``Entropy``, ...).
        layers: the attention layers' module names.
        branches: per layer, branch name -> ``[batch, tokens]``: the paths that leave the
            layer's input by that branch (every hidden unit of the token together).
        total: ``[layers, batch, tokens]``: every path to the layer's input at that token.
        heads: ``[layers, batch, tokens, heads]``: every path through each head's output at that
            token (the attention output projection's input).
        tokens: the tokens' labels (for tables, rows and pictures): one list for every example,
            or one list per example of the batch; None: the token indexes.
        no_path: the readout of "no path" (the semiring zero: 0, ``-inf`` for logs, NaN for
            Entropy); by default the one of ``semiring``'s defaults. A token holding it is not
            reached: shares, best branches and means leave it out.
        log: whether the values are logarithms (LogSum's and LogCount's default; ``False``
            after ``LogSum(log=False)``); by default from ``semiring``.
    """

    semiring: str
    layers: list[str]
    branches: list[dict[str, Tensor]]
    total: Tensor
    heads: Tensor
    tokens: list[str] | list[list[str]] | None = None
    no_path: float | None = None
    log: bool | None = None

    def __post_init__(self) -> None:
        if self.tokens is not None:
            self._check_tokens()
        if self.no_path is None:
            self.no_path = DEFAULT_NO_PATH.get(self.semiring, 0.0)
        if self.log is None:
            self.log = self.semiring in ("LogSum", "LogCount")

    def reached(self, values: Tensor) -> Tensor:
        """Where ``values`` (any shape) hold at least one path, i.e. not ``no_path``. A value
        that underflows to the no-path readout (MaxProd's linear 0) reads as unreached: use
        ``MaxProd(log=True)`` where products are that small."""
        if math.isnan(self.no_path):
            return ~values.isnan()
        return values != self.no_path

    def _check_tokens(self) -> None:
        """Refuse labels that do not match the tokens: one list of one label per token, or one
        such list per example (a list for the first example alone labelled every example's
        rows with its words)."""
        length, batch = self.total.shape[-1], self.total.shape[1]
        if any(not isinstance(t, (str, list, tuple)) for t in self.tokens):
            odd = next(t for t in self.tokens if not isinstance(t, (str, list, tuple)))
            raise SemipackError(
                f"tokens: labels must be strings (one list per sentence, or one list per "
                f"example), got {type(odd).__name__} {odd!r}: pass the tokenizer's tokens "
                "(tokenizer.convert_ids_to_tokens(ids)), not the ids"
            )
        lists = [self.tokens] if _one_sentence(self.tokens) else list(self.tokens)
        if not _one_sentence(self.tokens) and len(lists) != batch:
            raise SemipackError(
                f"tokens: {len(lists)} label lists for {batch} examples (one list for every "
                "example, or one per example of the batch)"
            )
        for labels in lists:
            if len(labels) != length:
                raise SemipackError(
                    f"tokens: {len(labels)} labels for {length} tokens (one label per token of "
                    "the layers' inputs, special tokens included)"
                )

    def _labels(self, example: int) -> list[str]:
        """The token labels of ``example``."""
        labels = _tokens_of(self.tokens, example)
        return list(labels) if labels else [str(t) for t in range(self.total.shape[-1])]

    def _stacked(self, layer: dict[str, Tensor], example: int) -> tuple[list[str], Tensor]:
        """The branch names and their values ``[branches, tokens]`` for one example."""
        names = list(layer)
        return names, torch.stack([layer[n][example] for n in names])

    def _example(self, example: int) -> None:
        """Refuse an example index the flow does not hold (``total`` is [layers, batch, ...])."""
        batch = self.total.shape[1]
        integer = isinstance(example, int) and not isinstance(example, bool)
        if not integer or not -batch <= example < batch:
            raise SemipackError(f"example {example!r}: the flow holds {batch} example(s)")

    def _needs(self, kinds: tuple[str, ...], what: str) -> None:
        if self.semiring not in kinds:
            raise SemipackError(f"{what} needs {' or '.join(kinds)}, not {self.semiring}")

    def best_branch(self, example: int = 0) -> list[list[str]]:
        """``[tokens][layers]``: the branch of each token's best path (MaxProd, TopPath);
        tied branches joined by ``/`` (``key/value``), ``-`` where no path reaches the token."""
        self._example(example)
        self._needs(("MaxProd", "TopPath"), "best_branch")
        columns = []
        for layer in self.branches:
            if not layer:  # no path reaches the layer
                columns.append(["-"] * self.total.shape[-1])
                continue
            names, values = self._stacked(layer, example)
            best = _winners(values, self.reached(values))  # [branches, tokens]
            columns.append(
                ["/".join(n for n, w in zip(names, col, strict=True) if w) or "-"
                 for col in best.T.tolist()]
            )  # fmt: skip
        return [list(row) for row in zip(*columns, strict=True)]

    def branch_shares(self, example: int = 0) -> list[dict[str, float]]:
        """Per layer, branch -> share: of the reached tokens whose best path leaves by it
        (MaxProd, TopPath; a tie splits the token equally between the tied branches), or of
        the total flow over all tokens (LogSum). NaN where no path reaches the layer."""
        self._example(example)
        self._needs(("MaxProd", "TopPath", "LogSum"), "branch_shares")
        shares = []
        for layer in self.branches:
            if not layer:  # no path reaches the layer: no branch to share
                shares.append({})
                continue
            names, values = self._stacked(layer, example)
            shares.append(dict(zip(names, self._shares(values), strict=True)))
        return shares

    def head_shares(self, example: int = 0) -> list[list[float]]:
        """Per layer, per head: the share of reached tokens whose best path runs through that
        head's output (MaxProd, TopPath; ties split), or of the total flow through all heads
        (LogSum). NaN where no path reaches the layer."""
        self._example(example)
        self._needs(("MaxProd", "TopPath", "LogSum"), "head_shares")
        if self.heads.shape[-1] == 0:  # no per-head values (nn.MultiheadAttention)
            return [[] for _ in self.heads]
        return [self._shares(h[example].T) for h in self.heads]

    def _shares(self, values: Tensor) -> list[float]:
        """``values`` [choices, tokens]: each choice's share of the reached tokens' best paths,
        ties split (MaxProd), or of the flow summed over tokens (LogSum, log or linear)."""
        reached = self.reached(values)
        values = values.double()
        if self.semiring == "LogSum":
            if self.log:
                flow = values.masked_fill(~reached, -math.inf).logsumexp(1)
                return (flow - flow.logsumexp(0)).exp().tolist()
            flow = values.masked_fill(~reached, 0.0).sum(1)
            return (flow / flow.sum()).tolist()
        best = _winners(values, reached).double()  # [choices, tokens]
        credit = best / best.sum(0).clamp(min=1)  # a tie splits the token
        tokens = reached.any(0).sum()  # tokens that some choice reaches
        return (credit.sum(1) / tokens).tolist()

    @property
    def labels(self) -> list[str]:
        """The layers' short labels (``layer_labels``: ``L2`` for ``encoder.layer.2...``)."""
        return layer_labels(self.layers)

    def table(self, example: int = 0) -> str:
        """Per-layer summary: the branch shares and head shares (MaxProd, LogSum), or the mean
        over tokens of each branch's value (other semirings)."""
        self._example(example)
        names = [b for b in BRANCH_ORDER if any(b in layer for layer in self.branches)]
        names += sorted({n for layer in self.branches for n in layer} - set(names))
        shares = self.semiring in ("MaxProd", "TopPath", "LogSum")
        heads = self.heads.shape[-1]
        best = "share of tokens whose best path leaves by each branch" + (
            " / per head: of tokens at whose attention output the head carries the best path"
            if heads
            else ""
        )
        flow = "share of the flow per branch" + (" / head" if heads else "")
        what = {"MaxProd": best, "TopPath": best, "LogSum": flow}
        what = what.get(self.semiring, f"mean over tokens of each branch's {self.semiring} value")
        widths = [max(10, len(n) + 2) for n in names]
        layer_names = self.labels
        column = max(6, *(len(label) + 1 for label in layer_names))
        header = f"{'layer':<{column}}" + "".join(
            f"{n:>{w}}" for n, w in zip(names, widths, strict=True)
        )
        if shares and heads:
            header += "  " + "".join(f"{'head ' + str(h):>8}" for h in range(heads))
        lines = [f"{self.semiring}: {what}{self._which(example)}", header]
        per_branch = self.branch_shares(example) if shares else None
        per_head = self.head_shares(example) if shares else None
        for i, layer in enumerate(self.branches):
            if per_branch is not None:
                # "-": a branch the layer does not have (a cross-attention's key and value
                # come from the encoder), or a layer no path reaches
                cells = [per_branch[i].get(n, math.nan) for n in names]
                row = "".join(f"{_cell(v, '.1%'):>{w}}" for v, w in zip(cells, widths, strict=True))
                if heads:
                    row += "  " + "".join(f"{_cell(v, '.1%'):>8}" for v in per_head[i])
            else:
                cells = [self._mean(layer[n][example]) if n in layer else math.nan for n in names]
                row = "".join(f"{_cell(v, '.3f'):>{w}}" for v, w in zip(cells, widths, strict=True))
            lines.append(f"{layer_names[i]:<{column}}" + row)
        return "\n".join(lines)

    def _mean(self, values: Tensor) -> float:
        """The mean over the reached tokens (NaN where none is reached)."""
        kept = values[self.reached(values)]
        return float(kept.double().mean()) if kept.numel() else math.nan

    def _which(self, example: int) -> str:
        """`` (example i of N)`` for a batch of several examples, else nothing."""
        batch = self.total.shape[1]  # a negative index counts from the end (trial 118)
        return f" (example {example % batch} of {batch}, from 0)" if batch > 1 else ""

    def token_table(self, example: int = 0) -> str:
        """Per token and layer: the branch of its best path (MaxProd, TopPath) or the value of
        every path to it (other semirings)."""
        self._example(example)
        labels = self._labels(example)
        best = self.best_branch(example) if self.semiring in ("MaxProd", "TopPath") else None
        width = max([10, *(len(b) + 1 for row in best or [] for b in row)])
        layers = self.labels
        width = max(width, *(len(n) + 1 for n in layers))
        column = max([12, *(len(t) for t in labels)])  # long tokens keep the rows aligned
        header = f"{'token':>{column}} " + " ".join(f"{n:<{width}}" for n in layers)
        lines = (
            [f"{self.semiring}: per token{self._which(example)}"] if self._which(example) else []
        )
        lines.append(header)
        if best is not None:
            for token, row in zip(labels, best, strict=True):
                lines.append(f"{token:>{column}} " + " ".join(f"{b:<{width}}" for b in row))
        else:
            grid = self._masked_total(example).tolist()  # [tokens, layers]
            for token, row in zip(labels, grid, strict=True):
                cells = " ".join(f"{_cell(v, '.3f'):<{width}}" for v in row)
                lines.append(f"{token:>{column}} " + cells)
        return "\n".join(lines)

    def _masked_total(self, example: int) -> Tensor:
        """``[tokens, layers]`` float64 totals, NaN where no path reaches the token."""
        grid = self.total[:, example].T
        return grid.double().masked_fill(~self.reached(grid), math.nan)

    def rows(self, example: int | None = None) -> list[tuple[str, str, str, int, int, str, float]]:
        """(semiring, layer label, branch, example, token index, token, value) for every branch,
        ``all`` (every path) and ``head h``: the CSV's rows, of every example of the batch (or
        of ``example`` alone; it was example 0 alone, unlabelled, before)."""
        batch = self.total.shape[1]
        if example is not None:
            self._example(example)
        examples = range(batch) if example is None else [example % batch]
        out = []
        for e in examples:
            labels = self._labels(e)
            for i, layer in enumerate(self.branches):
                columns = {n: v[e] for n, v in layer.items()} | {"all": self.total[i, e]}
                for h in range(self.heads.shape[-1]):
                    columns[f"head {h}"] = self.heads[i, e, :, h]
                for name, values in columns.items():
                    for t, v in enumerate(values.tolist()):
                        out.append((self.semiring, self.labels[i], name, e, t, labels[t], v))
        return out

    def plot_branch_shares(self, path: str | FilePath | None = None, ax=None, example: int = 0):
        """Stacked bars per layer: ``branch_shares`` (MaxProd: of tokens, LogSum: of flow).
        Saves to ``path`` when given; returns the matplotlib axes."""
        self._example(example)
        plt = _pyplot()
        shares = self.branch_shares(example)
        names = [b for b in BRANCH_ORDER if any(b in s for s in shares)]
        names += sorted({n for s in shares for n in s} - set(names))
        fig, ax = _figure(plt, ax, (6, 3.2))
        bottom = [0.0] * len(shares)
        for name in names:
            heights = [0.0 if math.isnan(v) else v for v in (s.get(name, 0.0) for s in shares)]
            ax.bar(range(len(shares)), heights, bottom=bottom, label=name)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_xticks(range(len(shares)), self.labels)
        of = "tokens" if self.semiring != "LogSum" else "total flow"
        ax.set_ylabel(f"share of {of}")
        kind = "best path" if self.semiring != "LogSum" else "flow"
        ax.set_title(f"branch of each token's {kind} at each layer's input ({self.semiring})")
        ax.legend(loc="upper right", fontsize=8)
        return _save(plt, fig, path, ax)

    def plot_heatmap(self, path: str | FilePath | None = None, ax=None, example: int = 0):
        """Tokens x layers: every path to the layer's input at that token (``total``)."""
        self._example(example)
        plt = _pyplot()
        labels = self._labels(example)
        grid = self._masked_total(example).cpu().numpy()  # [tokens, layers], NaN: no path
        size = (1.6 + 0.6 * len(self.layers), 0.9 + 0.3 * len(labels))
        fig, ax = _figure(plt, ax, size)
        image = ax.imshow(grid, aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(self.layers)), self.labels)
        ax.set_yticks(range(len(labels)), labels)
        flow = "log total flow" if self.log else "total flow"
        what = {"Entropy": "path entropy (nats)", "LogSum": flow}
        ax.set_title(f"{what.get(self.semiring, self.semiring)} at each layer's input")
        ax.figure.colorbar(image, ax=ax)
        return _save(plt, fig, path, ax)


#: The readout of "no path" of a semiring's default options, by name (``LayerFlow.no_path``).
#: Real's 0 may be signed paths that cancel: NaN, which no value equals, so every token counts.
DEFAULT_NO_PATH = {
    "LogSum": -math.inf, "LogCount": -math.inf, "Entropy": math.nan, "Real": math.nan,
}  # fmt: skip


def _winners(values: Tensor, reached: Tensor) -> Tensor:
    """``[choices, tokens]`` bool: the choices holding a token's largest value among those
    that reach it (several on a tie, none for a token no choice reaches)."""
    masked = values.double().masked_fill(~reached, -math.inf)
    return (masked == masked.amax(0, keepdim=True)) & reached


def _cell(value: float, fmt: str) -> str:
    """A table cell: ``-`` for no path (NaN), else ``value`` formatted."""
    return "-" if math.isnan(value) else format(value, fmt)


def explain_layers(
    model: nn.Module,
    semiring: Semiring,
    target: Callable[[], Tensor],
    layers: Sequence[AttentionLayer] | None = None,
    drawing: str = "atomic",
    tokens: list[str] | list[list[str]] | None = None,
) -> LayerFlow | tuple[LayerFlow, ...]:
    """One semiring backward of ``target()`` (a call that runs the model and returns the
    scalar to explain), split at every attention layer: see ``LayerFlow``. ``tokens`` labels
    the tokens: one list for every example, or one list per example of the batch. A
    ``semipack.Product`` gives one ``LayerFlow`` per factor, in order, from the one backward.
    The regular gradient is not computed (the model's ``.grad`` is left alone)."""
    _check_model(model, "explain_layers")
    _check_semiring(semiring)
    if not callable(target):
        raise SemipackError(
            f"explain_layers: target must be a callable that runs the model and returns the "
            f"scalar to explain (lambda: model(ids).logits[0, 3]), got {type(target).__name__}: "
            "the forward has to run inside the split"
        )
    if not torch.is_grad_enabled():
        raise SemipackError(
            "explain_layers runs a backward: call it outside torch.no_grad() and "
            "torch.inference_mode()"
        )
    if _dropout_active(model):
        warnings.warn(
            f"explain_layers: {type(model).__name__} is in training mode (dropout draws a "
            "random mask per pass, so the values change from call to call): call model.eval()",
            stacklevel=2,
        )
    layers = list(layers) if layers is not None else attention_layers(model)
    _check_layers(layers)
    with extend(model, semiring, regular_grads=False, drawing=drawing), ExitStack() as stack:
        for module in _entries(model, layers):  # before the splits' hooks: they see the leaf
            hook = module.register_forward_pre_hook(_requiring_grad, with_kwargs=True)
            stack.callback(hook.remove)
        splits: list[Branches] = [stack.enter_context(branches(a.block)) for a in layers]
        contexts = [
            stack.enter_context(branches(a.heads_input)) if a.heads_input is not None else None
            for a in layers
        ]
        scalar = target()
        _check_called(layers, splits, contexts)
        _check_shapes(layers, contexts)
        # layers found by their module names: check they are drawn as those families'
        _check_splits(
            model,
            [a for a in layers if a.found],
            [s for a, s in zip(layers, splits, strict=True) if a.found],
        )
        stack.close()
        if not isinstance(scalar, Tensor) or scalar.numel() != 1:
            raise SemipackError("explain_layers: target() must return a scalar tensor")
        with warnings.catch_warnings():  # refused below, by name
            warnings.filterwarnings("ignore", "semipack.branches: .* used before the module")
            warnings.filterwarnings("ignore", "semipack.branches: .* the block does not see")
            try:
                scalar.backward()
            except ModuleHooksError as error:
                raise SemipackError(  # its advice named an extend argument this call has not
                    "explain_layers runs its pass without regular gradients, and modules with "
                    "full backward hooks or backward pre-hooks (BackPACK's extensions among "
                    "them) receive the regular gradient: run explain_layers on the model "
                    "without those hooks (before backpack.extend, or on a copy of it; trial 86)"
                ) from error
    _check_after_backward(layers, splits, contexts)
    factors = semiring.semirings if isinstance(semiring, Product) else (semiring,)
    flows = tuple(
        _flow(factor, layers, splits, contexts, tokens, i if len(factors) > 1 else None)
        for i, factor in enumerate(factors)
    )
    return flows if isinstance(semiring, Product) else flows[0]


#: Branches that carry the attention's projections, and those of the paths that reach the layer's
#: output without the attention weights (the value, or around the attention).
_PROJECTIONS = frozenset(("query", "key", "value", "qkv"))
_THROUGH = frozenset(("value", "qkv", "residual"))


def _short_name(name: str, spec: AttentionLayer, split: Branches) -> str:
    """``branch_name`` of a consumer of ``spec``'s split. An ``nn.MultiheadAttention``'s own
    call takes query, key and value at once (``qkv``), or only the query when the split tensor
    is its query argument alone (a cross-attention block)."""
    if not isinstance(spec.block, nn.MultiheadAttention):
        return branch_name(name, spec.name, split.ops.get(name), name not in split.offsets)
    short = branch_name(name, spec.name)
    only_query = split.arguments in ((0,), ("query",))
    return "query" if short == "qkv" and only_query else short


def _check_splits(
    model: nn.Module, layers: Sequence[AttentionLayer], splits: Sequence[Branches]
) -> None:
    """Refuse layers found by name whose split tensor is not the attention's input: it must
    feed a projection, and the value or the residual (the paths that keep a token's own
    flow). MobileBERT's attention takes its bottleneck's output, which feeds only the query and
    key (the value and the residual read the layer's input): its flow would hold a sliver of
    the paths. ESM normalises inside the block, after the split: no projection reads it."""
    for spec, split in zip(layers, splits, strict=True):
        short = {_short_name(n, spec, split) for n in split.names}
        if short & _PROJECTIONS and short & _THROUGH:
            continue
        raise SemipackError(
            f"explain_layers: {type(model).__name__}'s attention layer '{spec.name}' is split at "
            f"a tensor whose uses are {sorted(short)}: not the input of its query, key and value "
            "projections and its residual, so its values would miss paths through the layer "
            "(a bottleneck or a norm inside the block, as in MobileBERT and ESM, or a "
            "cross-attention whose only projection from the input reads it through another "
            f"op first, as DETR's decoder adds positions). semipack knows {FAMILIES}; pass "
            "layers=[AttentionLayer(...), ...] naming a block whose first input is the "
            "projections' input"
        )


def _check_layers(layers: Sequence[AttentionLayer]) -> None:
    """Refuse, before anything runs, an empty list and a layer whose head count contradicts
    its block's own (``num_heads=2, head_dim=8`` on a block of four heads of 4: each "head"
    of the tables joined two real ones, with the total width right; trial 56)."""
    if not layers:
        raise SemipackError("explain_layers: layers=[] holds no layer to explain")
    for spec in layers:
        owners = (spec.block, getattr(spec.block, "self", None), getattr(spec.block, "attn", None))
        stated = next(((o, n) for o in owners if (n := _stated_heads(o)) is not None), None)
        if stated is not None and stated[1] != spec.num_heads:
            raise SemipackError(
                f"explain_layers: AttentionLayer('{spec.name}') says {spec.num_heads} heads, "
                f"but its block ({type(stated[0]).__name__}) has {stated[1]}: per-head values "
                "would join or split real heads; pass its own head count and width"
            )


#: Attributes by which attention blocks (and their configs) state their number of heads, in
#: the order they are read (transformers' families).
_HEAD_COUNTS = ("num_attention_heads", "num_heads", "n_head", "n_heads", "num_attention_head")


def _stated_heads(owner: object) -> int | None:
    """The number of heads an attention module or a config states (``num_attention_heads``,
    ...), or None where it states none (Swin's config holds a list: not a count)."""
    if owner is None:
        return None
    counts = (getattr(owner, name, None) for name in _HEAD_COUNTS)
    return next(
        (c for c in counts if isinstance(c, int) and not isinstance(c, bool) and c > 0), None
    )


def _check_shapes(layers: Sequence[AttentionLayer], contexts: Sequence[Branches | None]) -> None:
    """Each layer's heads' input must be ``num_heads * head_dim`` wide: ConvBERT's attention
    gives part of its width to a convolution (``head_ratio``), and viewing its heads' input as
    that many heads failed inside the readout."""
    for spec, context in zip(layers, contexts, strict=True):
        if context is None or context.split is None:
            continue
        if context.split.dim() != 3:
            raise SemipackError(
                f"explain_layers: the heads' input of '{spec.name}' has shape "
                f"{tuple(context.split.shape)}, not [batch, tokens, heads * head_dim]: pass "
                "the module whose input holds the heads side by side (the attention output "
                "projection), or heads_input=None"
            )
        width = context.split.shape[-1]
        if width != spec.num_heads * spec.head_dim:
            raise SemipackError(
                f"explain_layers: the heads' input of '{spec.name}' is {width} wide, not "
                f"{spec.num_heads} heads x {spec.head_dim}: the layer mixes its heads with "
                "something else (ConvBERT's convolution), so per-head values cannot be read; "
                "pass layers=[AttentionLayer(...), ...] with heads_input=None for no per-head "
                "values"
            )


def _check_called(
    layers: Sequence[AttentionLayer],
    splits: Sequence[Branches],
    contexts: Sequence[Branches | None],
) -> None:
    """Every layer's block and heads' module must run in ``target()``, once: name those that
    did not (a hand-made ``AttentionLayer`` of another model, a forward run before the call)
    and those that ran more than once (a target that runs the model on two sentences)."""
    missing = [
        f"{spec.name} ({'block' if split.split is None else 'heads_input'})"
        for spec, split, context in zip(layers, splits, contexts, strict=True)
        if split.split is None or (context is not None and context.split is None)
    ]
    without_graph = [
        spec.name
        for spec, split in zip(layers, splits, strict=True)
        if split.split is None and split.calls_without_grad
    ]
    if without_graph:  # a reentrant checkpoint's forward, or target() under no_grad (trial 69:
        # named as never called)
        raise SemipackError(
            f"explain_layers: target() called {', '.join(without_graph)} only where autograd "
            f"records nothing ({NO_GRAPH_CAUSES}), so no branch can be told apart"
        )
    if missing:
        raise SemipackError(
            f"explain_layers: target() did not call {', '.join(missing)}; target must run the "
            "model's forward itself, and each AttentionLayer name modules of that model"
        )


def _check_after_backward(
    layers: Sequence[AttentionLayer],
    splits: Sequence[Branches],
    contexts: Sequence[Branches | None],
) -> None:
    """After the backward: it must have reached one call of each block and heads' module
    (a target that runs the model on two sentences reaches two; a metric forward it does not
    reach is no call), and no use of a layer's input before its block (a gate computed
    first): those paths would be in no branch and missing from the layer's total. A use no
    backward reaches (a logged norm) has no path and is no use."""
    repeated = [
        f"{spec.name} ({split.calls} calls)"
        for spec, split in zip(layers, splits, strict=True)
        if split.calls > 1
    ] + [  # a heads' module shared by layers: the later layers read the first one's heads
        f"{spec.name}'s heads_input ({context.calls} calls)"
        for spec, context in zip(layers, contexts, strict=True)
        if context is not None and context.calls > 1
    ]
    if repeated:  # one call is split: the others' paths would be missing
        raise SemipackError(
            f"explain_layers: the backward of target() reached {', '.join(repeated)}; each "
            "block is split at one call, so the paths through the others (a second sentence, "
            "a shared module) would be missing: run the model once in target(), on a batch "
            "holding every input"
        )
    for uses, how, advice in (
        (
            lambda split: split.used_before,
            "before the block was called",
            "; pass layers=[AttentionLayer(...), ...] naming a block that holds every use of "
            "its input",
        ),
        (
            lambda split: split.unseen_uses,
            "by a call semipack does not see (a custom autograd.Function's apply, code below "
            "Python)",
            "",
        ),
    ):
        found = [
            f"{spec.name} (by {', '.join(uses(split))})"
            for spec, split in zip(layers, splits, strict=True)
            if uses(split)
        ]
        if found:
            raise SemipackError(
                f"explain_layers: the input of {', '.join(found)} was used {how}, so the paths "
                f"through that use would be in no branch and missing from the layer's "
                f"total{advice}"
            )


def _check_model(model: object, who: str) -> None:
    """A clear refusal of anything but a module where the model goes (trial 124: None met
    ``model.modules()`` and raised a bare ``AttributeError``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{who} expects the model, an nn.Module, as its first argument, got "
            f"{type(model).__name__}"
        )


def _dropout_active(model: nn.Module) -> bool:
    """Whether a module in training mode drops out: a dropout module with ``p > 0``, or a
    float dropout rate its forward applies only in training (Hugging Face's attention)."""
    for module in model.modules():
        if not module.training:
            continue
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        rates = (getattr(module, n, None) for n in ("attention_dropout", "dropout"))
        if any(isinstance(r, float) and r > 0 for r in rates):
            return True
    return False


def _entries(model: nn.Module, layers: Sequence[AttentionLayer]) -> list[nn.Module]:
    """Each split block and the module enclosing it (where a residual add may use the same
    input: DistilBERT, ``nn.TransformerEncoderLayer``)."""
    modules = []
    for spec in layers:
        if "." not in spec.name:  # a child of the model (a bare nn.TransformerEncoderLayer)
            modules.append(model)
        else:
            with suppress(AttributeError):  # a hand-made layer named outside the model
                modules.append(model.get_submodule(spec.name.rsplit(".", 1)[0]))
        modules.append(spec.block)
    return modules


def _requiring_grad(module: nn.Module, args: tuple, kwargs: dict):
    """A frozen model (no parameter requires grad) builds no graph below its first attention
    layer: the first tensor input of that layer (and of its block, the one split) becomes a
    leaf that requires grad, in every argument that passes that tensor (``self_attn(x, x, x)``
    uses it as query, key and value). The values at and above it are those of the same model
    unfrozen (paths from the root to a tensor do not depend on what lies below it)."""
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
    if first is None or first.requires_grad or not first.is_floating_point():
        return None
    leaf = first.detach().requires_grad_()
    args = tuple(leaf if a is first else a for a in args)
    return args, {k: leaf if v is first else v for k, v in kwargs.items()}


def _check_semiring(semiring: Semiring) -> None:
    """Refuse what has no single value per token: KBest (k values), SignedMaxProd and
    Entropy(flow=True) (two)."""
    if isinstance(semiring, type):
        raise SemipackError(f"explain_layers takes a semiring instance: pass {semiring.__name__}()")
    if not isinstance(semiring, Semiring):
        raise SemipackError(f"explain_layers takes a semiring, got {type(semiring).__name__}")
    factors = semiring.semirings if isinstance(semiring, Product) else (semiring,)
    for factor in factors:
        if isinstance(factor, (KBest, SignedMaxProd)):
            raise SemipackError(
                f"explain_layers needs one value per token and branch; {factor.name} reads out "
                "several: use MaxProd, TopPath, LogSum, LogCount, Entropy (or a Product of them), "
                "and layer_routes for KBest's paths"
            )
        if isinstance(factor, Entropy) and factor.flow:
            raise SemipackError(
                "explain_layers needs one value per token and branch; Entropy(flow=True) reads "
                "out two: pass Entropy(), or Product(Entropy(), LogSum()) for both (one "
                "LayerFlow per factor)"
            )


def _flow(
    semiring: Semiring,
    layers: Sequence[AttentionLayer],
    splits: Sequence[Branches],
    contexts: Sequence[Branches | None],
    tokens: list[str] | list[list[str]] | None,
    factor: int | None,
) -> LayerFlow:
    """The ``LayerFlow`` of one semiring (``factor``: its place in a Product's readouts)."""

    no_path = float(semiring.readout(semiring.zeros((), torch.float64, "cpu")))
    if isinstance(semiring, Real):  # a signed sum: 0 is no sign that no path exists
        no_path = math.nan

    def pick(readout, shape: Sequence[int], batch_first: bool = True) -> Tensor:
        if readout is None:  # no path reached the layer at all
            return torch.full(tuple(shape), no_path, dtype=torch.float64, device=device)
        value = (readout if factor is None else readout[factor]).detach()
        return value if batch_first else value.transpose(0, 1)  # [batch, tokens, ...]

    device = splits[0].split.device if splits else None
    per_layer, totals, heads = [], [], []
    for spec, split, context in zip(layers, splits, contexts, strict=True):
        first = spec.batch_first
        values = {}

        def short(name: str, split: Branches = split, spec: AttentionLayer = spec) -> str:
            return _short_name(name, spec, split)

        # consumers with one short name (two residual adds, say) are joined by the plus
        for name, value in split.aggregate(-1, rename=short).items():
            if value is not None:
                values[name] = pick(value, (), first)
        per_layer.append(values)
        shape = split.split.shape[:-1] if first else split.split.shape[:-1][::-1]
        totals.append(pick(split.total(-1), shape, first))
        if context is None:  # no module receives the heads' outputs: no per-head values
            heads.append(torch.zeros((*shape, 0), dtype=totals[-1].dtype, device=device))
            continue
        # the heads' input in the layer's own layout: [batch, tokens] or [tokens, batch] first
        view = (*context.split.shape[:-1], spec.num_heads, spec.head_dim)
        heads.append(pick(context.total(-1, view=view), (*shape, spec.num_heads), first))
    shapes = {a.name: tuple(t.shape) for a, t in zip(layers, totals, strict=True)}
    if len(set(shapes.values())) > 1:
        raise SemipackError(
            "explain_layers compares layers token by token, so every attention layer must see "
            "the same [batch, tokens]; these differ (an encoder and a decoder of other lengths, "
            f"windowed attention, or stages that merge tokens, as Swin's): {shapes}. Pass "
            "layers=[...] with layers of one shape (the encoder's or the decoder's)"
        )
    return LayerFlow(
        type(semiring).__name__,
        [a.name for a in layers],
        per_layer,
        torch.stack(totals),
        torch.stack(heads),
        tokens,
        no_path=no_path,
        log=bool(getattr(semiring, "log", False)),
    )


@dataclass
class LayerHop:
    """A path's passage through one attention layer."""

    layer: int
    token_in: int  # the token at the layer's input where the path enters
    token_out: int  # the token at the layer's output where it leaves
    #: query, key, value; residual (no step inside the attention block); attention (steps
    #: inside it, through a fused projection whose layout semipack does not read); in a
    #: parallel block, the feed-forward part's first linear map (``mlp.up_proj``), which reads
    #: the attention's input
    branch: str
    head: int | None  # the head of the projection it takes, None for residual and attention
    label: str = ""  # the layer's short label (``layer_labels``); ``L<layer>`` when empty
    #: with grouped-query attention, the first and last query head that share the key or value
    #: head ``head`` (``head`` counts key/value heads there, tables count query heads)
    query_heads: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        """How tables and routes name the layer: its label, else ``L<position>``."""
        return self.label or f"L{self.layer}"


@dataclass
class LayerRoute:
    """A single path (``TopPath.path`` or one of ``KBest.paths``) read layer by layer.

    ``example`` is the batch index of the path's entries inside the layers (attention does not
    mix examples, so a path stays in one), None for a path that passes no layer."""

    value: float
    hops: list[LayerHop] = field(default_factory=list)
    rank: int = 0
    example: int | None = None
    #: the path's start where it is a named tensor (a parameter, ``h.0.mlp.c_fc.weight[3, 1]``),
    #: else empty (the tokens name where a path from the input starts)
    start: str = ""

    def describe(self, tokens: Sequence[str] | Sequence[Sequence[str]] | None = None) -> str:
        """One line: the value, then each hop (runs of residual hops merged), tokens named.
        ``tokens``: one sentence's tokens, or one list per example of the batch (the route's
        example is then named by its own); a route of an example other than the first says
        which."""
        tokens = _tokens_of(tokens, self.example)
        needed = 1 + max((max(h.token_in, h.token_out) for h in self.hops), default=-1)
        if tokens is not None and len(tokens) < needed:
            raise SemipackError(
                f"describe: {len(tokens)} token labels, but the route passes token "
                f"{needed - 1} (one label per token of the layers' inputs, special tokens "
                "included)"
            )

        def name(t: int) -> str:
            return tokens[t] if tokens is not None else f"token {t}"

        parts, start = [], 0
        hops = self.hops
        while start < len(hops):
            hop = hops[start]
            if hop.branch == "residual":
                end = start
                while end + 1 < len(hops) and hops[end + 1].branch == "residual":
                    end += 1
                where = hop.name + (f"-{hops[end].name}" if end > start else "")
                parts.append(f"{where} residual")
                start = end + 1
                continue
            head = "" if hop.head is None else f" head {hop.head}"
            if hop.query_heads is not None:
                first_head, last_head = hop.query_heads
                head += f" (shared by query heads {first_head}-{last_head})"
            parts.append(
                f"{hop.name} {hop.branch}{head}: {name(hop.token_in)} -> {name(hop.token_out)}"
            )
            start += 1
        if self.value == 0.0:  # the semiring zero: no path reaches the entry
            return f"no path{f' from {self.start}' if self.start else ''} (its value is the zero)"
        first = self.start or (name(hops[0].token_in) if hops else "")
        where = f" of example {self.example}" if self.example else ""
        start = f"  from {first}{where}" if first else ""
        if not parts:
            return f"{self.value:.4g}{start}: through no attention layer"
        return f"{self.value:.4g}{start}: " + ", ".join(parts)

    def __str__(self) -> str:
        return self.describe()


def layer_routes(paths: Sequence[Path], layers: Sequence[AttentionLayer]) -> list[LayerRoute]:
    """Each path's hops through the attention layers, from its steps' module names and
    entries (``[batch, tokens, ...]`` tensors inside each layer); the head of a query, key or
    value entry is its unit // ``head_dim`` (with grouped-query attention, a key or value
    entry names its shared key/value head; in a cross-attention block a key or value hop's
    ``token_in`` indexes the encoder's sequence). A layer the path does not pass is left out."""
    for spec in layers:
        if isinstance(spec.block, nn.MultiheadAttention):
            raise SemipackError(
                f"layer_routes cannot read hops through {spec.name} (nn.MultiheadAttention): its "
                "query, key and value projections are no modules of their own, and its inner "
                "tensors change layout; read it with explain_layers"
            )
    owners = [_owner(spec.name) for spec in layers]
    labels = layer_labels([spec.name for spec in layers])
    routes = []
    for path in paths:
        hops = []
        for i, spec in enumerate(layers):
            # the layer's steps on [batch, tokens, hidden] tensors; the layer's own module
            # makes the residual adds of Llama- and GPT-2-family layers. A layer with two
            # blocks (self- and cross-attention) keeps each block's steps to that block, which
            # holds its residual add (BERT's decoder layers)
            owner = owners[i] if owners.count(owners[i]) == 1 else spec.name
            if _in_module(path.leaf, owner) and not _in_module(path.leaf, spec.name):
                # a path from a parameter of the layer beside its attention block (a
                # feed-forward weight) starts past the block's input: no hop through the layer
                # (it read as the residual, or as a feed-forward branch; trials 75 and 76)
                continue
            inside = [s for s in path.steps if _in_module(s.module, owner) and len(s.index) == 3]
            if not inside and owner != owners[i]:
                inside = _shared_layer_residual(path.steps, i, layers, owners)
            if not inside:
                continue
            found = next(((s, p) for s in inside if (p := _projection(s, spec)) is not None), None)
            if found is None:
                # per-head steps inside the block ([batch, head, query, dim]) without a
                # projection it can read (a fused one of another layout): through attention,
                # branch unknown; none: the residual (BERT's add and norm are in the block)
                through = any(
                    _in_module(s.module, spec.name) and len(s.index) == 4 for s in path.steps
                )
                branch, head = "attention" if through else "residual", None
                token_in = inside[0].index[1]
                fused = _fused_projection_step(inside, spec.name) if through else None
                if fused is not None:  # named as explain_layers names its branch (trial 118)
                    branch, token_in = PROJECTIONS[fused.module.rpartition(".")[2]], fused.index[1]
                beside = None if through else _parallel_branch(inside, spec.name, owner)
                if beside is not None:
                    branch, token_in = beside
            else:
                projection, (branch, head) = found
                token_in = projection.index[1]
            shared = _query_heads(spec, found[0], branch, head) if found is not None else None
            hops.append(
                LayerHop(
                    i, int(token_in), int(inside[-1].index[1]), branch, head, labels[i], shared
                )
            )
            example = int(inside[0].index[0])
        start = "" if _ANONYMOUS_LEAF.fullmatch(path.leaf) else f"{path.leaf}{list(path.index)}"
        routes.append(LayerRoute(path.value, hops, path.rank, example if hops else None, start))
    return routes


#: How a path names a leaf that is no named parameter (``transport.backward``): ``leaf 3``.
_ANONYMOUS_LEAF = re.compile(r"leaf \d+")


def _parallel_branch(inside: Sequence[PathStep], block: str, owner: str) -> tuple[str, int] | None:
    """(branch, token) of a hop that leaves the attention block's input by another use in the
    same layer: a parallel block's feed-forward part (Cohere, GPT-J, Falcon, GPT-NeoX with a
    parallel residual, Phi), which reads the normalised input the attention reads (trial 73:
    read as the residual). The path's first steps in the layer are then in submodules beside
    the block (the shared norm), before any step of the layer's own (its residual add) or of
    the block; the branch is named, as ``explain_layers`` names it, after the module of the
    first linear map it takes (``mlp.up_proj``). A sequential layer's feed-forward part comes
    after the residual add: a path through it crosses the attention layer by the residual.
    None where the hop is no such one."""
    if owner == block:
        return None
    for step in inside:
        name = step.module or ""
        if name == owner or _in_module(name, block) or not _in_module(name, owner):
            return None  # the layer's own add (the residual) or the block came first
        if step.op in _LINEAR_OPS:
            return name.removeprefix(owner + "."), int(step.index[1])
    return None


#: Path-step ops of a linear map (``PathStep.op``: the autograd node's name less ``Backward``):
#: the Linear extension's node, and the generic path's products.
_LINEAR_OPS = frozenset({"LinearFunction", "Addmm", "Mm", "Bmm", "Mv"})


def _shared_layer_residual(
    steps: Sequence[PathStep], i: int, layers: Sequence[AttentionLayer], owners: Sequence[str]
) -> list[PathStep]:
    """The steps by which a path crosses block ``i`` of a layer that holds several blocks (a
    pre-norm decoder layer's self- and cross-attention, Whisper's or BART's) through the
    residual: the layer module's own steps (its residual adds, which belong to no block) between
    the blocks of the layer the path passes before and after block ``i``; none where the path
    starts after block ``i`` (a leaf of a later block or of the feed-forward part) or ends
    before it. A block of its own keeps the steps inside it (BERT's decoder: the add is in it)."""
    owner = owners[i]
    group = [j for j, o in enumerate(owners) if o == owner]
    at = [k for k, s in enumerate(steps) if _in_module(s.module, owner) and len(s.index) == 3]
    if not at:
        return []
    passed = {j: [k for k in at if _in_module(steps[k].module, layers[j].name)] for j in group}
    before = [max(passed[j]) for j in group if j < i and passed[j]]
    after = [min(passed[j]) for j in group if j > i and passed[j]]
    start = max(before) if before else (at[0] - 1 if at[0] > 0 else None)
    end = min(after) if after else (at[-1] + 1 if at[-1] < len(steps) - 1 else None)
    if start is None or end is None:
        return []  # the path starts inside this layer after the block, or ends before it
    blocks = [layers[j].name for j in group]
    return [
        steps[k]
        for k in at
        if start < k < end and not any(_in_module(steps[k].module, b) for b in blocks)
    ]


def _in_module(step_module: str | None, name: str) -> bool:
    """Whether a step made by ``step_module`` lies inside the module ``name``."""
    return bool(step_module) and (step_module == name or step_module.startswith(name + "."))


def _owner(name: str) -> str:
    """The module whose steps belong to the layer named ``name``: the module holding the
    attention block (``encoder.layer.2`` for ``encoder.layer.2.attention``: it makes the
    residual add), unless the block is itself an item of a list (``blocks.1``), whose parent
    holds every layer (it credited one layer with its siblings' hops, trial 56)."""
    parent, _, leaf = name.rpartition(".")
    return parent if parent and not leaf.isdigit() else name


def layer_labels(names: Sequence[str]) -> list[str]:
    """Short labels of attention layers for tables, pictures and routes: ``L<k>`` with ``k``
    the layer's own index in the model (``encoder.layer.2.attention`` is ``L2`` also when the
    layers given start there; of several numbers in a name, the first that tells the layers of
    one kind apart, T5's block in ``encoder.block.2.layer.0.SelfAttention``, or the last where
    one layer is of its kind), the block's own
    name added where two blocks share an index (``L0 attention``, ``L0 crossattention``), and
    the stack's where the layers come from several (``encoder L0``, ``decoder L0 self_attn``:
    BART's, also inside a wrapper, ``model.encoder.layers``; CLIP's towers ``text_model L0``;
    trial 80 found them labelled by position); ``L<position>`` where the names hold no index,
    or where their labels would still not be distinct."""
    parts = [name.split(".") for name in names]
    if not all(any(p.isdigit() for p in ps) for ps in parts):
        return [f"L{i}" for i in range(len(names))]
    kinds = [tuple("#" if p.isdigit() else p for p in ps) for ps in parts]
    places = []  # per name, the position of its index among its parts
    for ps, kind in zip(parts, kinds, strict=True):
        numbered = [i for i, p in enumerate(ps) if p.isdigit()]
        same = [q for q, k in zip(parts, kinds, strict=True) if k == kind]
        varying = [i for i in numbered if len({q[i] for q in same}) > 1]
        places.append(varying[0] if varying else numbered[-1])
    labels = [f"L{int(ps[at])}" for ps, at in zip(parts, places, strict=True)]
    stacks = [tuple(ps[:at]) for ps, at in zip(parts, places, strict=True)]
    if len(set(stacks)) > 1:
        labels = [f"{tag} {label}" for tag, label in zip(_stack_tags(stacks), labels, strict=True)]
    repeated = {label for label in labels if labels.count(label) > 1}
    labels = [
        f"{label} {name.rsplit('.', 1)[-1]}" if label in repeated else label
        for label, name in zip(labels, names, strict=True)
    ]
    return labels if len(set(labels)) == len(labels) else [f"L{i}" for i in range(len(names))]


def _stack_tags(stacks: Sequence[tuple[str, ...]]) -> list[str]:
    """A short name per stack of layers (the module path before the layers' index): the first
    part in which the stacks differ (``encoder`` and ``decoder`` of ``model.encoder.layers`` and
    ``model.decoder.layers``), or the whole path where that part does not tell them apart."""
    first = next(
        i
        for i in range(max(len(s) for s in stacks) + 1)
        if len({s[i] if i < len(s) else None for s in stacks}) > 1
    )
    tags = [s[first] if first < len(s) else ".".join(s) for s in stacks]
    distinct = len(set(tags)) == len(set(stacks)) and not any(t.isdigit() for t in tags)
    return tags if distinct else [".".join(s) for s in stacks]


def _one_sentence(tokens: Sequence[str] | Sequence[Sequence[str]]) -> bool:
    """Whether ``tokens`` is one list of labels (not one list per example)."""
    return not tokens or isinstance(tokens[0], str)


def _tokens_of(
    tokens: Sequence[str] | Sequence[Sequence[str]] | None, example: int | None
) -> Sequence[str] | None:
    """One sentence's tokens from ``tokens`` (one sentence, or one list per example)."""
    if tokens is None or _one_sentence(tokens):
        return tokens  # type: ignore[return-value]
    return tokens[example or 0]


def _fused_projection_step(steps: Sequence[PathStep], block: str) -> PathStep | None:
    """The step on the output of ``block``'s own fused query-key-value projection whose
    packing ``_projection`` does not read (Bloom's and Falcon's ``query_key_value``), or None:
    the path's branch is then ``qkv``, as ``explain_layers`` names that projection's use."""
    for step in steps:
        owner, _, last = (step.module or "").rpartition(".")
        if owner == block and PROJECTIONS.get(last) == "qkv":
            return step
    return None


def _projection(step: PathStep, spec: AttentionLayer) -> tuple[str, int] | None:
    """(branch, head) of a step on a query, key or value projection's output, else None.
    GPT-2's fused ``c_attn`` packs query, key and value side by side: the unit's third;
    GPTBigCode's packs them per head, or (multi-query) the query's heads then one key and one
    value head; DeBERTa's (v1) ``in_proj`` packs them per head."""
    name = step.module or ""
    if not _in_module(name, spec.name):
        # another block's projection in the same layer (a decoder's cross-attention when only
        # its self-attention is given, trial 64) is no projection of this one
        return None
    unit = int(step.index[-1])
    if name == spec.name + ".q_attn":  # GPT-2's cross-attention: the query's own projection
        return "query", unit // spec.head_dim
    if name.endswith(".c_attn") and getattr(spec.block, "is_cross_attention", False):
        # GPT-2's cross-attention: c_attn makes [key | value] of the encoder's states
        width = spec.num_heads * spec.head_dim
        return BRANCH_ORDER[1 + unit // width], (unit % width) // spec.head_dim
    if name.endswith(".c_attn"):
        width, head_dim = spec.num_heads * spec.head_dim, spec.head_dim
        layout = _fused_layout(spec.block)
        if layout == "per head":
            head, part = divmod(unit, 3 * head_dim)
            return BRANCH_ORDER[part // head_dim], head
        if layout == "multi-query":  # [query heads | key | value], one shared key/value head
            if unit < width:
                return "query", unit // head_dim
            return BRANCH_ORDER[1 + (unit - width) // head_dim], 0
        return BRANCH_ORDER[unit // width], (unit % width) // head_dim
    if name == spec.name + ".qkv_proj" and type(spec.block).__name__ == "Phi3Attention":
        # Phi-3: [query heads | key heads | value heads], key and value of one width (another
        # family's qkv_proj packs them otherwise, CodeGen's per group as [q | v | k]: read as
        # the branch ``attention`` in ``layer_routes``)
        width = spec.num_heads * spec.head_dim
        kv_width = (spec.block.qkv_proj.weight.shape[0] - width) // 2
        if unit < width:
            return "query", unit // spec.head_dim
        part, offset = divmod(unit - width, kv_width)
        return BRANCH_ORDER[1 + part], offset // spec.head_dim
    if name == spec.name + ".query_key_value" and type(spec.block).__name__ == "GPTNeoXAttention":
        # GPT-NeoX: the output is viewed as [heads, 3 * head_dim] and chunked in three, like
        # DeBERTa's in_proj (Falcon's query_key_value packs them otherwise: not read here)
        head, part = divmod(unit, 3 * spec.head_dim)
        return BRANCH_ORDER[part // spec.head_dim], head
    if name.endswith(".in_proj"):
        # DeBERTa (v1): the output is viewed as [heads, 3 * head_dim] and chunked in three,
        # so each head's query, key and value units sit together
        head, part = divmod(unit, 3 * spec.head_dim)
        return BRANCH_ORDER[part // spec.head_dim], head
    if name == spec.name and step.op in _OWN_PROJECTIONS and len(step.index) == 3:
        # a projection the block's own forward makes (``F.linear(h, self.wv)``): explain_layers
        # calls its branch ``linear``; which of query, key and value it makes is not known
        return "linear", unit // spec.head_dim
    branch = branch_name(name, spec.name)
    return (branch, unit // spec.head_dim) if branch in BRANCH_ORDER[:3] else None


def _query_heads(
    spec: AttentionLayer, step: PathStep, branch: str, head: int | None
) -> tuple[int, int] | None:
    """The query heads sharing key or value head ``head`` of a grouped-query attention block
    (fewer key/value heads than query heads: Llama, Mistral, Qwen2, Phi-3's fused
    ``qkv_proj``, GPTBigCode's multi-query ``c_attn``); None elsewhere (trial 80: a route
    named a key/value head where the head table beside it counts query heads)."""
    if branch not in ("key", "value") or head is None:
        return None
    shared = _key_value_heads(spec, step)
    if not shared or shared >= spec.num_heads or spec.num_heads % shared:
        return None
    group = spec.num_heads // shared
    return head * group, head * group + group - 1


def _key_value_heads(spec: AttentionLayer, step: PathStep) -> int | None:
    """How many key (or value) heads the projection of ``step`` makes, where it can be read."""
    name = step.module or ""
    if name == spec.name + ".qkv_proj" and type(spec.block).__name__ == "Phi3Attention":
        width = spec.num_heads * spec.head_dim
        return (spec.block.qkv_proj.weight.shape[0] - width) // 2 // spec.head_dim
    if name.endswith(".c_attn"):
        return 1 if _fused_layout(spec.block) == "multi-query" else None
    if name == spec.name:
        return None
    try:
        projection = spec.block.get_submodule(name.removeprefix(spec.name + "."))
    except AttributeError:
        return None
    width = getattr(projection, "out_features", None)
    return None if width is None else width // spec.head_dim


#: The nodes of a linear layer's output (its extension's, ``x @ W``'s), ``[batch, tokens, units]``.
_OWN_PROJECTIONS = frozenset(("LinearFunction", "MatmulFunction"))

BRANCH_COLOURS = {"query": "tab:blue", "key": "tab:orange", "value": "tab:green"}
_OTHER_COLOURS = {"residual": "grey", "attention": "tab:purple"}
#: a parallel block's feed-forward branch (``LayerHop.branch`` names its linear map)
BESIDE = "tab:olive"


def plot_routes(
    routes: Sequence[LayerRoute],
    tokens: Sequence[str] | Sequence[Sequence[str]],
    layers: int,
    path: str | FilePath | None = None,
    ax=None,
):
    """Tokens (rows) x layer boundaries (columns): each route drawn as a line from the token
    where it enters a layer to the token where it leaves, coloured by branch (grey: residual)
    and labelled with the head; the best route solid and widest. The routes must come from
    one example; ``tokens`` are its tokens, or one list per example of the batch."""
    examples = sorted({r.example for r in routes if r.example is not None})
    if len(examples) > 1:
        raise SemipackError(
            f"plot_routes draws one example's routes; these come from examples {examples}: "
            "plot each example's routes on their own"
        )
    tokens = _tokens_of(tokens, examples[0] if examples else None)
    plt = _pyplot()
    fig, ax = _figure(plt, ax, (1.8 + 1.1 * layers, 0.9 + 0.32 * len(tokens)))
    routes = sorted(routes, key=lambda route: -route.value)
    for r, route in reversed(list(enumerate(routes))):  # the best drawn last, on top
        width, alpha = 1.0 + 2.0 / (1 + r), max(0.35, 1.0 / (1 + 0.3 * r))
        for hop in route.hops:
            colour = BRANCH_COLOURS.get(hop.branch, _OTHER_COLOURS.get(hop.branch, BESIDE))
            ax.plot([hop.layer, hop.layer + 1], [hop.token_in, hop.token_out], color=colour,
                    linewidth=width, alpha=alpha, solid_capstyle="round")  # fmt: skip
            if hop.head is not None:
                middle = (hop.layer + 0.5, (hop.token_in + hop.token_out) / 2)
                ax.annotate(f"{hop.branch[0]}{hop.head}", middle, fontsize=7, ha="center")
    names = {hop.layer: hop.name for route in routes for hop in route.hops}
    ax.set_xticks(range(layers + 1), [names.get(i, f"L{i}") for i in range(layers)] + ["out"])
    ax.set_yticks(range(len(tokens)), list(tokens))
    ax.set_ylim(len(tokens) - 0.5, -0.5)
    ax.set_xlim(-0.2, layers + 0.2)
    ax.grid(axis="x", alpha=0.3)
    shown = [*BRANCH_COLOURS.items(), ("residual", "grey")]
    drawn = {hop.branch for route in routes for hop in route.hops}
    if "attention" in drawn:
        shown.append(("attention", "tab:purple"))
    if drawn - set(BRANCH_COLOURS) - set(_OTHER_COLOURS):
        shown.append(("feed-forward beside attention", BESIDE))
    handles = [plt.Line2D([], [], color=c, label=b) for b, c in shown]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title("paths across the layers, best widest (label: branch letter, head)")
    return _save(plt, fig, path, ax)


def _pyplot():
    """pyplot, imported on first use (matplotlib is an optional dependency); on a machine
    without a display matplotlib picks its file-only backend itself."""
    import matplotlib.pyplot as plt

    return plt


def _figure(plt, ax, size: tuple[float, float]):
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=size)
    return fig, ax


def _save(plt, fig, path: str | FilePath | None, ax):
    if path is not None:
        fig.tight_layout()
        # "tight": a title wider than a small figure (two layers, three tokens) is kept whole
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
    return ax


def write_csv(flows: Sequence[LayerFlow], path: str | FilePath, example: int | None = None) -> None:
    """Every flow's ``rows`` in one CSV file (semiring, layer, branch, example, token_index,
    token, value): every example of the batch, or ``example`` alone."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["semiring", "layer", "branch", "example", "token_index", "token", "value"])
        for flow in flows:
            writer.writerows(flow.rows(example))


__all__ = [
    "FAMILIES",
    "AttentionLayer",
    "LayerFlow",
    "LayerHop",
    "LayerRoute",
    "attention_layers",
    "branch_name",
    "explain_layers",
    "layer_routes",
    "plot_routes",
    "write_csv",
]
