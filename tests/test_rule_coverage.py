"""Every registered op rule is reached by some oracle-checked case or zoo model.

The corpus is the shared case tables the oracle tests run (``cases_ops``: ``CASES`` and
``FUNCTIONS``; ``cases_extensions`` with extensions off) and the model zoo (``zoo``), each run
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
from cases_ops import CASES, FUNCTIONS, case_leaves, function_leaf, weighted_loss
from torch._ops import OpOverload, OpOverloadPacket
from zoo import ZOO_NAMES
from zoo import build as build_zoo_model

import semipack
from semipack.messages import rule_for

pytestmark = pytest.mark.usefixtures("single_thread")

#: Registered ops the corpus does not reach, each with the reason. CUDA-only kernels cannot run
#: here. Every "gap" entry is a debt, not an exemption: an oracle case in ``cases_ops`` (or a
#: case table moved into the corpus) that reaches the op must remove it from this list, which
#: the test enforces ("reached only outside the corpus": a specialised oracle test reaches it,
#: but its cases are not yet in a shared table; "no test reaches": nothing in the suite does).
NO_TEST = "gap: no test reaches this rule yet"
OUTSIDE = "gap: reached outside the corpus only, by "
UNREACHED: dict[str, str] = {
    "aten._adaptive_avg_pool3d_backward.default": NO_TEST,
    "aten._cudnn_rnn_backward.default": OUTSIDE + "test_recurrent",
    "aten._grouped_mm.default": OUTSIDE + "test_grouped_mm",
    "aten._reshape_alias.default": NO_TEST,
    "aten._scaled_dot_product_cudnn_attention_backward.default": "CUDA-only SDPA kernel",
    "aten._scaled_dot_product_efficient_attention_backward.default": "CUDA-only SDPA kernel",
    "aten._scaled_dot_product_flash_attention_backward.default": "CUDA-only SDPA kernel",
    "aten._thnn_fused_gru_cell_backward.default": OUTSIDE + "test_recurrent",
    "aten._thnn_fused_lstm_cell_backward_impl.default": OUTSIDE + "test_recurrent",
    "aten._to_copy.default": OUTSIDE + "test_bad_inputs, test_float32_exact",
    "aten._upsample_nearest_exact1d_backward.default": NO_TEST,
    "aten._upsample_nearest_exact2d_backward.default": NO_TEST,
    "aten._upsample_nearest_exact3d_backward.default": NO_TEST,
    "aten._weight_norm_interface_backward.default": OUTSIDE + "test_weight_norm",
    "aten.adaptive_max_pool3d_backward.default": NO_TEST,
    "aten.add.Scalar": NO_TEST,
    "aten.add_.Tensor": NO_TEST,
    "aten.alias.default": NO_TEST,
    "aten.avg_pool3d_backward.default": NO_TEST,
    "aten.binary_cross_entropy_backward.default": NO_TEST,
    "aten.constant_pad_nd.default": NO_TEST,
    "aten.detach.default": OUTSIDE + "test_bad_inputs",
    "aten.diagonal.default": NO_TEST,
    "aten.diagonal_backward.default": NO_TEST,
    "aten.diagonal_scatter.default": NO_TEST,
    "aten.div_.Scalar": OUTSIDE + "test_float32_exact",
    "aten.div_.Tensor": NO_TEST,
    "aten.dot.default": NO_TEST,
    "aten.empty_like.default": NO_TEST,
    "aten.fill_.Scalar": NO_TEST,
    "aten.fill_.Tensor": NO_TEST,
    "aten.full_like.default": NO_TEST,
    "aten.gather.default": NO_TEST,
    "aten.hardsigmoid_backward.default": OUTSIDE + "test_model_zoo",
    "aten.hardswish_backward.default": OUTSIDE + "test_model_zoo",
    "aten.hardtanh_backward.default": NO_TEST,
    "aten.huber_loss_backward.default": NO_TEST,
    "aten.index.Tensor": NO_TEST,
    "aten.index_add.default": NO_TEST,
    "aten.index_add_.default": OUTSIDE + "test_recurrent",
    "aten.index_fill.int_Tensor": NO_TEST,
    "aten.index_fill_.int_Scalar": NO_TEST,
    "aten.index_fill_.int_Tensor": NO_TEST,
    "aten.index_put_.default": NO_TEST,
    "aten.isnan.default": OUTSIDE + "test_bad_inputs",
    "aten.lift_fresh.default": NO_TEST,
    "aten.log_sigmoid_backward.default": NO_TEST,
    "aten.logit_backward.default": NO_TEST,
    "aten.masked_fill.Tensor": NO_TEST,
    "aten.masked_fill_.Tensor": NO_TEST,
    "aten.max_pool3d_with_indices_backward.default": NO_TEST,
    "aten.miopen_rnn_backward.default": OUTSIDE + "test_recurrent",
    "aten.mish_backward.default": OUTSIDE + "test_float32_exact",
    "aten.mkldnn_rnn_layer_backward.default": OUTSIDE + "test_model_zoo, test_recurrent",
    "aten.mul_.Scalar": NO_TEST,
    "aten.mul_.Tensor": NO_TEST,
    "aten.mv.default": OUTSIDE + "test_bad_inputs",
    "aten.native_channel_shuffle.default": NO_TEST,
    "aten.native_dropout_backward.default": NO_TEST,
    "aten.neg_.default": NO_TEST,
    "aten.new_empty.default": NO_TEST,
    "aten.new_full.default": NO_TEST,
    "aten.nll_loss2d_backward.default": NO_TEST,
    "aten.pixel_shuffle.default": NO_TEST,
    "aten.reflection_pad2d_backward.default": NO_TEST,
    "aten.reflection_pad3d_backward.default": NO_TEST,
    "aten.repeat.default": NO_TEST,
    "aten.replication_pad1d_backward.default": NO_TEST,
    "aten.replication_pad3d_backward.default": NO_TEST,
    "aten.roll.default": NO_TEST,
    "aten.scatter_add_.default": NO_TEST,
    "aten.select_scatter.default": NO_TEST,
    "aten.slice_scatter.default": NO_TEST,
    "aten.smooth_l1_loss_backward.default": NO_TEST,
    "aten.soft_margin_loss_backward.default": OUTSIDE + "test_float32_exact",
    "aten.split.Tensor": NO_TEST,
    "aten.split_with_sizes.default": NO_TEST,
    "aten.sub.Scalar": NO_TEST,
    "aten.sub.Tensor": NO_TEST,
    "aten.triu.default": NO_TEST,
    "aten.unbind.int": NO_TEST,
    "aten.unfold.default": NO_TEST,
    "aten.unsafe_split.Tensor": NO_TEST,
    "aten.upsample_nearest3d_backward.default": NO_TEST,
    "aten.zero_.default": NO_TEST,
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

    def zoo_model(name: str) -> None:
        case = build_zoo_model(name)
        semipack.grad(case.loss(), case.leaves(), sr())

    for name in CASES:
        yield f"cases_ops.CASES[{name}]", functools.partial(op_case, name)
    for name in FUNCTIONS:
        yield f"cases_ops.FUNCTIONS[{name}]", functools.partial(function, name)
    for i, case in enumerate(EXTENSION_CASES):
        yield f"cases_extensions[{case.name}]", functools.partial(extension_case, i)
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
