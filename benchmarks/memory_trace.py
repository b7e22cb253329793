"""Resident memory at every autograd node of one backward: where a semiring backward's peak is.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/memory_trace.py bert_layer LogSum
    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/memory_trace.py bert_layer plain

For each node that runs (in order) it prints the resident memory above the pre-forward level
when the node starts ("at start") and the high-water mark from then until the next node starts
("peak inside": the node's own work, and the engine's adding of its results into the next
nodes' inputs), read from Linux's /proc/self/status. The gap between the two is the node's
own temporaries; "at start" is what the backward holds between nodes (saved activations,
gradients, messages, results). Only pre-hooks are set: a hook that runs after a node makes
the engine hold the node's incoming gradient until then, and activations then no longer write
into it (``messages.donation``), so the trace would show another backward than the one it
measures. Set the mmap threshold as shown so that freed tensors go back to the OS and the
numbers follow live tensors (as in benchmarks/run.py's memory column).
"""

from __future__ import annotations

import argparse
import gc

from cases import WORKLOADS
from torch.autograd.graph import Node

import semipack


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _graph_nodes(root: Node | None) -> list[Node]:
    seen: dict[Node, None] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen[node] = None
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(seen)


def _before(node: Node, base: float, rows: list):
    """A pre-hook: closes the previous row with the high-water mark since it started, and
    opens this node's row with the memory now."""

    def hook(grads):
        _close(rows, base)
        rows.append([node.name(), _status_mb("VmRSS:") - base, None])
        _reset_high_water_mark()

    return hook


def _close(rows: list, base: float) -> None:
    if rows and rows[-1][2] is None:
        rows[-1][2] = _status_mb("VmHWM:") - base


def trace(
    workload_name: str, semiring_name: str, extensions: bool
) -> list[tuple[str, float, float]]:
    """[(node name, MB at start, MB peak until the next node starts)] for one backward after a
    warm-up run (the last node's peak runs to the end of the backward: the leaves' results)."""
    workload = WORKLOADS[workload_name]()
    rows: list[list] = []
    for _ in range(2):  # the first pass compiles kernels and fills caches
        rows.clear()
        for leaf in workload.leaves():
            leaf.grad = None
            if hasattr(leaf, "semiring_grad"):
                del leaf.semiring_grad
        gc.collect()
        base = _status_mb("VmRSS:")
        context = None
        if semiring_name != "plain":
            sr = getattr(semipack, semiring_name)()
            context = semipack.extend(workload.model, sr, extensions=extensions)
            context.__enter__()
        loss = workload.loss()
        handles = []  # removed after the pass: AccumulateGrad nodes outlive the graph
        for node in _graph_nodes(loss.grad_fn):
            handles.append(node.register_prehook(_before(node, base, rows)))
        loss.backward()
        _close(rows, base)
        for handle in handles:
            handle.remove()
        del loss, handles  # nodes keep their saved state alive
        if context is not None:
            context.__exit__(None, None, None)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("semiring", help="a semipack semiring class name, or 'plain'")
    parser.add_argument("--generic", action="store_true", help="extend(..., extensions=False)")
    parser.add_argument("--min-mb", type=float, default=1.0, help="hide nodes below this peak")
    args = parser.parse_args()
    rows = trace(args.workload, args.semiring, not args.generic)
    print(f"{'at start':>9} {'peak inside':>12}  node   (MB above the pre-forward level)")
    for name, start, peak in rows:
        if peak - start >= args.min_mb or name.endswith("FunctionBackward"):
            print(f"{start:9.1f} {peak:12.1f}  {name}")
    top = max(rows, key=lambda row: row[2])
    held = max(row[1] for row in rows)
    print(f"peak {top[2]:.1f} MB inside {top[0]}; most held between nodes {held:.1f} MB")


if __name__ == "__main__":
    main()
