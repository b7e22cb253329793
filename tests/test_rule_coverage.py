"""Every registered op rule is reached by some oracle-checked case or zoo model.

The corpus is the shared case tables the oracle tests run (``cases_ops``: ``CASES`` and
``FUNCTIONS``; ``cases_extensions`` with extensions off; ``cases_kernels``: grouped matrix
products and fused weight norm) and the model zoo (``zoo``), each run
once with MaxProd while every rule in the table counts its calls (wrappers registered inside
``semipack.scoped_rules()``, so the table is restored). The corpus runs in this one test, so the
check holds however pytest-xdist splits the suite.

An op may stay unreached only if it is listed in ``UNREACHED`` with its reason; the list must
name registered ops that really are unreached, so it cannot go stale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from cases_extensions import CASES as EXTENSION_CASES
from cases_extensions import weighted_loss as extension_loss
from cases_kernels import GROUPED_MM, WEIGHT_NORM, grouped_mm_loss, weight_norm_losses
from cases_ops import CASES, FUNCTIONS, case_leaves, function_leaf, weighted_loss
from torch._ops import OpOverload, OpOverloadPacket
from zoo import ZOO_NAMES
from zoo import build as build_zoo_model

import semipack
from semipack.messages import rule_for

pytestmark = pytest.mark.usefixtures("single_thread")

#: Registered ops the corpus does not reach, each with the reason: kernels PyTorch has for CUDA
#: (or ROCm) only, which no CPU backward can call. Their rules are still checked on the CPU where
#: a test can hand them messages (named in the reason). Any other op needs an oracle case in
#: ``cases_ops`` (or a case table moved into the corpus), which the test enforces.
NO_CPU_KERNEL = "no CPU kernel, so no CPU backward calls it: "
OUTSIDE = "reached outside the corpus only, by "
UNREACHED: dict[str, str] = {
    "aten.cudnn_batch_norm_backward.default": NO_CPU_KERNEL
    + "cuDNN train-mode batch norm; test_kernels_rowwise calls the rule with state-only "
    "messages against the native rule, test_cuda runs it on a GPU",
    "aten.miopen_batch_norm_backward.default": NO_CPU_KERNEL
    + "MIOpen train-mode batch norm; test_kernels_rowwise calls the rule with state-only "
    "messages against the native rule",
    "aten._cudnn_rnn_backward.default": NO_CPU_KERNEL
    + "cuDNN RNN; the rule is called with state-only messages by test_recurrent",
    "aten._fused_rms_norm_backward.default": NO_CPU_KERNEL
    + "the fused RMS norm (F.rms_norm on a GPU; the CPU records the composite); "
    "test_kernels_rowwise calls the rule with state-only messages against the CPU composite "
    "and runs it inside a graph through a stand-in node",
    "aten._scaled_dot_product_cudnn_attention_backward.default": "CUDA-only SDPA kernel",
    "aten._scaled_dot_product_efficient_attention_backward.default": "CUDA-only SDPA kernel",
    "aten._scaled_dot_product_flash_attention_backward.default": "CUDA-only SDPA kernel",
    "aten._thnn_fused_gru_cell_backward.default": NO_CPU_KERNEL
    + "CUDA fused GRU cell; test_recurrent emulates the cell on the CPU for semipack.grad",
    "aten._thnn_fused_lstm_cell_backward_impl.default": NO_CPU_KERNEL
    + "CUDA fused LSTM cell; test_recurrent emulates the cell on the CPU for semipack.grad",
    "aten.miopen_rnn_backward.default": NO_CPU_KERNEL
    + "ROCm RNN; the rule is called with state-only messages by test_recurrent",
    # oneDNN's RNN layer runs on the CPU but in float32 only, so it needs float32 tolerances and
    # test_recurrent's Case machinery; a gap until those cases move to a shared table
    "aten.mkldnn_rnn_layer_backward.default": OUTSIDE + "test_model_zoo, test_recurrent",
    # sgn of a real input builds an efficient zero tensor, which the brute-force oracle cannot
    # read: its values are checked against sign's (oracle-tested) and autograd's
    "aten.to.dtype_layout": OUTSIDE + "test_more_ops (test_sgn_of_a_real_input_is_sign)",
}


def _op(name: str) -> OpOverload | OpOverloadPacket:
    """The op object registered under ``name`` ("aten.mm.default" or a packet "aten.squeeze")."""
    parts = name.split(".")
    packet = getattr(torch.ops.aten, parts[1])
    return getattr(packet, parts[2]) if len(parts) == 3 else packet


@contextmanager
def counting_rules() -> Iterator[set[str]]:
    """Inside the block every registered rule records its op's name in the yielded set."""
    reached: set[str] = set()

    def counted(name: str, rule: Callable) -> Callable:
        @functools.wraps(rule)
        def wrapper(*args, **kwargs):
            reached.add(name)
            return rule(*args, **kwargs)

        return wrapper

    with semipack.scoped_rules():
        for name in semipack.registered_ops():
            op = _op(name)
            # a packet's rule is what its overloads without a rule of their own look up
            overload = op if isinstance(op, OpOverload) else getattr(op, op.overloads()[0])
            semipack.register_rule(op, replace=True)(counted(name, rule_for(overload)))
        yield reached


def _corpus() -> Iterator[tuple[str, Callable[[], None]]]:
    sr = semipack.MaxProd

    def op_case(name: str) -> None:
        leaves = case_leaves(CASES[name])
        semipack.grad(weighted_loss(CASES[name], leaves), leaves, sr())

    def function(name: str) -> None:
        fn, shape = FUNCTIONS[name]
        x = function_leaf(*shape)
        semipack.grad(fn(x).sum(), x, sr())

    def extension_case(index: int) -> None:
        case = EXTENSION_CASES[index]
        model, inputs = case.build(), case.inputs()
        with semipack.extend(model, sr(), extensions=False):
            extension_loss(model, inputs).backward()

    def grouped_mm(name: str) -> None:
        loss, leaves = grouped_mm_loss(name)
        semipack.grad(loss, leaves, sr())

    def weight_norm(dim: int, g_shape) -> None:
        fused, _, leaves = weight_norm_losses(dim, g_shape)
        semipack.grad(fused, leaves, sr())

    def zoo_model(name: str) -> None:
        case = build_zoo_model(name)
        semipack.grad(case.loss(), case.leaves(), sr())

    for name in CASES:
        yield f"cases_ops.CASES[{name}]", functools.partial(op_case, name)
    for name in FUNCTIONS:
        yield f"cases_ops.FUNCTIONS[{name}]", functools.partial(function, name)
    for i, case in enumerate(EXTENSION_CASES):
        yield f"cases_extensions[{case.name}]", functools.partial(extension_case, i)
    for name in GROUPED_MM:
        yield f"cases_kernels.GROUPED_MM[{name}]", functools.partial(grouped_mm, name)
    for dim, g_shape in WEIGHT_NORM:
        yield f"cases_kernels.WEIGHT_NORM[{dim}]", functools.partial(weight_norm, dim, g_shape)
    for name in ZOO_NAMES:
        yield f"zoo[{name}]", functools.partial(zoo_model, name)


def test_every_registered_rule_is_reached() -> None:
    registered = set(semipack.registered_ops())
    assert not set(UNREACHED) - registered, "UNREACHED lists ops without a rule"
    with counting_rules() as reached:
        for _, run in _corpus():
            run()
    missing = sorted(registered - reached - set(UNREACHED))
    assert not missing, (
        f"{len(missing)} of {len(registered)} registered rules are reached by no oracle case "
        "(add a case to tests/cases_ops.py, or list a CUDA-only op in UNREACHED):\n  "
        + "\n  ".join(missing)
    )
    stale = sorted(set(UNREACHED) & reached)
    assert not stale, f"UNREACHED lists ops that a case reaches now: {stale}"
