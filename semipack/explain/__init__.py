"""Explaining a model with semiring values: readouts built on the backward (branch splits)."""

from .branches import Branches, branches

__all__ = ["Branches", "branches"]
