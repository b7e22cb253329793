"""Tiny random-weight versions of the model families users bring to semipack.

Every factory takes a dtype and returns a :class:`RealModel`: the model, its loss and the input
tensors that are leaves of the graph. Factories seed the global RNG first, so two calls give
bitwise identical models and inputs; :meth:`RealModel.loss` seeds it again, so any dropout mask
in a train-mode model repeats between a plain backward and a semiring one.

Nothing is downloaded: Hugging Face models are built from a config (``Model._from_config``) and
torchvision models with ``weights=None``. Sizes are the smallest that keep each family's
structure (hidden 16, 1-2 layers, 2-4 heads, vocabulary 50, 6-8 tokens, 32x32 images, batch 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: model -> scalar loss (inputs are captured by the closure; input leaves are listed separately).
LossFn = Callable[[nn.Module], Tensor]

VOCAB = 50
HIDDEN = 16
CLASSES = 3


@dataclass
class RealModel:
    """One model of the zoo: the module, the function from it to a scalar loss, input leaves."""

    name: str
    model: nn.Module
    loss_fn: LossFn
    input_leaves: dict[str, Tensor] = field(default_factory=dict)
    seed: int = 0

    def loss(self) -> Tensor:
        """Forward and loss, re-seeding first so that dropout masks repeat from run to run."""
        torch.manual_seed(self.seed)
        return self.loss_fn(self.model)

    def named_leaves(self) -> dict[str, Tensor]:
        """Every parameter that requires grad (by name, shared ones once), then input leaves."""
        leaves = {f"param:{n}": p for n, p in self.model.named_parameters() if p.requires_grad}
        leaves.update({f"input:{n}": t for n, t in self.input_leaves.items()})
        return leaves


Factory = Callable[[torch.dtype], RealModel]
MODELS: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    """Decorator: add a factory to the zoo under ``name``."""

    def decorate(factory: Factory) -> Factory:
        MODELS[name] = factory
        return factory

    return decorate


def build(name: str, dtype: torch.dtype = torch.float32) -> RealModel:
    """A fresh, deterministic instance of the named model in ``dtype``."""
    return MODELS[name](dtype)


def _token_ids(batch: int, length: int, seed: int) -> Tensor:
    """[batch, length] token ids in [1, VOCAB) (0 is kept for padding)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g)


def _images(dtype: torch.dtype, size: int = 32, seed: int = 0, batch: int = 2) -> Tensor:
    """A [batch, 3, size, size] image batch that requires grad (an input leaf)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g, dtype=dtype).requires_grad_(True)


#: Padding mask for a batch of two 6-token sequences: the first has two padding tokens.
PADDING_MASK = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
LABELS = torch.tensor([0, 2])


# --- Hugging Face transformers ------------------------------------------------------------------


def _hf_model(model_class, config, attn: str, dtype: torch.dtype, train: bool = False) -> nn.Module:
    """A random-weight model from its config, in eval mode unless ``train`` (then its dropout
    layers are live), refusing a silent attention swap."""
    model = model_class._from_config(config, attn_implementation=attn).to(dtype).train(train)
    if model.config._attn_implementation != attn:
        raise RuntimeError(f"{model_class.__name__} ignored attn_implementation={attn!r}")
    return model


def _sequence_classifier(
    name: str, model_class, config, attn: str, seed: int, train: bool = False
) -> Factory:
    """BERT-style models: [CLS] classification over a padded batch, cross-entropy loss."""

    def factory(dtype: torch.dtype) -> RealModel:
        torch.manual_seed(seed)
        model = _hf_model(model_class, config(), attn, dtype, train)
        ids = _token_ids(2, 6, seed) * PADDING_MASK

        def loss_fn(m: nn.Module) -> Tensor:
            return m(input_ids=ids, attention_mask=PADDING_MASK, labels=LABELS).loss

        return RealModel(name, model, loss_fn, seed=seed)

    return factory


def _causal_lm(name: str, model_class, config, attn: str, seed: int) -> Factory:
    """Decoder-only language models: next-token loss on the input ids themselves."""

    def factory(dtype: torch.dtype) -> RealModel:
        torch.manual_seed(seed)
        model = _hf_model(model_class, config(), attn, dtype)
        ids = _token_ids(2, 7, seed)

        def loss_fn(m: nn.Module) -> Tensor:
            return m(input_ids=ids, labels=ids).loss

        return RealModel(name, model, loss_fn, seed=seed)

    return factory


def _bert_config():
    from transformers import BertConfig

    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=CLASSES,
    )


def _distilbert_config():
    from transformers import DistilBertConfig

    return DistilBertConfig(
        vocab_size=VOCAB,
        dim=HIDDEN,
        n_layers=2,
        n_heads=2,
        hidden_dim=32,
        max_position_embeddings=16,
        num_labels=CLASSES,
    )


def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=HIDDEN,
        n_layer=2,
        n_head=2,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )


def _decoder_config(config_class, **extra):
    """Llama-family config: rotary embeddings, RMSNorm, SwiGLU, grouped-query attention."""
    return config_class(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        **extra,
    )


def _llama_config():
    from transformers import LlamaConfig

    return _decoder_config(LlamaConfig)


def _mistral_config():
    from transformers import MistralConfig

    return _decoder_config(MistralConfig)


def _qwen2_config():
    from transformers import Qwen2Config

    return _decoder_config(Qwen2Config)


def _register_hf() -> None:
    import transformers as tf

    for attn in ("eager", "sdpa"):
        families = [
            ("bert", _sequence_classifier, "BertForSequenceClassification", _bert_config, 1),
            ("distilbert", _sequence_classifier, "DistilBertForSequenceClassification",
             _distilbert_config, 2),
            ("gpt2", _causal_lm, "GPT2LMHeadModel", _gpt2_config, 3),
            ("llama", _causal_lm, "LlamaForCausalLM", _llama_config, 4),
            ("mistral", _causal_lm, "MistralForCausalLM", _mistral_config, 5),
            ("qwen2", _causal_lm, "Qwen2ForCausalLM", _qwen2_config, 6),
        ]  # fmt: skip
        for family, kind, class_name, config, seed in families:
            name = f"{family}_{attn}"
            register(name)(kind(name, getattr(tf, class_name), config, attn, seed))
        register(f"t5_{attn}")(_t5_factory(attn))
        # Train mode: hidden and attention dropout (p = 0.1), masks repeated by RealModel.loss.
        train_name = f"bert_{attn}_train"
        register(train_name)(
            _sequence_classifier(
                train_name, tf.BertForSequenceClassification, _bert_config, attn, 10, train=True
            )
        )
        register(f"vit_hf_{attn}")(_vit_hf_factory(attn))


def _t5_factory(attn: str) -> Factory:
    """T5 encoder-decoder with relative-position bias, padded source, teacher-forced labels."""

    def factory(dtype: torch.dtype) -> RealModel:
        from transformers import T5Config, T5ForConditionalGeneration

        torch.manual_seed(7)
        config = T5Config(
            vocab_size=VOCAB,
            d_model=HIDDEN,
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_decoder_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        model = _hf_model(T5ForConditionalGeneration, config, attn, dtype)
        ids = _token_ids(2, 6, 7) * PADDING_MASK
        labels = _token_ids(2, 5, 8)

        def loss_fn(m: nn.Module) -> Tensor:
            return m(input_ids=ids, attention_mask=PADDING_MASK, labels=labels).loss

        return RealModel(f"t5_{attn}", model, loss_fn, seed=7)

    return factory


def _vit_hf_factory(attn: str) -> Factory:
    """Hugging Face ViT: patch embedding (a strided conv), [CLS] token, image classification."""

    def factory(dtype: torch.dtype) -> RealModel:
        from transformers import ViTConfig, ViTForImageClassification

        torch.manual_seed(9)
        config = ViTConfig(
            image_size=16,
            patch_size=8,
            num_channels=3,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=CLASSES,
        )
        model = _hf_model(ViTForImageClassification, config, attn, dtype)
        pixels = _images(dtype, size=16, seed=9)

        def loss_fn(m: nn.Module) -> Tensor:
            return m(pixel_values=pixels, labels=LABELS).loss

        return RealModel(f"vit_hf_{attn}", model, loss_fn, {"pixel_values": pixels}, seed=9)

    return factory


_register_hf()


# --- torchvision --------------------------------------------------------------------------------


def _randomize_running_stats(model: nn.Module) -> None:
    """Non-trivial running statistics for eval-mode batch norm (fresh ones are 0 and 1)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn_like(m.running_mean) * 0.2)
                m.running_var.copy_(torch.rand_like(m.running_var) + 0.5)


def _image_classifier(
    name: str, make: Callable[[], nn.Module], train: bool, seed: int, size: int
) -> Factory:
    """``size`` x ``size`` RGB images, cross-entropy over 5 classes.

    Batch 2 in eval mode; batch 4 in train mode, where batch norm over the 1 x 1 maps of the last
    stages would otherwise see two values per channel: normalised to exactly +-1 whatever the
    input, its Jacobian is analytically zero and every gradient below it is rounding noise.
    """

    def factory(dtype: torch.dtype) -> RealModel:
        torch.manual_seed(seed)
        model = make().to(dtype)
        _randomize_running_stats(model)
        model.train(train)
        batch = 4 if train else 2
        images = _images(dtype, size=size, seed=seed, batch=batch)
        labels = torch.arange(batch) % 5

        def loss_fn(m: nn.Module) -> Tensor:
            return F.cross_entropy(m(images), labels)

        return RealModel(name, model, loss_fn, {"images": images}, seed=seed)

    return factory


def _resnet18() -> nn.Module:
    from torchvision.models import resnet18

    return resnet18(weights=None, num_classes=5)


def _mobilenet_v3_small() -> nn.Module:
    from torchvision.models import mobilenet_v3_small

    return mobilenet_v3_small(weights=None, num_classes=5)


def _torchvision_vit() -> nn.Module:
    from torchvision.models import VisionTransformer

    return VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
        num_classes=5,
    )


for _mode, _train in (("eval", False), ("train", True)):
    # resnet18 takes 16 x 16 images (down to 1 x 1 from layer3 on): its 11M parameters make
    # every run cost, and the convolution messages scale with the positions.
    for _family, _make, _seed, _size in (
        ("resnet18", _resnet18, 11, 16),
        ("mobilenet_v3_small", _mobilenet_v3_small, 12, 32),
        ("vit_torchvision", _torchvision_vit, 13, 32),
    ):
        register(f"{_family}_{_mode}")(
            _image_classifier(f"{_family}_{_mode}", _make, _train, _seed, _size)
        )


# --- recurrent networks and nn.Transformer -------------------------------------------------------


class RecurrentClassifier(nn.Module):
    """Embedding -> 2-layer LSTM or GRU -> linear head on the last time step."""

    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.rnn = cell(HIDDEN, HIDDEN, num_layers=2, batch_first=True)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, ids: Tensor) -> Tensor:
        """ids: [batch, time] -> logits [batch, CLASSES]."""
        states, _ = self.rnn(self.embed(ids))
        return self.head(states[:, -1])


def _recurrent(name: str, cell: type[nn.RNNBase], seed: int) -> Factory:
    def factory(dtype: torch.dtype) -> RealModel:
        torch.manual_seed(seed)
        model = RecurrentClassifier(cell).to(dtype)
        ids = _token_ids(2, 6, seed)

        def loss_fn(m: nn.Module) -> Tensor:
            return F.cross_entropy(m(ids), LABELS)

        return RealModel(name, model, loss_fn, seed=seed)

    return factory


register("lstm")(_recurrent("lstm", nn.LSTM, 14))
register("gru")(_recurrent("gru", nn.GRU, 15))


class Seq2SeqTransformer(nn.Module):
    """Token embeddings -> nn.Transformer (1 encoder + 1 decoder layer) -> vocabulary logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.transformer = nn.Transformer(
            d_model=HIDDEN,
            nhead=2,
            num_encoder_layers=1,
            num_decoder_layers=1,
            dim_feedforward=32,
            dropout=0.1,
            batch_first=True,
        )
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, src: Tensor, tgt: Tensor, src_padding: Tensor) -> Tensor:
        """src: [batch, S], tgt: [batch, T] ids; src_padding: [batch, S] (True = pad)."""
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=torch.bool)
        out = self.transformer(
            self.embed(src),
            self.embed(tgt),
            tgt_mask=causal,
            src_key_padding_mask=src_padding,
            memory_key_padding_mask=src_padding,
            tgt_is_causal=True,
        )
        return self.head(out)


@register("nn_transformer")
def nn_transformer(dtype: torch.dtype) -> RealModel:
    torch.manual_seed(16)
    model = Seq2SeqTransformer().to(dtype).eval()
    src = _token_ids(2, 6, 16) * PADDING_MASK
    tgt = _token_ids(2, 5, 17)
    src_padding = PADDING_MASK == 0

    def loss_fn(m: nn.Module) -> Tensor:
        logits = m(src, tgt[:, :-1], src_padding)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tgt[:, 1:].reshape(-1))

    return RealModel("nn_transformer", model, loss_fn, seed=16)


MODEL_NAMES: list[str] = list(MODELS)
