"""``examples/agreement.py`` on a tiny random BERT (CI does not load MiniLM for it): the role
shares are each token's share of every path to the layer's input, checked against a plain
LogSum run that retains that tensor."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_bert_config

import semipack

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "key", "keys", "to", "cabinets"]
WORDS += ["is", "are", "on", "table", "."]


def _example():
    spec = importlib.util.spec_from_file_location("agreement", ROOT / "examples" / "agreement.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("agreement", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tiny_agreement")
    (folder / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    tokenizer = transformers.BertTokenizer(str(folder / "vocab.txt"))
    cfg = tiny_bert_config(vocab_size=len(WORDS), num_hidden_layers=2, max_position_embeddings=16)
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval(), tokenizer


def test_role_shares_are_each_tokens_share_of_every_path(tiny, tmp_path: Path) -> None:
    example = _example()
    model, tokenizer = tiny
    sentence = ("the key to the cabinets is on the table .", "key", "cabinets", "is")
    result = example.explain_sentence(model, tokenizer, *sentence)
    assert result.positions == {"subject": 2, "attractor": 5, "verb": 6}
    kept = []
    hook = model.encoder.layer[1].attention.register_forward_pre_hook(
        lambda m, a: kept.append(a[0]) or a[0].retain_grad()
    )
    encoded = tokenizer(sentence[0], return_tensors="pt")
    with semipack.extend(model, semipack.LogSum()):
        model(**encoded).last_hidden_state[0, 6].norm().backward()
    hook.remove()
    logs = kept[0].semiring_grad[0].double()  # [tokens, hidden]: log flow per entry
    whole = logs.logsumexp((0, 1))
    want = [float((logs[t].logsumexp(0) - whole).exp()) for t in (2, 5, 6)]
    assert result.shares[1, :3].tolist() == pytest.approx(want, rel=1e-4)
    assert float(result.shares[1].sum()) == pytest.approx(1.0)
    lines = example.table([result, result]).splitlines()
    assert lines[0].split()[:5] == ["layer", "subject", "attractor", "verb", "other"]
    subject_wins = int(result.shares[1, 0] > result.shares[1, 1]) * 2
    assert lines[2].split()[5:8] == [str(subject_wins), "of", "2"]
    written = example.plot([result], tmp_path)
    assert all(p.stat().st_size > 1000 for p in written)


def test_a_word_split_into_pieces_is_refused(tiny) -> None:
    example = _example()
    with pytest.raises(ValueError, match="'cabinet' is not one token of"):
        example.position(["[CLS]", "the", "cabinets"], "cabinet")
