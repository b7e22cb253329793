"""Errors semipack raises instead of returning a silently wrong number, and the one check
that must pass before anything else: the PyTorch version."""

from __future__ import annotations

import contextlib
import os
import re
import sys

import torch

#: The oldest PyTorch semipack runs on: the backward driver, the extensions and the module
#: names all watch autograd nodes as they are created (``torch.autograd.graph.
#: node_creation_hook``, new in 2.14; 2.13 does not have it).
MINIMUM_TORCH = "2.14"

if not hasattr(torch.autograd.graph, "node_creation_hook"):
    raise ImportError(
        f"semipack needs torch>={MINIMUM_TORCH} (it uses torch.autograd.graph."
        f"node_creation_hook); this is torch {torch.__version__}. Install a newer torch, "
        f"for example: pip install 'torch>={MINIMUM_TORCH}'"
    )


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function calling this one that points
    at the user's line: the first frame outside semipack and ``contextlib`` (a block's exit
    runs through it). A fixed level points into semipack when the warning's function is
    reached by another way (a Monitor's step runs ``branches`` for its ``splits``)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIR)
        or frame.f_code.co_filename == contextlib.__file__
    ):
        frame, level = frame.f_back, level + 1
    return level


class SemipackError(RuntimeError):
    """Base class of semipack's errors."""


#: How a reason ends when the rule that ran is at fault, not a missing one.
RULE_DEFECT = "(a defect in the rule)"
#: How a reason ends when no rule could exist: the op makes or takes complex values.
COMPLEX_VALUES = "(semiring values are defined on real local derivatives)"


class UnsupportedOpError(SemipackError):
    """An aten op reached a semiring message and semipack has no rule for it.

    ``op`` is the aten overload (e.g. ``aten.cumsum.default``), ``node`` the autograd node whose
    backward called it (e.g. ``CumsumBackward0``) and ``module`` the dotted path of the module
    whose forward created that node, when the forward ran inside ``semipack.extend``.
    """

    def __init__(
        self,
        op: str,
        node: str | None,
        module: str | None,
        reason: str = "",
        root: str | None = None,
    ) -> None:
        self.op, self.node, self.module = op, node, module
        where = f"in the backward of {node}" if node else "outside any autograd node"
        if node is None:  # outside the backward no module made the call: nothing to name
            origin = ""
        elif module is not None:
            named = f" ({root})" if root else ""
            origin = (
                f", created by module '{module}'"
                if module
                else f", created by the root module{named}"
            )
        else:
            origin = (
                ", module unknown (run the forward inside semipack.extend(model, ...) to name it)"
            )
        hint = f"@semipack.register_rule(torch.ops.{op}) (see 'Adding an op rule' in the README)"
        if "_sparse" in op and not reason:  # a sparse gradient: nothing to register
            message = (
                f"semipack cannot carry the sparse gradient that {op} builds {where}{origin}: "
                "the generic rules carry dense gradients only. An nn.Embedding built with "
                "sparse=True runs inside semipack.extend through its extension (the default "
                "extensions=True); elsewhere build the layer with sparse=False."
            )
        elif reason.endswith(COMPLEX_VALUES):  # nothing to register
            message = f"semipack cannot carry {op} {where}{origin}: {reason}."
        elif reason.endswith(RULE_DEFECT):  # a rule ran and returned something wrong
            message = (
                f"the semiring rule for {op} {where}{origin}: {reason}. Fix that rule (see "
                "'Adding an op rule' in the README)."
            )
        elif reason:
            message = (
                f"semipack cannot compute semiring messages for {op} {where}{origin}: "
                f"{reason}. If the op has a semiring meaning here, register a rule with {hint}."
            )
        else:
            register = f"Register one with {hint}."
            if node and _one_step_of(op, node):
                register = (
                    f"{op} is not {node}'s own backward op: where it is one step of that "
                    f"node's formula, a rule for it would apply to every use of {op}, so write "
                    "the forward as a custom op with its own backward (see 'Adding an op rule' "
                    f"in the README), or register a rule with {hint.split(' (see')[0]} if it "
                    "has one meaning everywhere."
                )
            hook = (
                ""  # the node's own backward op: no hook of the user's calls that
                if node and _own_backward_op(op, node)
                else " (A hook on a tensor created before entering semipack.extend receives "
                "semiring messages and runs inside that node: if the op is the hook's, set the "
                "hook up inside the block, where it sees the regular gradient.)"
            )
            message = f"semipack has no semiring rule for {op} {where}{origin}. {register}{hook}"
        super().__init__(message)


def _own_backward_op(op: str, node: str) -> bool:
    """Whether ``op`` is a built-in node's own backward op (``aten._embedding_bag_backward`` in
    ``EmbeddingBagBackward0``): the op lacks a rule, and the hint about hooks would mislead."""
    return re.fullmatch(r"(.+)Backward\d+", node) is not None and "backward" in op


def _one_step_of(op: str, node: str) -> bool:
    """Whether ``op`` is a general op inside a built-in node's backward formula rather than
    the node's own backward op (``aten.abs`` in ``LogcumsumexpBackward0``, against
    ``aten.grid_sampler_2d_backward`` in ``GridSampler2DBackward0``): a rule for it would
    change every use of it (trial 68: the advice to register one misled)."""
    built_in = re.fullmatch(r"(.+)Backward\d+", node)  # a custom Function's ends in Backward
    if built_in is None or "backward" in op:
        return False  # a custom Function's node, or the node's own backward op
    forward = built_in.group(1).lower()
    name = op.removeprefix("aten.").split(".")[0].lstrip("_").replace("_", "")
    return name not in forward and forward not in name


class StateShapeError(SemipackError):
    """A semiring state whose shape is not its message's (the regular gradient's): a defect of
    the rule or extension that built it. semipack never broadcasts a state, which would hand one
    entry's paths to every entry it is copied to."""


class ModuleHooksError(SemipackError):
    """Modules with full backward hooks or backward pre-hooks (BackPACK's extensions among
    them) are in a pass that computes no regular gradient, which those hooks receive."""


class MessageLostError(SemipackError):
    """A plain gradient reached a place where a semiring message was required."""


class PerSampleError(SemipackError):
    """Per-sample semiring values (``extend(..., per_sample=True)``) cannot be computed for this
    model or semiring: an op without a per-sample rule touches a parameter, the model mixes
    examples (batch norm in train mode, a reduction over the batch), or the semiring records
    paths. Raised before the pass writes anything."""
