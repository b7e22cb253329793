"""CUDA checks of the ninth to twenty-second sessions' (2026-11-26 to 28) changes, which have
CPU tests only.

Each listed test function runs with CUDA as the default device, so its models and inputs live
on the GPU (where the engine runs hooks on its device threads, not the caller's). Run by
check.sh's caller after the tests, with the same PYTHONPATH and LD_PRELOAD, from the repo root.
"""

import importlib
import sys
import traceback

import pytest
import torch

import semipack


class _Patch(pytest.MonkeyPatch):
    """A test's ``monkeypatch`` argument, undone after the check (see the loop below)."""


sys.path.insert(0, "tests")

CHECKS = [
    (
        "test_threads",
        "test_a_branch_readout_in_one_thread_leaves_another_threads_backward_alone",
        (),
    ),
    ("test_threads", "test_two_threads_passes_over_a_shared_parameter_are_refused_by_name", ()),
    # the README names this one a CPU-only guarantee; report what CUDA does
    ("test_threads", "test_plain_gradients_of_the_same_model_in_another_thread_are_left_alone", ()),
    ("test_api", "test_a_second_backward_through_a_freed_graph_raises_as_in_pytorch", ()),
    (
        "test_api",
        "test_a_parameter_unfrozen_or_frozen_inside_the_block_is_seen_at_each_pass",
        (True,),
    ),
    (
        "test_api",
        "test_a_parameter_unfrozen_or_frozen_inside_the_block_is_seen_at_each_pass",
        (False,),
    ),
    (
        "test_bad_inputs",
        "test_reentrant_checkpoints_nested_past_the_engines_depth_limit_keep_their_messages",
        (),
    ),
    (
        "test_branches",
        "test_a_copy_or_checkpoint_made_inside_the_block_carries_no_live_hook",
        ("branches",),
    ),
    (
        "test_branches",
        "test_a_copy_or_checkpoint_made_inside_the_block_carries_no_live_hook",
        ("per_sample",),
    ),
    # the tenth session's
    (
        "test_per_sample",
        "test_a_weight_computed_from_a_buffer_is_refused_even_when_its_rows_match_the_batch",
        (),
    ),
    (
        "test_per_sample",
        "test_a_value_computed_from_a_parameter_is_refused_where_a_use_has_no_rule",
        (),
    ),
    ("test_per_sample", "test_rows_equal_single_examples", ("gain_on_the_input", "max_prod")),
    (
        "test_bad_inputs",
        "test_semipack_grad_inside_a_torch_func_transform_is_refused_by_name",
        ("grad",),
    ),
    (
        "test_bad_inputs",
        "test_semipack_grad_inside_a_torch_func_transform_is_refused_by_name",
        ("vmap",),
    ),
    ("test_bad_inputs", "test_a_hook_on_an_autograd_node_receives_the_message_as_documented", ()),
    # the eleventh to seventeenth sessions': in-place accumulation and its rollback, readouts
    # that fail half-way, hook order, per-sample expands and casts, subnormal convolutions
    (
        "test_bad_inputs",
        "test_a_failed_pass_puts_back_the_gradients_leaves_accumulated_in_place",
        (),
    ),
    (
        "test_bad_inputs",
        "test_a_gradient_that_cannot_be_written_in_place_does_not_stop_the_rollback",
        (),
    ),
    ("test_memory_release", "test_a_pass_that_fails_in_its_readouts_changes_no_gradient", (False,)),
    ("test_memory_release", "test_a_pass_that_fails_in_its_readouts_changes_no_gradient", (True,)),
    (
        "test_memory_release",
        "test_a_readout_that_fails_while_writing_leaves_no_half_new_value",
        ("after", True),
    ),
    (
        "test_hook_order",
        "test_parameter_hooks_fire_in_a_plain_backwards_order",
        ("cnn", semipack.MaxProd),
    ),
    (
        "test_hook_order",
        "test_parameter_hooks_fire_in_a_plain_backwards_order",
        ("bert", semipack.Entropy),
    ),
    (
        "test_hook_order",
        "test_training_with_noise_drawing_hooks_keeps_its_trajectory_under_the_monitor",
        (),
    ),
    (
        "test_extensions",
        "test_multihead_attention_row_with_every_key_masked_runs_as_pytorch",
        (semipack.MaxProd(),),
    ),
    ("test_per_sample", "test_a_bias_expanded_as_the_batched_input_has_rows", ()),
    ("test_per_sample", "test_a_gain_computed_through_a_cast_has_each_examples_rows", ("entropy",)),
    (
        "test_per_sample",
        "test_negative_dims_views_and_a_number_divisor_give_each_examples_rows",
        (),
    ),
    (
        "test_no_underflow",
        "test_a_weight_near_the_smallest_subnormal_keeps_its_paths_in_a_convolution",
        ("conv2d",),
    ),
    ("test_more_ops", "test_int32_ids_give_what_int64_ids_give", ({"per_sample": True},)),
    ("test_monitor", "test_a_step_with_nan_values_records_unknowns_not_a_moved_top_path", ()),
    # the eighteenth session's: non-reentrant checkpoints, merged batches, masked writes
    (
        "test_bad_inputs",
        "test_a_non_reentrant_checkpoint_recomputes_its_region_once_per_backward",
        ("batch_norm", True),
    ),
    (
        "test_bad_inputs",
        "test_a_non_reentrant_checkpoint_recomputes_its_region_once_per_backward",
        ("spectral_norm", False),
    ),
    (
        "test_monitor",
        "test_training_through_a_non_reentrant_checkpoint_is_training_without_the_monitor",
        (),
    ),
    ("test_per_sample", "test_gpt2_and_opt_layers_on_the_merged_batch", ("gpt2",)),
    ("test_per_sample", "test_gpt2_and_opt_layers_on_the_merged_batch", ("opt",)),
    (
        "test_per_sample",
        "test_zeros_written_through_a_padding_mask_keep_each_example_on_its_row",
        ("rebuilt",),
    ),
    ("test_per_sample", "test_wav2vec2_with_a_padding_mask_has_each_examples_rows", ()),
    (
        "test_branches",
        "test_touches_that_add_no_edge_inside_the_module_are_no_branches",
        ("type_as",),
    ),
    ("test_branches", "test_a_use_by_a_custom_function_is_named_as_in_no_branch", (False,)),
    (
        "test_bad_inputs",
        "test_a_call_given_back_to_the_plain_path_inside_a_checkpoint_is_counted_once",
        (),
    ),
    ("test_float32_exact", "test_expm1_and_logaddexp_keep_the_edges_their_formulas_lose", ()),
    (
        "test_api",
        "test_a_retained_tensor_whose_gradient_is_a_made_zero_has_no_path",
        (semipack.MaxProd, 0.0),
    ),
    # the nineteenth session's: explain rows per example, per-sample refusals naming the batch
    ("test_explain_layers", "test_token_labels_per_example", ()),
    (
        "test_per_sample",
        "test_rows_are_checked_against_the_batch_of_the_call_the_backward_reached",
        (),
    ),
    (
        "test_per_sample",
        "test_refusals_name_the_argument_taken_as_the_batch",
        ("add", (4, 5), (3, 4, 5)),
    ),
    (
        "test_per_sample",
        "test_refusals_name_the_argument_taken_as_the_batch",
        ("scale", (1,), (3, 5)),
    ),
    # the twentieth session's: elementwise kernels compiled once per dtype, whatever the shape
    # (their comparison with the eager forms is a CUDA test of its own since 2026-11-28)
    (
        "test_kernels_rowwise",
        "test_elementwise_kernels_compile_once_for_every_pattern_of_size_one_dims",
        (),
    ),
]
# the twentieth session's: norm layers' gains and biases from one fused reduction (inductor on
# CUDA: triton), with the recomputed channels and extreme inputs
_NORM_ALGEBRAS = ("MaxProd", "LogSum", "LogCount", "Entropy")
CHECKS += [
    (
        "test_kernels_rowwise",
        "test_per_channel_gain_and_bias_messages_equal_the_float64_definition",
        (name, compiled, _Patch()),
    )
    for name in _NORM_ALGEBRAS
    for compiled in (True, False)
]
CHECKS += [
    (
        "test_kernels_rowwise",
        "test_norm_layers_gains_and_biases_equal_the_generic_ops",
        (name, train),
    )
    for name in ("MaxProd", "LogSum", "Entropy")
    for train in (True, False)
]
CHECKS += [
    (
        "test_kernels_rowwise",
        "test_per_channel_gains_of_extreme_inputs_are_the_generic_ops",
        (name, case),
    )
    for name in _NORM_ALGEBRAS
    for case in ("huge activations", "subnormal shifted terms", "an infinite entry", "a NaN entry")
]

# the twenty-second session's: Entropy's weight message in two sums ([e·r; e] stacked along the
# batch), in every layout, and a conv net through it
_SHARED_SHIFT = "test_kernels_shared_shift"
CHECKS += [
    (
        _SHARED_SHIFT,
        "test_conv_messages_through_torch_convolution_match_the_window_maps",
        (semipack.Entropy(), geometry, layout, _Patch()),
    )
    for geometry in ("conv2d", "strided_dilated", "conv1d", "depthwise")
    for layout in ("contiguous", "channels_last", "batch_inner", "message_batch_inner")
]
CHECKS += [
    (_SHARED_SHIFT, "test_linear_messages_equal_per_product_shifts", (sr, 10.0, rows, _Patch()))
    for sr in (semipack.Entropy(), semipack.LogSum())
    for rows in (6, 3)
]
CHECKS += [
    (
        _SHARED_SHIFT,
        "test_a_large_message_in_another_layout_than_the_input_gives_the_reference_values",
        (layout,),
    )
    for layout in ("channels_last", "batch_inner")
]
CHECKS += [
    (
        _SHARED_SHIFT,
        "test_a_conv_net_gives_the_three_sum_values_with_its_weight_sums_stacked",
        (train, _Patch()),
    )
    for train in (True, False)
]

torch.set_default_device("cuda")
for module, test, args in CHECKS:
    name = f"{module}.{test}{args if args else ''}"
    try:
        getattr(importlib.import_module(module), test)(*args)
        print("PASS", name, flush=True)
    except BaseException as error:  # report every failure, run the rest
        last = traceback.format_exception(error)[-1].strip()
        print("FAIL", name, "->", last[:400], flush=True)
    finally:
        for arg in args:
            if isinstance(arg, pytest.MonkeyPatch):
                arg.undo()
