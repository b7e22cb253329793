"""Explaining a model with semiring values: readouts built on the backward (branch splits,
layer-by-layer flow, paths across layers)."""

from .branches import Branches, branches
from .layers import (
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

__all__ = [
    "AttentionLayer",
    "Branches",
    "LayerFlow",
    "LayerHop",
    "LayerRoute",
    "attention_layers",
    "branches",
    "explain_layers",
    "layer_routes",
    "plot_routes",
    "write_csv",
]
