"""Gradient slots moved off their bucket, a communication hook's gradients kept across steps, and
gradient tensors cached before the buckets are rebuilt, as torch DDP's default gradients (Note
[gradients the user holds] in fusedist/ddp/held_grads.py).

``p.grad.data = t`` (what ``Module._apply`` does, and code that "detaches" a gradient by hand)
moves the slot tensor onto ``t``'s memory: the bucket no longer sees what autograd accumulates
there. The two-rank scenario runs in ``test_ddp_torch_options.py``'s shared launch; here the
layout's side of it, on one process.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from fusedist.ddp.layout import build_layout


def _training_steps(model, batches, rank) -> list:
    """Gradients after backwards where a ``.grad`` was moved off its memory by ``.data =``:
    before an accumulating backward, and after a backward then set to None by ``zero_grad()``."""
    p, q = model.module[0].weight, model.module[1].weight
    seen = []
    for x in batches[:3]:  # (past torch's bucket rebuild)
        model.zero_grad()
        model(x).sum().backward()
    p.grad.data = torch.full_like(p, 0.5 + rank)  # accumulated into by the next backward
    model(batches[3]).sum().backward()
    seen += [g.grad.clone() for g in model.parameters()]
    model.zero_grad()
    model(batches[4]).sum().backward()
    q.grad.data = q.grad.data.clone()  # the gradient on memory of its own, then dropped by zero_grad
    model.zero_grad()
    model(batches[5]).sum().backward()
    seen += [g.grad.clone() for g in model.parameters()]
    return seen


def _hook_keeping_gradients(model, batches) -> list:
    """A communication hook that keeps each bucket's ``gradients()`` across steps (torch's are views
    of the bucket's buffer: they show its latest values)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    kept = []

    def hook(state, bucket):
        kept.append(bucket.gradients())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    for x in batches[:4]:
        model.zero_grad()
        model(x).sum().backward()
    return [g.clone() for g in kept[1]] + [g.grad.clone() for g in model.parameters()]


class _UsedOutOfOrder(nn.Module):
    """Registered ``b`` then ``a``, used ``a`` then ``b``: the first synchronized backward's order
    differs from the wrapping's, so the buckets are rebuilt after it."""

    def __init__(self):
        super().__init__()
        self.b, self.a = nn.Linear(3, 2), nn.Linear(4, 3)

    def forward(self, x):
        return self.b(self.a(x))


def _cached_before_the_rebuild(model, batches) -> list:
    """A hand-written optimizer that caches the gradient tensors after a first ``no_sync`` backward
    (before the buckets are rebuilt) and zeroes them in place: under torch they stay ``p.grad``."""
    params = list(model.parameters())
    with model.no_sync():
        model(batches[0]).sum().backward()
    cached = [p.grad for p in params]
    seen = []
    for x in batches[1:]:
        model(x).sum().backward()
        seen.append(torch.tensor([float(g is p.grad) for g, p in zip(cached, params)]))
        with torch.no_grad():
            for p, g in zip(params, cached):
                p.add_(g, alpha=-0.1)
                g.zero_()
    return seen + [p.detach().clone() for p in params]


def _slots_kept_after_the_rebuild(rank: int) -> bool:
    """Whether, the buckets rebuilt with a gradient cached before (and the old layout still
    referenced), each ``p.grad`` stays the same slot tensor from step to step after ``zero_grad()``:
    a slot counted as held by the user (the old layout's reference) is copied out every backward."""
    import fusedist

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(_UsedOutOfOrder(), bucket_cap_mb=0.00002)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    with model.no_sync():
        model(x).sum().backward()
    old = model.reducer.layout  # (kept alive, as a framework's reference may keep it)
    model(x).sum().backward()  # the rebuild
    same = []
    for _ in range(2):
        before = [weakref.ref(p.grad) for p in model.parameters()]
        model.zero_grad()
        model(x).sum().backward()
        same += [w() is p.grad for w, p in zip(before, model.parameters())]
    return all(same) and old is not model.reducer.layout  # (rebuilt)


def moved_gradients_beside_torch(rank: int, world: int) -> dict:
    """Each case on torch's DDP (its default gradients) and on fusedist's: the gradients seen."""
    import fusedist

    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(3, 4, generator=gen) for _ in range(6)]
    results = {}
    for name, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        torch.manual_seed(0)
        results[name, "moved"] = _training_steps(cls(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))), batches, rank)
        torch.manual_seed(0)
        model = cls(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), process_group=dist.group.WORLD)
        results[name, "hook"] = _hook_keeping_gradients(model, batches)
        torch.manual_seed(0)
        model = cls(_UsedOutOfOrder(), bucket_cap_mb=0.00002)  # (a bucket per parameter)
        results[name, "cached"] = _cached_before_the_rebuild(model, batches)
    results["slots kept"] = _slots_kept_after_the_rebuild(rank)
    return results


def check_moved_gradients(per_rank: list) -> None:
    for res in per_rank:
        assert res.pop("slots kept"), "a slot moved across the rebuild is copied out at every backward"
        for case in ("moved", "hook", "cached"):
            ours, theirs = res["fusedist", case], res["torch", case]
            assert len(ours) == len(theirs), (case, len(ours), len(theirs))
            for i, (a, b) in enumerate(zip(ours, theirs)):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{case}, tensor {i}: {m}")


def test_a_slot_moved_off_its_bucket_is_cut_anew_there_and_the_moved_tensor_keeps_its_memory():
    params = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(4))]
    layout = build_layout(params, ["p0", "p1"], caps=[1 << 20], world_size=2, device=torch.device("cpu"))
    first = layout.grad_view(params[0])
    bucket = layout.slots[params[0]].bucket
    mine = torch.full((3, 2), 7.0)
    first.data = mine  # what Module._apply or a hand "detach" does to a p.grad
    again = layout.grad_view(params[0])
    assert again is not first and torch.equal(first, mine)
    again.fill_(1.0)
    offset = layout.slots[params[0]].offset - bucket.start
    assert torch.equal(bucket.data[offset:offset + 6], torch.ones(6)), "the new slot is not on the bucket's memory"
    assert torch.equal(mine, torch.full((3, 2), 7.0)), "the moved tensor's memory was written"
    assert layout.grad_view(params[0]) is again  # cut once: the same tensor while it stays there
