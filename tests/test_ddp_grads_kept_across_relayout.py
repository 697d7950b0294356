"""The gradient tensor a user or an optimizer holds (``g = p.grad``) stays ``p.grad`` and receives
the averages across fusedist's re-layouts, as torch DDP keeps ``p.grad`` from step to step: after
``requires_grad`` changes between steps (Note [trainable set changes] in fusedist/ddp/trainable.py)
and after ``model.to(memory_format=...)`` (Note [memory format changed after wrapping] in
fusedist/ddp/memory_format.py); after ``p.grad.data = t`` the tensor ``t`` receives the average, as
under torch's default gradients. Communication hooks whose future holds another tensor than the
bucket's buffer: its value becomes the gradients, as torch copies it. Two gloo ranks, one launch.

References: torch's DDP (``find_unused_parameters=True`` where a parameter is frozen, as torch needs),
and for the memory-format change, where torch's DDP itself trains wrongly, each rank's local
gradient of an unwrapped copy averaged by hand.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shared_rank_launch import launch_for_selected, results_of


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _step(model, x):
    model.zero_grad(set_to_none=False)  # the gradient tensors stay, as a held reference expects
    model(x).square().sum().backward()


def _user_allreduce(state, bucket):
    """A hook of the user's over torch's all-reduce: the model keeps its buckets (appended to)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(state, bucket)


def _held_across_trainable_changes(model, xs) -> list:
    """Hold every ``p.grad``, freeze a weight, train, unfreeze it, train: per step whether each held
    tensor is still ``p.grad`` and the gradients."""
    params = dict(model.module.named_parameters())
    for x in xs[:3]:  # (past the first buckets' rebuild)
        _step(model, x)
    held = {n: p.grad for n, p in params.items()}
    seen, frozen = [], params["0.weight"]
    for flag, x in ((False, xs[3]), (None, xs[4]), (True, xs[5]), (None, xs[6])):
        if flag is not None:
            frozen.requires_grad_(flag)
        _step(model, x)
        seen.append(({n: held[n] is p.grad for n, p in params.items()},
                     {n: p.grad.clone() for n, p in params.items() if p.requires_grad}))
        if flag is False:  # the elements a frozen gradient's memory holds: its own, not a dropped buffer's
            elements = frozen.grad.untyped_storage().nbytes() // frozen.grad.element_size()
    return seen + [elements]


def trainable_changes(rank: int, world: int) -> dict:
    import fusedist

    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(3, 4, generator=gen) for _ in range(7)]
    out = {"torch": _held_across_trainable_changes(
        nn.parallel.DistributedDataParallel(_mlp(), find_unused_parameters=True), xs)}
    for as_view in (True, False):  # the buckets rebuilt over the trainable parameters
        out["rebuilt", as_view] = _held_across_trainable_changes(
            fusedist.DistributedDataParallel(_mlp(), gradient_as_bucket_view=as_view), xs)
    model = fusedist.DistributedDataParallel(_mlp())
    model.register_comm_hook(None, _user_allreduce)  # the buckets kept, appended to
    out["appended", True] = _held_across_trainable_changes(model, xs)
    return out


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Conv2d(4, 2, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x))).mean((2, 3))


def memory_format_changed(rank: int, world: int) -> dict:
    """Held gradients across ``model.to(memory_format=torch.channels_last)`` after wrapping (before the
    layout is final, and after), against each rank's local gradient averaged by hand."""
    import fusedist

    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(2, 3, 7, 7, generator=gen) for _ in range(4)]
    out = {}
    for convert_at in (0, 2):
        module = _ConvNet()
        plain = copy.deepcopy(module)
        model = fusedist.DistributedDataParallel(module)
        held, same, errors, swapped = None, [], [], None
        for step, x in enumerate(xs + xs[:1]):
            if step == convert_at:
                held = [p.grad for p in module.parameters()] if step else None
                module.to(memory_format=torch.channels_last)
                plain.to(memory_format=torch.channels_last)
            if step == len(xs):  # gradients given memory of the user's, laid out as their slots: no conversion
                swapped = [torch.zeros_like(p.grad) for p in (module.conv.weight, module.head.weight)]
                module.conv.weight.grad.data, module.head.weight.grad.data = swapped
            _step(model, x)
            _step(plain, x)
            for q in plain.parameters():
                dist.all_reduce(q.grad)
                q.grad /= world
            errors.append(max((p.grad - q.grad).abs().max().item() for p, q in zip(module.parameters(),
                                                                                    plain.parameters())))
            if held is None:
                held = [p.grad for p in module.parameters()]
            same.append(all(g is p.grad for g, p in zip(held, module.parameters())))
        out[convert_at] = (same, errors, max((t - q.grad).abs().max().item()
                                             for t, q in zip(swapped, (plain.conv.weight, plain.head.weight))))
    return out


def _moved_by_data(model, xs, rank) -> list:
    """``p.grad.data = t`` between steps, then after ``zero_grad`` before a ``no_sync`` backward: what
    ``t`` holds after the next synchronized backward, and whether ``p.grad`` stayed the same tensor."""
    p = model.module[0].weight
    for x in xs[:3]:
        _step(model, x)
    seen = []
    for accumulate in (False, True):
        before = weakref.ref(p.grad)  # (a reference held would make it the user's gradient anyway)
        mine = torch.full_like(p, 0.5 + rank)  # accumulated into by the next backward
        if accumulate:
            model.zero_grad(set_to_none=False)
        p.grad.data = mine
        if accumulate:
            with model.no_sync():
                model(xs[3]).square().sum().backward()
        model(xs[4]).square().sum().backward()
        seen.append((before() is p.grad, mine.clone(), p.grad.clone()))
    return seen


def moved_by_data(rank: int, world: int) -> dict:
    import fusedist

    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(3, 4, generator=gen) for _ in range(5)]
    out = {"torch": _moved_by_data(nn.parallel.DistributedDataParallel(_mlp()), xs, rank)}
    for as_view in (True, False):
        out[as_view] = _moved_by_data(fusedist.DistributedDataParallel(_mlp(), gradient_as_bucket_view=as_view), xs,
                                      rank)
    return out


def hook_result_is_another_tensor(rank: int, world: int) -> dict:
    """A hook all-reducing the buffer in place whose future holds a halved clone, and one whose
    future holds a tensor one element too long (torch takes its first elements silently)."""
    import fusedist

    def halved_clone(state, bucket):
        future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return future.then(lambda f: f.value()[0].clone() / 2)

    def one_too_many(state, bucket):
        future = torch.futures.Future()
        future.set_result(torch.zeros(1, bucket.buffer().numel() + 1, dtype=torch.float64))
        return future

    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(3, 4, generator=gen) for _ in range(3)]
    out = {}
    for as_view in (True, False):
        for name, cls in (("torch", nn.parallel.DistributedDataParallel),
                          ("fusedist", fusedist.DistributedDataParallel)):
            model = cls(_mlp(), gradient_as_bucket_view=as_view)
            model.register_comm_hook(None, halved_clone)
            for x in xs:
                _step(model, x)
            out[name, as_view] = [p.grad.clone() for p in model.parameters()]
    model = fusedist.DistributedDataParallel(_mlp())
    model.register_comm_hook(None, one_too_many)
    try:
        _step(model, xs[0])
        out["too long"] = "no error"
    except ValueError as exc:
        out["too long"] = str(exc)
    return out


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, {
        "test_held_gradients_stay_p_grad_across_trainable_set_changes": {"trainable": (trainable_changes, ())},
        "test_held_gradients_stay_p_grad_across_a_memory_format_change": {"format": (memory_format_changed, ())},
        "test_a_gradient_moved_by_data_assignment_receives_the_average_as_with_torch": {
            "moved": (moved_by_data, ())},
        # (last: its refused backward ends that model's use)
        "test_a_hook_future_holding_another_tensor_gives_its_values": {"hook": (hook_result_is_another_tensor, ())},
    }, world=2, timeout=180)


def test_held_gradients_stay_p_grad_across_trainable_set_changes(launched):
    for out in results_of(launched, "trainable"):
        theirs = out.pop("torch")[:-1]
        assert all(all(same.values()) for same, _ in theirs), theirs  # torch keeps every p.grad
        for case, ours in out.items():
            # a frozen gradient on memory of its own (12 elements), as torch's, not on the buckets' buffer,
            # which it would keep alive once rebuilt without it
            assert ours.pop() == 12, (case, "frozen gradient's storage")
            for step, ((same, grads), (_, reference)) in enumerate(zip(ours, theirs)):
                assert all(same.values()), (case, step, same)
                assert grads.keys() == reference.keys(), (case, step)
                for name, g in grads.items():
                    torch.testing.assert_close(g, reference[name], rtol=1e-6, atol=1e-6,
                                               msg=lambda m: f"{case}, step {step}, {name}: {m}")


def test_held_gradients_stay_p_grad_across_a_memory_format_change(launched):
    for out in results_of(launched, "format"):
        for convert_at, (same, errors, swapped_error) in out.items():
            assert all(same), (convert_at, same)
            assert max(errors) < 1e-6, (convert_at, errors)
            assert swapped_error < 1e-6, (convert_at, swapped_error)  # the user's tensor got the average


def test_a_gradient_moved_by_data_assignment_receives_the_average_as_with_torch(launched):
    for out in results_of(launched, "moved"):
        theirs = out.pop("torch")
        for as_view, ours in out.items():
            for case, ((same, mine, grad), (same_t, mine_t, grad_t)) in enumerate(zip(ours, theirs)):
                assert same and same_t, (as_view, case)
                torch.testing.assert_close(mine, mine_t, rtol=1e-6, atol=1e-6, msg=lambda m: f"{as_view} {case}: {m}")
                torch.testing.assert_close(grad, grad_t, rtol=1e-6, atol=1e-6, msg=lambda m: f"{as_view} {case}: {m}")


def test_a_hook_future_holding_another_tensor_gives_its_values(launched):
    for out in results_of(launched, "hook"):
        message = out.pop("too long")
        for as_view in (True, False):
            for a, b in zip(out["fusedist", as_view], out["torch", as_view]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert "bucket 0" in message and "23 gradient elements" in message, message
        assert "shape (1, 24)" in message and "torch.float64" in message, message
