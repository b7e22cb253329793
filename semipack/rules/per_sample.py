"""Per-sample parameter messages (``extend(..., per_sample=True)``): which autograd nodes may
touch a parameter, and which nodes mix the examples of a batch.

A parameter's message is a semiring contraction over the batch: for a linear weight,
``W[o, i] = ⊕_{n, t} m[n, t, o] ⊗ x[n, t, i]``. Per-sample values keep the batch axis instead
(``rows[n, o, i] = ⊕_t ...``). Only a node that knows its batch axis can do that, so each such
node is registered here by its autograd node name; the per-sample pass refuses (before it runs)
a graph in which any other node feeds a parameter of the model, and a graph with a node that
mixes examples (``mixing_reason``): there a row would no longer be "what example n alone gives".

The built-in entries are the module extensions (``extensions/``), which compute their rows
themselves in their backward (``ExtensionFunction.per_sample``); they register with
``register_per_sample`` next to their definition.
"""

from __future__ import annotations

import re

#: autograd node name -> what computes its rows (a short description for error messages).
PER_SAMPLE_NODES: dict[str, str] = {}


def register_per_sample(node_name: str, description: str = "") -> None:
    """Declare that the autograd node ``node_name`` reports per-sample rows for every parameter
    it feeds (see ``ExtensionFunction.per_sample``)."""
    PER_SAMPLE_NODES[node_name] = description or node_name


def has_per_sample_rule(node_name: str) -> bool:
    """Whether ``node_name`` computes per-sample rows for the parameters it feeds."""
    return node_name in PER_SAMPLE_NODES


#: Reductions whose saved ``dim`` says which axes they reduce (``SumBackward1``, ...).
_REDUCTIONS = {
    "Sum",
    "Mean",
    "Nansum",
    "Nanmean",
    "Amax",
    "Amin",
    "Max",
    "Min",
    "Std",
    "Var",
    "StdMean",
    "VarMean",
    "Logsumexp",
    "Prod",
    "Norm",
    "LinalgVectorNorm",
    "Cumsum",
    "Cumprod",
    "Cummax",
    "Cummin",
    "Logcumsumexp",
    "Softmax",
    "LogSoftmax",
    "Median",
    "Nanmedian",
}
_NODE_NAME = re.compile(r"^(?P<op>[A-Za-z]+?)Backward\d*$")


def _signed(d: int) -> int:
    """A dim as autograd saves it (negative dims wrap around as unsigned 64-bit integers)."""
    return d - 2**64 if d >= 2**63 else d


def mixing_reason(node) -> str | None:
    """Why ``node`` (an autograd node inside the model) mixes the examples of the batch, or
    None. Batch norm in train mode normalises over the batch; a reduction over dim 0 of a
    tensor with more than one row combines examples before the loss."""
    name = node.name()
    if "BatchNorm" in name and getattr(node, "_saved_training", False):
        saved = getattr(node, "_saved_input", None)
        if saved is None or saved.dim() == 0 or saved.shape[0] > 1:
            return "batch norm in train mode normalises over the batch (use eval mode)"
        return None
    match = _NODE_NAME.match(name)
    if match is None or match.group("op") not in _REDUCTIONS:
        return None
    dims = getattr(node, "_saved_dim", None)
    sizes = getattr(node, "_saved_self_sym_sizes", None)
    if dims is None or sizes is None or len(sizes) < 2 or sizes[0] <= 1:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    ndim = len(sizes)
    if any(_signed(d) % ndim == 0 for d in dims):
        return f"it reduces over dim 0 (the batch) of a tensor of shape {tuple(sizes)}"
    return None


__all__ = ["PER_SAMPLE_NODES", "has_per_sample_rule", "mixing_reason", "register_per_sample"]
