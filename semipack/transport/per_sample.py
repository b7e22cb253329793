"""Per-sample semiring values (``extend(..., per_sample=True)``): the graph check before the
pass, the rows the nodes report during it, and ``p.semiring_grad_batch`` after it.

Row ``n`` of a parameter is the semiring sum over the paths that pass through example ``n``'s
entries (the batch is dim 0 of the model input). Nodes registered in ``rules.per_sample`` (the
module extensions) compute their parameters' rows in their backward and ``add`` them here; the
semiring sum over the rows is the parameter's ``semiring_grad``. Where the batch is in each
tensor of the forward, and which layers' dim 0 holds examples, ``batch_following`` records;
``check_graph`` reads it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.hooks
from torch import Tensor

from ..errors import PerSampleError
from ..graph.provenance import MODULE_KEY
from ..messages.message import Message
from ..rules.per_sample import (
    BATCHED_KEY,
    FACTORS_KEY,
    INSIDE_CALL_KEY,
    PARAMETER_STEPS,
    batch_expand_rows,
    expanded_over_batch,
    has_per_sample_rule,
    mixing_reason,
    parameter_step,
    row_rule,
    unbatched_operand,
)
from ..semirings.base import Semiring, State
from ..semirings.k_best import KBest
from ..semirings.product import Product
from .batch_following import (
    LOST_BY_KEY,
    MISPLACED_KEY,
    SEEN_KEY,
    BatchedTensors,
    _module_name,
    how_lost,
)
from .passes import in_carry_pass

SEMIRING_GRAD_BATCH = "semiring_grad_batch"
#: With ``keep_state=True``: the rows' states themselves (``[N, *p.shape]`` per component).
SEMIRING_STATE_BATCH = "semiring_state_batch"


def check_semiring(sr: Semiring) -> None:
    """Refuse semirings whose per-sample rows have no meaning here (path records)."""
    factors = sr.semirings if isinstance(sr, Product) else (sr,)
    for s in factors:
        if s.records_paths or isinstance(s, KBest):
            raise PerSampleError(
                f"per-sample values are not supported for {s.name}: its paths are recorded "
                "once per pass, not per example. Run MaxProd per sample for the best path "
                "values, or TopPath on one example at a time for the paths"
            )


def _module_of(node) -> str | None:
    return _module_name(node.metadata.get(MODULE_KEY))


def check_graph(
    roots: Sequence[Tensor],
    params: dict[int, str],
    batches: frozenset[int] = frozenset(),
    following: BatchedTensors | None = None,
) -> tuple[list[tuple], dict[int, tuple[Tensor, tuple]]]:
    """Raise ``PerSampleError`` before the pass if a node without a per-sample rule feeds a
    parameter in ``params`` (id -> name), a generic row rule's node meets the parameter with
    a factor that does not carry the batch (``rules.per_sample.unbatched_operand``, asking
    ``following.holds``: the block's batch following, ``batch_following``), a layer's input
    has the batch off its dim or a dim 0 that never became the batch's, or a node inside the
    model mixes examples (``batches``: the dim-0 sizes of the model's inputs, when the
    forward ran in the block). Returns the uses a generic row rule handles, ``(node, input_nr,
    parameter)`` or with the steps of a value computed from the parameter alone
    (``hook_rules``), and the layer inputs computed from a parameter alone, by their node's id
    (``PerSampleRows``)."""
    is_batched = following.holds if following is not None else (lambda t: False)

    def batch_expand(node: Any) -> bool:
        """A parameter expanded to the batch whose dim 0 met the batch there: the expand
        gives the rows. Where the mark landed elsewhere (a table of as many entries as
        examples) the expand is a step like any other (``rules.per_sample.parameter_step``)."""
        return expanded_over_batch(node) and following is not None and following.met_batch(node)

    generic: list[tuple[Any, int, Tensor]] = []
    seen: set[int] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    root_ids = {id(node) for node in stack}  # the loss: never a lost batch
    tail = _scalar_tail(stack)  # the model's own loss, reduced: no mixing
    unbatched: list[Any] = []  # nodes inside the model whose values lost the batch
    misplaced: list[tuple[int, str]] = []  # layers whose input has the batch elsewhere: the
    # parameter's dims (a layer's weight is named before its bias) and the message
    consumers: dict[int, list[tuple[Any, int]]] = {}  # node id -> (node, input_nr) using it
    computed: list[tuple[Any, int, Tensor]] = []  # a value computed from a parameter alone
    computed_inputs: dict[int, tuple[Tensor, tuple]] = {}  # a layer's input computed alone
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        module = _module_of(node)
        if module is not None:  # created inside the model's forward (the loss is outside)
            reason = mixing_reason(node, id(node) in tail, batches)
            if reason is not None:
                below = [nxt for nxt, _ in node.next_functions]
                others = _other_mixing([*stack, *below], seen, tail, batches)
                raise PerSampleError(
                    f"per-sample values need examples that do not mix, but {node.name()} "
                    f"(created by {module}) mixes them: {reason}{others}"
                )
            lost = node.metadata.get(BATCHED_KEY, 0) is None and not (
                id(node) in root_ids or id(node) in tail
            )
            # a 0-dim value computed from the batch off the loss's tail picked or mixed the
            # examples (trial 88: ``e.sum() + e[0, 0]`` gave example 0's entry to every row)
            if lost and (_first_size(node) in batches - {1} or _scalar_output(node)):
                unbatched.append(node)
        for input_nr, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            consumers.setdefault(id(nxt), []).append((node, input_nr))
            variable = getattr(nxt, "variable", None)
            known = variable is not None and id(variable) in params
            if known and batch_expand(node):  # cls.expand(N, -1, -1): its own rows
                generic.append((node, input_nr, variable))
                stack.append(nxt)
                continue
            if (
                known
                and MODULE_KEY in node.metadata
                and parameter_step(node, input_nr) is not None
                and (
                    row_rule(node) is None
                    or unbatched_operand(node, input_nr, is_batched) is not None
                )
            ):  # ``1 + w``, ``w.float()``, ``w.t()``: followed to its uses after the walk
                computed.append((node, input_nr, variable))
                stack.append(nxt)
                continue
            if known:
                problems = _layer_input_problems(node, params[id(variable)], following)
                misplaced += [(variable.dim(), problem) for problem in problems]
            if known and row_rule(node) is not None:
                operand = unbatched_operand(node, input_nr, is_batched)
                # a layer whose input lost the batch (an F.rms_norm's inner product): the
                # layer's own problem, raised after the walk, names the cause
                if operand is not None and MISPLACED_KEY not in node.metadata:
                    where = f", created by {module}," if module else ""
                    raise PerSampleError(
                        f"per-sample values: parameter '{params[id(variable)]}' is used by "
                        f"{node.name()}{where} with {operand}: {_unsplit_use(operand)}; see "
                        "'Per-sample values' in the README"
                    )
                generic.append((node, input_nr, variable))
            if known and not has_per_sample_rule(node):
                if node.name() in PARAMETER_STEPS and BATCHED_KEY in node.metadata:
                    raise PerSampleError(
                        f"per-sample values: parameter '{params[id(variable)]}' is used by "
                        f"{node.name()}{f', created by {module},' if module else ''} together "
                        "with a value that carries the batch (torch.broadcast_tensors(p, x) "
                        "broadcasts both in one call): a cast, view or expand has per-sample rows "
                        "on the parameter alone; broadcast it by itself (p.expand(...), "
                        "torch.broadcast_to(p, x.shape)); see 'Per-sample values' in the README"
                    )
                if MODULE_KEY not in node.metadata:
                    raise PerSampleError(
                        f"per-sample values: parameter '{params[id(variable)]}' is used by "
                        f"{node.name()}, created outside a semipack.extend(..., per_sample=True) "
                        "block: run the forward inside the block (the module extensions that "
                        "compute the rows only run there)"
                    )
                where = f", created by {module}" if module else ""
                raise PerSampleError(
                    f"per-sample values: parameter '{params[id(variable)]}' is used by "
                    f"{node.name()}{where}, which has no per-sample rule. Supported: "
                    "parameters used directly by F.linear, x @ W (torch.matmul, the @ "
                    "operator), torch.addmm(b, x, W) (a 1-D b, no beta or alpha), "
                    "conv1d/conv2d, F.layer_norm, F.embedding and nn.MultiheadAttention (the "
                    "module extensions, with extensions=True), by nn.EmbeddingBag, batch norm "
                    "in eval mode, group norm and instance norm, or by "
                    "x * p, x + p, x - p, or through casts, transposes, views, squeezes, "
                    "expands, slices, selected rows and constant factors on the way there"
                    + (" (write torch.mm(x, W) as x @ W)" if node.name() == "MmBackward0" else "")
                    + "; see 'Per-sample values' in the README"
                )
            stack.append(nxt)
    for node, input_nr, variable in computed:
        uses = _uses_of_computed(
            node, input_nr, variable, params, consumers, is_batched, batch_expand
        )
        for use in uses:
            user, user_nr, _, steps = use
            problems = _layer_input_problems(user, params[id(variable)], following)
            misplaced += [(variable.dim(), problem) for problem in problems]
            if row_rule(user) is not None or batch_expand(user):
                generic.append(use)
            else:  # a module extension: it reports the rows of the value it was given
                computed_inputs[id(user.next_functions[user_nr][0])] = (variable, steps)
    if misplaced:  # after the checks above, whose messages name a cause the layer follows from
        raise PerSampleError(max(misplaced, key=lambda problem: problem[0])[1])
    if batches - {1}:
        _refuse_lost_batch(unbatched, params)
    return generic, computed_inputs


def _other_mixing(stack: list[Any], seen: set[int], tail: set[int], batches: frozenset[int]) -> str:
    """The other nodes inside the model that mix the examples, below those ``check_graph``
    has walked (``stack`` and ``seen``), for its refusal: each one is a layer the user must
    change (trial 120: a ResNet in train mode named its last batch norm alone)."""
    found = [
        f"{node.name()} (created by {module})"
        for node in _walk(stack, seen)
        if (module := _module_of(node)) is not None
        and mixing_reason(node, id(node) in tail, batches) is not None
    ]
    if not found:
        return ""
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return f"; the model has {len(found)} more such node{'s' * (len(found) > 1)}: {shown}"


#: Nodes of a 0-dim value linear in their one graph input (or a sum of such inputs): the scalar
#: tail a model may put after its loss's reduction and still mix no examples.
_LINEAR_SCALAR_NODES = frozenset(
    (
        "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "NegBackward0",
        "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "CloneBackward0",
        "ViewBackward0", "SumBackward0", "ToCopyBackward0", "UnsqueezeBackward0",
        "SqueezeBackward0", "SqueezeBackward1", "ExpandBackward0", "UnsafeViewBackward0",
    )
)  # fmt: skip


#: The tail's nodes: its linear steps and the loss's own reduction, a sum or a mean.
_TAIL_NODES = _LINEAR_SCALAR_NODES | {"MeanBackward0"}


def _fused_loss(name: str) -> bool:
    """Whether autograd node ``name`` is a fused loss (``cross_entropy``'s ``NllLossBackward0``,
    ``MseLossBackward0``, BCE...): a sum or mean of per-example terms, the loss's own reduction
    (trial 89: followed by ``/ accum_steps`` or an added z-loss it was refused)."""
    return "Loss" in name or name.startswith(("BinaryCrossEntropy", "KlDiv"))


def _scalar_tail(roots: Sequence[Any]) -> set[int]:
    """The ids of the root nodes and of every node that feeds them through 0-dim values and
    linear steps only: the model's own scalar loss, reduced and then scaled or shifted
    (ViTMAE's ``(loss * mask).sum() / mask.sum()``, ``e.sum() / 3 + 1``; trial 84 found the
    reduction refused as mixing the batch). A product or quotient of two values computed from
    the input, or any other function of the reduced value (``e.sum() ** 2``), mixes the
    examples' terms: its reduction stays refused (trial 86 found ``e.sum() ** 2`` given
    rows unlike single examples')."""
    ids: set[int] = set()
    stack = [node for node in roots if node is not None]
    while stack:
        node = stack.pop()
        if id(node) in ids:
            continue
        edges = [nxt for nxt, _ in node.next_functions if nxt is not None]
        name = node.name()
        # a quotient is linear in its numerator only (trial 87: ``c / e.sum()`` passed)
        one_edge = len(edges) == 1 and (
            name != "DivBackward0" or node.next_functions[0][0] is not None
        )
        linear = (name in _TAIL_NODES or _fused_loss(name)) and (
            name not in ("MulBackward0", "DivBackward0") or one_edge
        )
        if not linear:  # not the loss's own (``e.var()``, ``e[0, 0]``: trial 88 found them
            continue  # taken for it, the rows unlike single examples')
        ids.add(id(node))
        for nxt, _ in node.next_functions:
            if nxt is None or getattr(nxt, "variable", None) is not None:
                continue
            metadata = getattr(nxt, "_input_metadata", ())
            if metadata and all(math.prod(m.shape) == 1 for m in metadata):
                stack.append(nxt)
    return ids


def _uses_of_computed(
    start: Any,
    input_nr: int,
    variable: Tensor,
    params: dict[int, str],
    consumers: dict[int, list[tuple[Any, int]]],
    is_batched: Callable[[Tensor], bool],
    batch_expand: Callable[[Any], bool],
) -> list[tuple[Any, int, Tensor, tuple[Any, ...]]]:
    """The row-rule uses of a value computed from ``variable`` alone, starting at ``start``:
    each with the steps (``parameter_step``, outermost first) that take its rows back to the
    parameter. Every use of every value on the way must be such a step or a generic row rule
    whose other operand carries the batch: one use anywhere else (``x @ (1 + w)``) would leave
    its share out of the rows, and is refused."""
    found = []
    frontier: list[tuple[Any, tuple[tuple[Any, int], ...]]] = [(start, ((start, input_nr),))]
    while frontier:
        node, steps = frontier.pop()
        uses = consumers.get(id(node), [])
        if not uses:
            raise _computed_refused(params[id(variable)], steps, "reaches the loss itself")
        for user, user_nr in uses:
            if batch_expand(user):  # ``b.view(1, C, 1, 1).expand_as(h)``: its rows
                found.append((user, user_nr, variable, steps))
                continue
            rule = row_rule(user)
            operand = None if rule is None else unbatched_operand(user, user_nr, is_batched)
            if (rule is not None and operand is None) or (
                rule is None and has_per_sample_rule(user)
            ):
                found.append((user, user_nr, variable, steps))
            elif MODULE_KEY in user.metadata and parameter_step(user, user_nr) is not None:
                frontier.append((user, ((user, user_nr), *steps)))
            elif operand is not None:  # a row rule, with an operand that need not be batched
                chain = " -> ".join(node.name() for node, _ in reversed(steps))
                raise PerSampleError(
                    f"per-sample values: parameter '{params[id(variable)]}' goes through "
                    f"{chain}, and the value computed from it is used by {user.name()} with "
                    f"{operand}: that operand need not carry the batch, so the use is not split "
                    "by example; see 'Per-sample values' in the README"
                )
            else:
                raise _computed_refused(params[id(variable)], steps, f"is used by {user.name()}")
    return found


def _unsplit_use(operand: str) -> str:
    """Why a use of a parameter with ``operand`` (``unbatched_operand``'s description) has no
    rows: its examples met there, or it need not carry the batch at all (trial 117: a value in
    which an RMSNorm over the batch mixed the examples was explained as a computed weight)."""
    if "no dim holds one example" in operand or "with the batch on dim" in operand:
        return "that operand holds no row per example on dim 0, so the use is not split by example"
    return (
        "that operand need not carry the batch, so the use is not split by example (a weight "
        "computed from parameters and buffers, a pruned or masked weight say, has no "
        "per-sample rows)"
    )


def _layer_input_problems(node: Any, name: str, following: BatchedTensors | None) -> list[str]:
    """Why ``node``'s use of parameter ``name`` (or of a value computed from it alone) has no
    per-sample rows: its input has the batch elsewhere, was computed by calls the block did
    not see, or met a provisional mark that the batch refuted."""
    problems = []
    if MISPLACED_KEY in node.metadata:
        problems.append(
            f"per-sample values: parameter '{name}' is used by {node.metadata[MISPLACED_KEY]}"
        )
    if has_per_sample_rule(node) and following is not None:
        unseen = _unseen_input(node)
        if unseen is not None:
            problems.append(
                f"per-sample values: parameter '{name}' is used by {node.name()} on an input "
                f"({unseen}) computed from the model's input by calls the block did not see (a "
                "torch.jit.script function, code below Python): where its batch is cannot be "
                "known"
            )
    refuted = following.refutation(node) if following is not None else None
    if refuted is not None:
        problems.append(f"per-sample values: parameter '{name}' is used by {refuted}")
    return problems


def _computed_refused(name: str, steps: Sequence[tuple[Any, int]], use: str) -> PerSampleError:
    chain = " -> ".join(node.name() for node, _ in reversed(steps))
    hint = ""
    if chain in ("TBackward0", "TransposeBackward0") and any(
        product in use for product in ("MmBackward", "BmmBackward")
    ):  # W @ x: PyTorch multiplies x's transpose by W's (trial 120: named no product)
        hint = (
            "; a parameter on the left of a product, W @ x, is computed as (xᵀ Wᵀ)ᵀ: write "
            "F.linear(x.transpose(-1, -2), W).transpose(-1, -2) for its rows"
        )
    return PerSampleError(
        f"per-sample values: parameter '{name}' goes through {chain}, and the value computed "
        f"from it {use}, which has no per-sample rule: its rows would not split by example "
        "(supported: such a value multiplied with or added to one that carries the batch, or "
        f"given to F.linear or x @ W){hint}; see 'Per-sample values' in the README"
    )


def _seen(node) -> bool:
    """Whether the block saw ``node`` made: by a call it followed, as the call's result
    (``BATCHED_KEY``, ``SEEN_KEY``) or inside it (``INSIDE_CALL_KEY``: ``F.rms_norm``'s
    ``x * r``, which its gain multiplies; a row rule on such a value asks whether the batch is
    known there, ``rules.per_sample.unbatched_operand``)."""
    metadata = node.metadata
    return BATCHED_KEY in metadata or SEEN_KEY in metadata or INSIDE_CALL_KEY in metadata


def _unseen_input(node) -> str | None:
    """The name of an input node of ``node`` (a layer with per-sample rows) that the block did
    not see made (no ``BATCHED_KEY``) but that was computed from a node it did see from the
    model's input; None when there is none."""
    for nxt, _ in node.next_functions:
        if nxt is None or hasattr(nxt, "variable") or _seen(nxt):
            continue
        if _upstream(nxt, lambda n: BATCHED_KEY in n.metadata) is not None:
            return nxt.name()
    return None


def _walk(starts: Sequence[Any], seen: set[int] = frozenset()) -> Iterator[Any]:
    """Each node among ``starts`` and the nodes they were computed from, once, depth first
    along ``next_functions``, leaving out those whose ids are in ``seen``."""
    stack, visited = list(starts), set(seen)
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        yield node
        stack.extend(nxt for nxt, _ in node.next_functions)


def _upstream(node, found: Callable[[Any], bool]) -> Any:
    """The first node ``found`` accepts among ``node`` and the nodes it was computed from
    (a depth-first walk of ``next_functions``), or None."""
    return next((n for n in _walk([node]) if found(n)), None)


def _scalar_output(node) -> bool:
    """Whether ``node``'s outputs are 0-dim, as autograd recorded them."""
    metadata = getattr(node, "_input_metadata", ())
    return bool(metadata) and all(len(m.shape) == 0 for m in metadata)


def _first_size(node) -> int | None:
    """Dim 0 of ``node``'s (first) output, as autograd recorded it; None when unknown."""
    try:
        shape = node._input_metadata[0].shape
    except (AttributeError, IndexError, RuntimeError):
        return None
    return int(shape[0]) if len(shape) else None


def _refuse_lost_batch(nodes: Sequence[Any], params: dict[int, str]) -> None:
    """Raise for the first of ``nodes`` (inside the model, their values without a dim that
    holds one example per index while dim 0 has a batch's size) that a parameter in
    ``params`` feeds: a row would hold other examples' paths (``h @ (h.T @ h)``,
    ``h[perm]``, ``h.t().mean(-1)``). Checked after the node types ``mixing_reason`` names,
    whose messages say more; a value whose dim 0 is no batch size is left to the rows'
    own checks, which name the layer."""
    for node in nodes:
        leaf = _upstream(node, lambda n: id(getattr(n, "variable", None)) in params)
        if leaf is not None:
            raise PerSampleError(
                f"per-sample values need examples that do not mix, but {node.name()} "
                f"(created by {_module_of(node)}, from parameter "
                f"'{params[id(leaf.variable)]}') computes a value in which no dim holds one "
                f"example per index: {how_lost(node.metadata.get(LOST_BY_KEY, '?'))}"
            )


def hook_rules(
    uses: Sequence[tuple[Any, int, Tensor]], rows: PerSampleRows
) -> list[torch.utils.hooks.RemovableHandle]:
    """Pre-hooks that run the generic row rules on the state arriving at each node of ``uses``
    (from ``check_graph``) and report the rows to ``rows``; remove them after the pass."""
    by_node: dict[int, tuple[Any, list[tuple[int, Tensor, tuple]]]] = {}
    for node, input_nr, param, *steps in uses:
        by_node.setdefault(id(node), (node, []))[1].append((input_nr, param, *steps[:1]))
    handles = []
    for node, params in by_node.values():
        rule = batch_expand_rows if expanded_over_batch(node) else row_rule(node)

        def prehook(grad_outputs, node=node, params=params, rule=rule):
            msg = grad_outputs[0]
            if in_carry_pass() or not isinstance(msg, Message):
                return None
            sr = msg.semiring
            for input_nr, param, *steps in params:
                try:
                    state = rule(sr, node, msg.parts, input_nr)
                except PerSampleError as refusal:  # name the parameter and the use
                    module = _module_of(node)
                    where = f", created by {module}," if module else ""
                    reason = str(refusal).removeprefix("per-sample values: ")
                    raise PerSampleError(
                        f"per-sample values: parameter '{rows.names.get(id(param), '?')}' (or a "
                        f"value computed from it alone) is used by {node.name()}{where} where "
                        f"{reason}"
                    ) from None
                if steps:  # through a value computed from the parameter alone
                    state = rows_through(sr, state, steps[0], param)
                rows.add(param, state)
            node.metadata.pop(FACTORS_KEY, None)  # a later pass reads the saved factor
            return None

        handles.append(node.register_prehook(prehook))
    return handles


@dataclass(frozen=True)
class ComputedInput:
    """A layer's input computed from one parameter alone (``w.t()``, a pruned ``w * mask``):
    its rows go back to ``variable`` through ``steps`` (``(node, input_nr)``, outermost
    first, ``rules.per_sample.parameter_step``)."""

    variable: Tensor
    steps: tuple[tuple[Any, int], ...]


def rows_through(
    sr: Semiring, state: State, steps: Sequence[tuple[Any, int]], param: Tensor
) -> State:
    """The rows of a value computed from ``param`` alone taken back to ``param``."""
    for step_node, step_nr in steps:
        # the rows of the step's output, in its dtype's states (as the pass rounds there)
        state = _in_dtype(sr, state, step_node._input_metadata[0].dtype)
        state = PARAMETER_STEPS[step_node.name()](sr, step_node, state, step_nr)
    return _in_dtype(sr, state, param.dtype)


def _in_dtype(sr: Semiring, state: State, dtype: torch.dtype) -> State:
    """``state`` with the component dtypes of a value of ``dtype``: a cast on the way rounds
    the states there, as it rounds the messages of the pass."""
    dtypes = sr.component_dtypes(dtype)
    return tuple(p.to(d) for p, d in zip(state, dtypes, strict=True))


class PerSampleRows:
    """The rows reported during one pass: parameter id -> ``[N, *p.shape]`` state."""

    def __init__(
        self,
        sr: Semiring,
        params: dict[int, str],
        computed_inputs: dict[int, tuple[Tensor, tuple]] | None = None,
        empty: bool = False,
    ) -> None:
        self.sr = sr
        self.names = params
        #: a batch of no examples: no rule runs (their reshapes cannot infer sizes from zero
        #: entries), every parameter the pass reaches gets rows ``[0, *p.shape]``
        self.empty = empty
        # node id -> (parameter, steps): layer inputs computed from a parameter alone
        self.computed_inputs = computed_inputs or {}
        self.rows: dict[int, State] = {}
        self._lock = threading.Lock()

    def wants(self, node) -> Tensor | ComputedInput | None:
        """The parameter behind ``node`` (an input edge's node), if it is one we collect, or
        the value computed from one alone that ``node`` makes (``ComputedInput``)."""
        if node is None:
            return None
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in self.names:
            return variable
        computed = self.computed_inputs.get(id(node))
        return ComputedInput(*computed) if computed is not None else None

    def add(self, param: Tensor | ComputedInput, rows: State) -> None:
        """Semiring-add ``rows`` (``[N, *param.shape]``) to what ``param`` has; the rows of a
        ``ComputedInput`` go back to its parameter first."""
        if isinstance(param, ComputedInput):
            param, rows = param.variable, rows_through(self.sr, rows, param.steps, param.variable)
        with self._lock:
            before = self.rows.get(id(param))
            if before is not None and before[0].shape[0] != rows[0].shape[0]:
                raise _disagree(self.names[id(param)], before[0].shape[0], rows[0].shape[0])
            self.rows[id(param)] = rows if before is None else self.sr.plus(before, rows)

    def check(
        self,
        params: Sequence[Tensor],
        batches: frozenset[int] = frozenset(),
        sources: Mapping[int, str] | None = None,
    ) -> None:
        """Raise unless every parameter in ``params`` has rows, all of one batch size, and
        that size is the dim 0 of a model input (``batches``, when known; ``sources`` says, per
        batch size, which tensor the batch was taken from)."""
        if self.empty:
            return
        for p in params:
            if id(p) not in self.rows:
                raise PerSampleError(
                    f"per-sample values: no rows reached parameter '{self.names[id(p)]}', "
                    "although the backward did: it is used where no rule computes its rows (as "
                    "the input of a layer, proj(p), rather than its weight, or in a weight "
                    "computed from two parameters); see 'Per-sample values' in the README"
                )
        sizes = [self.rows[id(p)][0].shape[0] for p in params]
        # the batch: the size most parameters' rows have among the model inputs' (a merged
        # batch's 12 rows read "12 examples", trial 82), or among all where none has one; every
        # parameter must have it (a batch of one from an earlier call in the block made a
        # position table's single row pass beside the others' three, trial 85)
        known = [n for n in sizes if n in batches]
        if batches and not known:  # no parameter saw the batch: every one is odd
            batch = min(batches - {1}, default=min(batches))
        else:
            batch = max(set(known or sizes), key=sizes.count, default=0)
        odd = [(p, n) for p, n in zip(params, sizes, strict=True) if n != batch]
        examples = f"{batch} example{'s' * (batch != 1)} in dim 0"
        if batches:
            source = (sources or {}).get(batch, "the model's input")
            seen = f"{source} has {examples} (the batch)"
        else:
            seen = f"most parameters saw {examples}"
        if odd:
            named = ", ".join(f"'{self.names[id(p)]}' ({n} row{'s' * (n != 1)})" for p, n in odd)
            raise PerSampleError(
                f"per-sample values: {seen}, but {named} did not: they were "
                "used on a tensor whose dim 0 is not the batch. "
                + _why_not_the_batch({n for _, n in odd}, batch)
            )

    def results(self, params: Sequence[Tensor], keep_state: bool) -> list[tuple[Tensor, dict]]:
        """``semiring_grad_batch`` (and with ``keep_state`` ``semiring_state_batch``, else None:
        removed) of each parameter in ``params`` (``check`` first), for the pass to set once
        every readout succeeded."""
        out = []
        for p in params:
            if self.empty:
                rows = self.sr.zeros((0, *p.shape), p.dtype, p.device)
            else:
                rows = self.rows[id(p)]
            state = tuple(rows) if keep_state else None
            out.append(
                (p, {SEMIRING_GRAD_BATCH: self.sr.readout(rows), SEMIRING_STATE_BATCH: state})
            )
        return out


def _why_not_the_batch(sizes: set[int], batch: int) -> str:
    """The likely causes of layer inputs whose dim 0 has one of ``sizes`` instead of the
    ``batch``'s: a dim 0 of 1 is a lookup shared by the batch, a multiple of the batch the
    batch merged with another dim (trial 73: OPT's was told of tables and layouts only), any
    other one a table or layout that is not split by example (trial 66: MPNet's bucket table
    was told to pass position ids, which changed nothing)."""
    causes = []
    merged = sorted(n for n in sizes if batch > 1 and n > batch and n % batch == 0)
    if merged:
        causes.append(
            f"A multiple of the batch's size ({merged[0]} = {batch} x {merged[0] // batch}): "
            "the batch merged with another dim by a reshape ([N * T, ...]): Linear and "
            "LayerNorm layers, x @ W and torch.addmm split it out again (OPT's feed-forward, "
            "GPT-2's Conv1D), other layers (a convolution, an embedding, mixture-of-experts "
            "routing) have no per-sample rows there, nor has a second model argument merged "
            "so (GPT-2's cross-attention on encoder_hidden_states), or a merged batch whose "
            "examples were reordered"
        )
    if 1 in sizes:
        causes.append(
            "A dim 0 of 1: a lookup broadcast over the batch (Hugging Face text models' "
            "position embeddings: pass position_ids of shape [N, T]; a model whose forward "
            "takes no position_ids, such as SigLIP's and CLIP's vision towers, reads a buffer "
            "shared by the batch: freeze that embedding, requires_grad_(False), for the other "
            "parameters' rows)"
        )
    if sizes - {1} - set(merged):
        causes.append(
            "Another size: a table the model builds from positions rather than from its input "
            "(a relative-position bucket table [T, T], as T5 and MPNet build: such a layer has "
            "no per-sample rows), or a sequence-first layout (put the batch first)"
        )
    return "; ".join(causes)


def _disagree(name: str, a: int, b: int) -> PerSampleError:
    return PerSampleError(
        f"per-sample values: parameter '{name}' is used on batches of {a} and {b} examples; "
        "every use must see the model's batch on dim 0"
    )


def clear(t: Tensor) -> None:
    """Remove per-sample results an earlier pass left on ``t``."""
    for name in (SEMIRING_GRAD_BATCH, SEMIRING_STATE_BATCH):
        if hasattr(t, name):
            delattr(t, name)


_lock = threading.Lock()
_active: list[PerSampleRows] = []


@contextmanager
def collecting(rows: PerSampleRows) -> Iterator[PerSampleRows]:
    """Make ``rows`` the collector the nodes report to while the pass runs. Module-level, not
    thread-local: on CUDA the engine runs backward functions on its own threads."""
    with _lock:
        _active.append(rows)
    try:
        yield rows
    finally:
        with _lock:
            _active.remove(rows)


def active_rows() -> PerSampleRows | None:
    """The collector of the running per-sample pass, if any (None in a carry pass too)."""
    with _lock:
        return _active[-1] if _active else None


__all__ = [
    "SEMIRING_GRAD_BATCH",
    "SEMIRING_STATE_BATCH",
    "BatchedTensors",
    "PerSampleRows",
    "active_rows",
    "check_graph",
    "check_semiring",
    "clear",
    "collecting",
    "hook_rules",
]
