"""Per-module extensions: fused semiring backwards and named sites for supported layers.

Lookup is by exact module class (subclasses qualify when they keep the supported forward):
``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d``, ``nn.LayerNorm``, ``nn.Embedding``; attention is
extended at the function level (``F.scaled_dot_product_attention``) and through transformers'
attention registry ("eager" attention of any Hugging Face model).
"""

import torch.nn.functional as F

from . import conv, embedding, layer_norm, linear, multihead  # noqa: F401  (registrations)
from .attention import AttentionFunction, semiring_sdpa
from .base import ModuleExtension, extension_for, installed, register_extension, supported_modules
from .hf import eager_attention_routed

#: torch functions rerouted to their extension while ``semipack.extend`` is active.
FUNCTION_EXTENSIONS = {F.scaled_dot_product_attention: semiring_sdpa}

__all__ = [
    "FUNCTION_EXTENSIONS",
    "AttentionFunction",
    "ModuleExtension",
    "eager_attention_routed",
    "extension_for",
    "installed",
    "register_extension",
    "supported_modules",
]
