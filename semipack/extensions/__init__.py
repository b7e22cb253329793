"""Extensions: fused semiring backwards and named sites for supported torch functions.

While ``semipack.extend`` is active, calls of ``F.linear``, ``x @ W`` with a 2-D parameter ``W``
(``torch.matmul``) and ``torch.addmm(b, x, W)`` with one, ``torch.conv1d``/``torch.conv2d``,
``F.layer_norm``, ``F.embedding``, ``F.multi_head_attention_forward`` and
``F.scaled_dot_product_attention`` (from any module or user code) are routed to their extension,
and Hugging Face "eager" attention is routed through transformers' attention registry.

Each extension is an ``ExtensionFunction`` subclass (the template owns the backward) stating its
messages, the inputs they read and its site names, plus a handler registered with ``extends``
(for good) or ``extending`` (for a block).
"""

from . import conv, embedding, layer_norm, linear, matmul, multihead  # noqa: F401  (registrations)
from .attention import AttentionFunction, semiring_sdpa
from .base import (
    FUNCTION_EXTENSIONS,
    BackwardCall,
    ExtensionFunction,
    InnerGraph,
    extending,
    extends,
)
from .hf import eager_attention_routed

__all__ = [
    "FUNCTION_EXTENSIONS",
    "AttentionFunction",
    "BackwardCall",
    "ExtensionFunction",
    "InnerGraph",
    "eager_attention_routed",
    "extending",
    "extends",
    "semiring_sdpa",
]
