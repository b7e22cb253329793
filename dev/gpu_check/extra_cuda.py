"""CUDA checks of the ninth and tenth sessions' (2026-11-26) trust fixes, which have CPU tests
only.

Each listed test function runs with CUDA as the default device, so its models and inputs live
on the GPU (where the engine runs hooks on its device threads, not the caller's). Run by
check.sh's caller after the tests, with the same PYTHONPATH and LD_PRELOAD, from the repo root.
"""

import importlib
import sys
import traceback

import torch

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
    ("test_per_sample", "test_a_pruned_weight_is_refused_by_name", ()),
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
