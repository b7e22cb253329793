"""Passes in several threads at once: each thread's results are those of its passes run alone.

Blocks, passes and branch readouts are per thread; torch.compile's stance is process-wide, so
semipack sets it from counts of the open blocks and running passes of every thread.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch._dynamo.eval_frame as eval_frame
from torch import nn

import semipack


def _stance() -> str:
    return eval_frame._stance.stance


def test_a_branch_readout_in_one_thread_leaves_another_threads_backward_alone() -> None:
    """Thread A's readouts carry parts of a message down in extra passes; thread B's backwards
    meanwhile are user backwards: every one fills `.grad` and `.semiring_grad` as when run
    alone (read as extra passes, B's leaves kept semiring messages in `.grad`)."""
    torch.manual_seed(0)
    deep = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(5)])
    x = torch.randn(16, 32, requires_grad=True)
    small = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    y = torch.randn(5, 8)

    def readouts(stop: threading.Event) -> None:
        while not stop.is_set():
            with semipack.extend(deep, semipack.LogSum()):
                h = deep[0](x)
                with semipack.branches(h, inputs=[x]):
                    out = deep[3](deep[2](deep[1](h))) + deep[4](h)
                out.sum().backward()

    def backward() -> list[tuple[torch.Tensor, torch.Tensor]]:
        small.zero_grad(set_to_none=True)
        with semipack.extend(small, semipack.MaxProd()):
            small(y).sum().backward()
        return [(p.grad, p.semiring_grad) for p in small.parameters()]

    alone = backward()
    stop = threading.Event()
    reader = threading.Thread(target=readouts, args=(stop,))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        reader.start()
        runs = [backward() for _ in range(40)]
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(interval)
    for run in runs:
        for (grad, value), (grad_alone, value_alone) in zip(run, alone, strict=True):
            assert type(grad) is torch.Tensor and torch.equal(grad, grad_alone)
            assert torch.equal(value, value_alone)


def test_overlapping_passes_leave_compiled_code_eager_while_a_block_is_open() -> None:
    """Pass A starts, pass B starts, A ends, B ends: both blocks are still open, so compiled
    user code must still run eagerly (its ops reach the rules); after the blocks, the stance
    is the one before them."""
    before = _stance()
    a_running, b_running, a_done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, str] = {}

    def block(in_hook, after_backward) -> None:
        """A block whose pass runs ``in_hook`` inside its backward, then ``after_backward``."""
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        with semipack.extend(model, semipack.MaxProd()):
            h = model[0](torch.randn(3, 4))
            h.register_hook(lambda g: (in_hook(), g)[-1])
            model[2](model[1](h)).sum().backward()
            after_backward()

    def a_after() -> None:
        a_done.set()
        b_finished.wait()
        seen["A's block after both passes"] = _stance()

    def b_after() -> None:
        b_finished.set()
        a_left.wait()

    def thread_a() -> None:
        block(lambda: (a_running.set(), b_running.wait()), a_after)

    def thread_b() -> None:
        block(lambda: (b_running.set(), a_done.wait()), b_after)

    b_finished, a_left = threading.Event(), threading.Event()
    first = threading.Thread(target=thread_a)
    second = threading.Thread(target=thread_b)
    first.start()
    a_running.wait()
    second.start()
    first.join()
    a_left.set()
    second.join()
    assert seen == {"A's block after both passes": "force_eager"}
    assert _stance() == before


def test_plain_gradients_of_the_same_model_in_another_thread_are_left_alone() -> None:
    """Thread B takes plain ``torch.autograd.grad`` of the model while thread A runs semiring
    passes on it: a CPU parameter's hooks run on the thread that called backward, so A's leaf
    hook leaves B's gradients to B (it took them as A's own and raised ``MessageLostError`` in
    a third of B's calls), and A's values stay those of its passes run alone."""
    errors, wrong, values, want_a = _passes_beside_plain_gradients(BaseException, False)
    assert errors == [] and wrong == []
    for run in values:
        assert all(v.equal(w) for v, w in zip(run, want_a, strict=True))


def test_two_threads_passes_over_a_shared_parameter_are_refused_by_name() -> None:
    """Two models sharing a layer, each in its own thread's block: a pass that starts while
    the other thread's pass holds the shared parameters raises a SemipackError naming one,
    before anything is hooked or swapped; every pass that runs gives its value run alone (the
    passes had handed each other's messages around, raised MessageLostError and could crash
    the process)."""
    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    a = nn.Sequential(nn.Linear(16, 16), shared, nn.Tanh(), nn.Linear(16, 4))
    b = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), shared, nn.Linear(16, 4))
    xa, xb = torch.randn(32, 16), torch.randn(32, 16)
    with semipack.extend(a, semipack.MaxProd()):
        a(xa).pow(2).sum().backward()
    want = a[0].weight.semiring_grad.clone()
    refused: list[str] = []
    other_errors: list[BaseException] = []
    values: list[torch.Tensor] = []

    def run(model: nn.Module, x: torch.Tensor, keep: bool, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                with semipack.extend(model, semipack.MaxProd()):
                    model(x).pow(2).sum().backward()
                if keep:
                    values.append(model[0].weight.semiring_grad.clone())
            except semipack.SemipackError as error:
                refused.append(str(error))
            except BaseException as error:
                other_errors.append(error)

    stop = threading.Event()
    threads = [
        threading.Thread(target=run, args=(a, xa, True, stop)),
        threading.Thread(target=run, args=(b, xb, False, stop)),
    ]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        deadline = threading.Event()
        deadline.wait(2.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    assert other_errors == []
    assert values and all(v.equal(want) for v in values)
    assert refused, "the two threads' passes never overlapped"
    assert all("is in a semiring backward running in another thread" in r for r in refused)
    assert all(("'1." in r or "'2." in r) for r in refused)  # the shared layer's parameters


def test_plain_gradients_that_look_like_the_pass_own_thread_fail_loudly(monkeypatch) -> None:
    """On a GPU the engine runs every thread's hooks of a CUDA parameter on its device thread,
    so the pass's leaf hook cannot leave another thread's plain gradients alone (README,
    "Threads"). Seen from the hook as a device thread sees it (every thread the owner), those
    gradients must fail with MessageLostError in the other thread, never come back wrong, and
    the pass's own values must stay those of a pass run alone."""
    import semipack.transport.backward as backward

    monkeypatch.setattr(
        backward, "threading", type("OneThread", (), {"get_ident": staticmethod(lambda: 0)})
    )
    raised, wrong, values, want_a = _passes_beside_plain_gradients(
        semipack.MessageLostError, until_caught=True
    )
    assert raised and wrong == []
    for run in values:
        assert all(v.equal(w) for v, w in zip(run, want_a, strict=True))


def _passes_beside_plain_gradients(
    catch: type[BaseException], until_caught: bool
) -> tuple[list[BaseException], list[int], list[list[torch.Tensor]], list[torch.Tensor]]:
    """Thread B takes plain ``torch.autograd.grad`` of a small model in a loop while this
    thread runs MaxProd passes on it (60, or with ``until_caught`` until B caught ``catch``,
    at most 1000). Returns B's caught errors, the indices of B's gradients that differed from
    a plain run's, each pass's ``semiring_grad`` values and those of a pass run alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    xa, xb = torch.randn(32, 16), torch.randn(32, 16)
    params = list(model.parameters())
    want_b = torch.autograd.grad(model(xb).pow(2).sum(), params)
    with semipack.extend(model, semipack.MaxProd()):
        model(xa).pow(2).sum().backward()
    want_a = [p.semiring_grad.clone() for p in params]
    caught: list[BaseException] = []
    wrong: list[int] = []

    def plain(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                got = torch.autograd.grad(model(xb).pow(2).sum(), params)
                pairs = zip(got, want_b, strict=True)
                wrong.extend(i for i, (g, w) in enumerate(pairs) if not g.equal(w))
            except catch as error:
                caught.append(error)

    stop = threading.Event()
    other = threading.Thread(target=plain, args=(stop,))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    values: list[list[torch.Tensor]] = []
    try:
        other.start()
        while len(values) < 60 or (until_caught and not caught and len(values) < 1000):
            with semipack.extend(model, semipack.MaxProd()):
                model(xa).pow(2).sum().backward()
            values.append([p.semiring_grad.clone() for p in params])
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(interval)
    return caught, wrong, values, want_a
