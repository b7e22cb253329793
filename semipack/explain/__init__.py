"""Explaining a model with semiring values: readouts built on the backward (branch splits,
their values pooled by token type, layer-by-layer flow, paths across layers)."""

from .branches import Branches, branches
from .layers import (
    FAMILIES,
    AttentionLayer,
    LayerFlow,
    LayerHop,
    LayerRoute,
    attention_layers,
    explain_layers,
    layer_routes,
    plot_routes,
    write_csv,
)
from .token_types import TokenTypeTable, attention_branch

__all__ = [
    "FAMILIES",
    "AttentionLayer",
    "Branches",
    "LayerFlow",
    "LayerHop",
    "LayerRoute",
    "TokenTypeTable",
    "attention_branch",
    "attention_layers",
    "branches",
    "explain_layers",
    "layer_routes",
    "plot_routes",
    "write_csv",
]
