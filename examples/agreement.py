"""Subject-verb agreement in the real all-MiniLM-L6-v2: where does the verb's flow come from?

For sentences whose subject and verb are separated by an *attractor* (a noun of the other
number: "The key to the cabinets is ..."), the target is the verb's output vector (its norm).
At every layer's input the LogSum semiring gives each token's share of the total flow into
it (every path, all hidden units of the token together), and the Entropy semiring how spread
the paths to each token are. Agreement needs the subject: the question is at which layers the
subject's share exceeds the attractor's.

Run (offline, about 15 s on a 2-core CPU)::

    python examples/agreement.py --out docs

prints per-layer tables (mean over the sentences) and writes ``agreement_flow.png`` (subject,
attractor and verb shares per layer) and ``agreement_entropy.png`` (tokens x layers, one
sentence).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import semipack
from semipack.cli import default_model_path, load

#: (sentence, subject, attractor, verb): each word one word piece of MiniLM's vocabulary.
SENTENCES = [
    ("The key to the cabinets is on the table.", "key", "cabinets", "is"),
    ("The keys to the cabinet are on the table.", "keys", "cabinet", "are"),
    ("The author of the books is famous.", "author", "books", "is"),
    ("The authors of the book are famous.", "authors", "book", "are"),
    ("The picture near the windows was old.", "picture", "windows", "was"),
    ("The pictures near the window were old.", "pictures", "window", "were"),
    ("The road to the cities is long.", "road", "cities", "is"),
    ("The roads to the city are long.", "roads", "city", "are"),
]
ROLES = ("subject", "attractor", "verb", "other")


@dataclass
class SentenceFlow:
    """One sentence: per layer, each role's share of the flow into the verb's output, and
    the flows themselves (``LayerFlow`` for LogSum and Entropy)."""

    tokens: list[str]
    positions: dict[str, int]  # subject, attractor, verb -> token index
    shares: torch.Tensor  # [layers, roles]: subject, attractor, verb, every other token
    logsum: semipack.LayerFlow
    entropy: semipack.LayerFlow


def position(tokens: Sequence[str], word: str) -> int:
    """Index of ``word`` among the tokens (it must be one word piece)."""
    lowered = [t.lower() for t in tokens]
    if word.lower() not in lowered:
        raise ValueError(f"{word!r} is not one token of {list(tokens)}")
    return lowered.index(word.lower())


def role_shares(flow: semipack.LayerFlow, positions: dict[str, int]) -> torch.Tensor:
    """``[layers, 4]``: the share of the LogSum flow at each layer's input that reaches the
    subject, the attractor, the verb and all other tokens (every token's units together)."""
    logs = flow.total[:, 0]  # [layers, tokens], log flow per token
    shares = (logs - logs.logsumexp(-1, keepdim=True)).exp()
    named = [positions["subject"], positions["attractor"], positions["verb"]]
    chosen = shares[:, named]
    return torch.cat([chosen, 1 - chosen.sum(-1, keepdim=True)], -1)


def explain_sentence(
    model: nn.Module, tokenizer, sentence: str, subject: str, attractor: str, verb: str
) -> SentenceFlow:
    """Two semiring passes (LogSum, Entropy) from the verb's output norm."""
    encoded = tokenizer(sentence, return_tensors="pt")
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    positions = {
        "subject": position(tokens, subject),
        "attractor": position(tokens, attractor),
        "verb": position(tokens, verb),
    }

    def target() -> torch.Tensor:
        return model(**encoded).last_hidden_state[0, positions["verb"]].norm()

    logsum = semipack.explain_layers(model, semipack.LogSum(), target, tokens=tokens)
    entropy = semipack.explain_layers(model, semipack.Entropy(), target, tokens=tokens)
    return SentenceFlow(tokens, positions, role_shares(logsum, positions), logsum, entropy)


def table(results: Sequence[SentenceFlow]) -> str:
    """Per layer: mean share of each role over the sentences, how many sentences give the
    subject more flow than the attractor, and the mean path entropy at the subject and the
    attractor."""
    shares = torch.stack([r.shares for r in results])  # [sentences, layers, roles]
    mean = shares.mean(0)
    wins = (shares[..., 0] > shares[..., 1]).sum(0)
    entropy = {
        role: torch.stack([r.entropy.total[:, 0, r.positions[role]] for r in results]).mean(0)
        for role in ("subject", "attractor")
    }
    lines = [
        f"{'layer':<6}" + "".join(f"{r:>11}" for r in ROLES) + f"{'subj>attr':>11}"
        + f"{'H(subj)':>10}{'H(attr)':>10}"
    ]  # fmt: skip
    for i in range(mean.shape[0]):
        lines.append(
            f"L{i:<5}" + "".join(f"{v:>11.1%}" for v in mean[i].tolist())
            + f"{int(wins[i]):>6} of {len(results)}"
            + f"{float(entropy['subject'][i]):>10.1f}{float(entropy['attractor'][i]):>10.1f}"
        )  # fmt: skip
    return "\n".join(lines)


def plot(results: Sequence[SentenceFlow], out: Path) -> list[Path]:
    """The role shares per layer (mean and each sentence) and one sentence's entropy map."""
    import matplotlib.pyplot as plt

    shares = torch.stack([r.shares for r in results])  # [sentences, layers, roles]
    layers = range(shares.shape[1])
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for k, (role, colour) in enumerate(
        zip(ROLES[:3], ("tab:blue", "tab:red", "tab:grey"), strict=True)
    ):
        for sentence in shares[..., k]:
            ax.plot(layers, sentence.tolist(), color=colour, alpha=0.15, linewidth=1)
        ax.plot(layers, shares[..., k].mean(0).tolist(), color=colour, linewidth=2.5, label=role)
    ax.set_xticks(list(layers), [f"L{i}" for i in layers])
    ax.set_ylabel("share of the flow into the verb")
    ax.set_title(f"where the verb's flow comes from ({len(results)} sentences, LogSum)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "agreement_flow.png", out / "agreement_entropy.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    results[0].entropy.plot_heatmap(paths[1])
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a BERT-family model directory")
    parser.add_argument("--out", default=None, help="folder for the pictures")
    args = parser.parse_args(argv)
    model, tokenizer = load(args.model or default_model_path())
    results = [explain_sentence(model, tokenizer, *row) for row in SENTENCES]
    print("share of the flow into the verb's output, at each layer's input (mean over sentences)")
    print(table(results))
    first = results[0]
    print(f"\n{SENTENCES[0][0]!r}: path entropy (nats) per token and layer")
    print(first.entropy.token_table())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        print("\nwrote " + ", ".join(str(p) for p in plot(results, out)))


if __name__ == "__main__":
    main()
