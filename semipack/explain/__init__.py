"""Explaining a model with semiring values: readouts built on the backward (branch splits, and
their values pooled by token type)."""

from .branches import Branches, branches
from .token_types import TokenTypeTable, attention_branch

__all__ = ["Branches", "TokenTypeTable", "attention_branch", "branches"]
