"""The paper's synthetic task: does the first token appear again, exactly once?

Du et al. (ACL 2023, "Generalizing Backpropagation for Gradient-Based Interpretability") train
a one-layer BERT on sequences of 10 tokens drawn from 1-19 whose label says whether the first
token comes back, and look at the best gradient path (MaxProd) from the true label's
logit to every token at the attention block's input: by which branch (query, key, value or
the residual "skip" add) does it leave? The mechanism the task needs is "the first token's
query finds its repeat's key", and the paper's bar chart shows exactly that: the repeated
token's best path runs through the key, the first token's mostly through the query.

This script builds the data set as the authors' code does, trains the paper's model size with a
recipe that converges in seconds on a CPU, and reads the branches in both drawings of softmax
(``semipack.extend(..., drawing=...)``, README "Semantics"), printing a ``TokenTypeTable`` per
seed and drawing next to the published values, and a bar chart of each drawing::

    python examples/first_token_repeat.py --seeds 0 1 2 --out docs

What it measures, and where that differs from the paper and why, is in the README
("Reproduction: the paper's synthetic task"). Everything runs on the CPU; the functions below
are imported by ``tests/test_example_first_token.py``, which checks them on small untrained
models.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor
from tqdm import tqdm

import semipack
from semipack.explain import TokenTypeTable, attention_branch

VOCAB, LENGTH, POINTS = 20, 10, 10_000
#: The authors' split of the 10,000 sequences: train, validation, test.
FRACTIONS = (0.7, 0.1, 0.2)
TYPE_NAMES = ("first", "repeated", "other")
BRANCH_NAMES = ("query", "key", "value", "residual")
DRAWINGS = ("atomic", "decomposed")
#: The paper's bar chart, read off the figure: mean best-path value per token type and
#: branch ("skip" there is the residual branch here); the entries it shows as about 0 are 0.
PUBLISHED = {
    "first": {"query": 0.17, "key": 0.09, "value": 0.0, "residual": 0.09},
    "repeated": {"query": 0.0, "key": 0.27, "value": 0.0, "residual": 0.0},
    "other": {"query": 0.0, "key": 0.0, "value": 0.0, "residual": 0.0},
}


@dataclass(frozen=True)
class Recipe:
    """How the model is trained. The authors trained 42 epochs over a fixed 7,000-sequence
    training split (Adam, lr 1e-3, batch 32, dropout 0.2, BERT's initialisation range 0.02),
    which stays near chance for many epochs on this task. Their learning rate and batch with
    ten times the initialisation scale and no dropout reach 100% within about ten epochs;
    ``fresh`` draws a new training set of the same size every epoch (the fixed split converges
    too, see the README)."""

    epochs: int = 12
    lr: float = 1e-3
    batch: int = 32
    init_range: float = 0.2
    dropout: float = 0.0
    fresh: bool = True


def make_data(points: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``points`` sequences ``[points, LENGTH]`` of tokens 1..VOCAB-1 and labels ``[points]``.

    As the authors' generator: the first half are positives, in which the first token appears
    exactly once more at a uniformly drawn position 1..LENGTH-1, the second half negatives, in
    which it does not appear again; every other token is uniform over the tokens other than
    the first; then the order is shuffled. (Token 0 is never used: the authors kept it for
    padding.)
    """
    first = torch.randint(1, VOCAB, (points,), generator=generator)
    # uniform over the VOCAB - 2 tokens in 1..VOCAB-1 other than the first: draw from 1..VOCAB-2
    # and step over the first token
    ids = torch.randint(1, VOCAB - 1, (points, LENGTH), generator=generator)
    ids = ids + (ids >= first[:, None]).long()
    ids[:, 0] = first
    labels = (torch.arange(points) < points // 2).long()
    repeat_at = torch.randint(1, LENGTH, (points,), generator=generator)
    positives = labels.bool()
    ids[positives, repeat_at[positives]] = first[positives]
    order = torch.randperm(points, generator=generator)
    return ids[order], labels[order]


def split_data(ids: Tensor, labels: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """The authors' 70 / 10 / 20 split, in order: ``{"train", "val", "test"}`` -> (ids, labels)."""
    n = ids.shape[0]
    train, val = int(FRACTIONS[0] * n), int(FRACTIONS[1] * n)
    bounds = {"train": (0, train), "val": (train, train + val), "test": (train + val, n)}
    return {name: (ids[a:b], labels[a:b]) for name, (a, b) in bounds.items()}


def token_types(ids: Tensor) -> Tensor:
    """``[examples, tokens]`` labels into ``TYPE_NAMES``: 0 the first token, 1 a later copy of
    it (the repeat), 2 any other token."""
    repeated = ids == ids[:, :1]
    types = torch.where(repeated, 1, 2)
    types[:, 0] = 0
    return types


def build_model(seed: int, recipe: Recipe = Recipe()) -> transformers.BertForSequenceClassification:
    """The paper's model: BERT with one layer, hidden size 16, 2 heads, intermediate size 32,
    and the sequence-classification head (pooler and classifier on the first position, which is
    the first token itself: the sequences have no [CLS]). Eager attention, random weights drawn
    from ``seed``."""
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=LENGTH, num_labels=2,
        hidden_dropout_prob=recipe.dropout, attention_probs_dropout_prob=recipe.dropout,
        initializer_range=recipe.init_range,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification._from_config(
        config, attn_implementation="eager"
    )


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: Tensor, labels: Tensor
) -> float:
    """One Adam step on the cross-entropy of a batch (``ids [batch, LENGTH]``); the loss."""
    model.train()
    loss = F.cross_entropy(model(input_ids=ids).logits, labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def accuracy(model: torch.nn.Module, ids: Tensor, labels: Tensor) -> float:
    """Share of the sequences whose larger logit is the true label's (eval mode)."""
    model.eval()
    return float((model(input_ids=ids).logits.argmax(-1) == labels).double().mean())


def train(
    model: torch.nn.Module,
    data: dict[str, tuple[Tensor, Tensor]],
    seed: int,
    recipe: Recipe = Recipe(),
    progress: bool = True,
) -> None:
    """Train on ``data["train"]`` (or, with ``recipe.fresh``, on as many fresh sequences of the
    same recipe every epoch, drawn from ``seed``), showing the validation accuracy."""
    generator = torch.Generator().manual_seed(1000 + seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=recipe.lr)
    ids, labels = data["train"]
    bar = tqdm(range(recipe.epochs), desc=f"seed {seed}", disable=not progress, leave=False)
    for _ in bar:
        if recipe.fresh:
            ids, labels = make_data(ids.shape[0], generator)
        order = torch.randperm(ids.shape[0], generator=generator)
        for start in range(0, ids.shape[0], recipe.batch):
            rows = order[start : start + recipe.batch]
            loss = train_step(model, optimizer, ids[rows], labels[rows])
        bar.set_postfix(loss=f"{loss:.3f}", val=f"{accuracy(model, *data['val']):.1%}")


def branch_split(
    model: torch.nn.Module, ids: Tensor, labels: Tensor, drawing: str
) -> semipack.Branches:
    """The MaxProd value at the attention block's input (the embeddings' output,
    ``[examples, LENGTH, 16]``) from the true label's logit, split by the use a path leaves it
    through (query, key and value projections, residual add), in the given drawing of softmax.

    One backward for all the examples: the root is the sum over examples of each one's own
    true-label logit. In eval mode nothing in BERT mixes examples (attention, layer norm and
    the head work within a sequence; there is no batch norm, and dropout is off), so no path
    joins one example's logit to another example's tokens, and each example's values are those
    of a backward from its own logit alone (``tests/test_example_first_token.py`` checks this
    against one backward per example).
    """
    model.eval()
    with semipack.extend(model, semipack.MaxProd(), drawing=drawing, regular_grads=False):
        with semipack.branches(model.bert.encoder.layer[0].attention) as split:
            logits = model(input_ids=ids).logits
        logits.gather(1, labels[:, None]).sum().backward()
    return split


def analyse(
    model: torch.nn.Module, ids: Tensor, labels: Tensor, drawing: str, batch: int = 1000
) -> TokenTypeTable:
    """Per token type (first / repeated / other) and branch: the mean best-path value over the
    token's hidden units and the share of tokens whose best path leaves by that branch, over
    the sequences ``ids [examples, LENGTH]``, ``batch`` sequences per backward."""
    tables = []
    for start in range(0, ids.shape[0], batch):
        rows = slice(start, start + batch)
        split = branch_split(model, ids[rows], labels[rows], drawing)
        tables.append(
            TokenTypeTable.from_branches(
                split, token_types(ids[rows]), TYPE_NAMES, short=attention_branch
            )
        )
    return TokenTypeTable.pool(tables)


def run_seed(seed: int, data: dict[str, tuple[Tensor, Tensor]], recipe: Recipe, progress: bool):
    """Train one model; its test accuracy and, per drawing, the table over the validation
    sequences (the authors analysed their validation split)."""
    model = build_model(seed, recipe)
    train(model, data, seed, recipe, progress)
    ids, labels = data["val"]
    tables = {drawing: analyse(model, ids, labels, drawing) for drawing in DRAWINGS}
    return accuracy(model, *data["test"]), tables


def published_table() -> str:
    """The paper's numbers as a one-line-per-type text table."""
    lines = [f"{'published':14}" + "".join(f"{b:>10}" for b in BRANCH_NAMES)]
    for type_name in TYPE_NAMES:
        row = PUBLISHED[type_name]
        lines.append(f"  {type_name:12}" + "".join(f"{row[b]:>10.2f}" for b in BRANCH_NAMES))
    return "\n".join(lines)


def draw(pooled: dict[str, TokenTypeTable], seeds: int, path: Path) -> None:
    """Both drawings side by side, bars pooled over the ``seeds`` models, published values
    marked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4))
    axes = fig.subplots(1, len(pooled), sharey=True)
    for ax, (drawing, table) in zip(axes, pooled.items(), strict=True):
        title = f"drawing={drawing!r}, {seeds} seed{'s' * (seeds > 1)} pooled"
        table.bar_chart(ax=ax, reference=PUBLISHED, title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    """Train one model per seed, print accuracy and tables, write the pictures and Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Recipe()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--points", type=int, default=POINTS, help="sequences in the data set")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the data set")
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--init-range", type=float, default=defaults.init_range)
    parser.add_argument("--dropout", type=float, default=defaults.dropout)
    parser.add_argument(
        "--fixed-train", action="store_true",
        help="train on the fixed 7,000-sequence split every epoch (the authors' way)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNG and tables")
    args = parser.parse_args(argv)
    recipe = Recipe(
        epochs=args.epochs, lr=args.lr, batch=args.batch, init_range=args.init_range,
        dropout=args.dropout, fresh=not args.fixed_train,
    )  # fmt: skip
    # the tensors are tiny (a batch is 32 x 10 x 16): more threads only add synchronisation, and
    # on a machine shared with other jobs they wait for each other
    torch.set_num_threads(1)
    data = split_data(*make_data(args.points, torch.Generator().manual_seed(args.data_seed)))
    print(f"{recipe}\n{published_table()}\n")
    started = time.perf_counter()
    per_seed: dict[int, tuple[float, dict[str, TokenTypeTable]]] = {}
    for seed in args.seeds:
        per_seed[seed] = run_seed(seed, data, recipe, progress=sys.stderr.isatty())
        test_accuracy, tables = per_seed[seed]
        print(f"seed {seed}: test accuracy {test_accuracy:.2%}")
        for drawing, table in tables.items():
            print(f"  drawing={drawing!r}, {int(table.counts.sum())} validation tokens:")
            print("    " + str(table).replace("\n", "\n    "))
        print()
    elapsed = time.perf_counter() - started
    pooled = {d: TokenTypeTable.pool([t[d] for _, t in per_seed.values()]) for d in DRAWINGS}
    for drawing, table in pooled.items():
        print(f"all seeds pooled, drawing={drawing!r}:\n{table.to_markdown(PUBLISHED)}\n")
    print(f"{len(args.seeds)} seeds in {elapsed:.0f} s")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        draw(pooled, len(args.seeds), args.out / "first_token_repeat.png")
        with open(args.out / "first_token_repeat.md", "w") as f:
            f.write(
                "# examples/first_token_repeat.py, every seed and drawing\n\n"
                f"{recipe}. Each cell: the mean best-path value (MaxProd) over the validation "
                "tokens of that type, in brackets the share of them whose best path leaves by "
                "that branch, then the paper's value.\n\n"
            )
            for seed, (test_accuracy, tables) in per_seed.items():
                for drawing, table in tables.items():
                    f.write(f"seed {seed}, test accuracy {test_accuracy:.2%}, ")
                    f.write(f"drawing={drawing!r}:\n\n{table.to_markdown(PUBLISHED)}\n\n")
        print(f"wrote {args.out / 'first_token_repeat.png'}, {args.out / 'first_token_repeat.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
