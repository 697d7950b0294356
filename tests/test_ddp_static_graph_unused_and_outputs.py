"""fusedist DDP against torch DDP where they differed: ``static_graph=True`` with parameters no
iteration uses, the second loss of a forward whose output is a dataclass, and a bare state
dict of a module whose own child is named ``module``. 2 gloo ranks, fresh random inputs; the
scenarios share one launch of the ranks (``launched``), the compiled-autograd one last."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import models
from shared_rank_launch import launch_for_selected, results_of


class _Unused(nn.Module):
    """A block called twice under reentrant checkpointing, and a head no loss uses (torch's
    documented ``static_graph`` cases)."""

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.out, self.unused = (nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2),
                                                        nn.Linear(8, 2))

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for _ in range(2):
            h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        return self.out(h)


def _static_graph_worker(rank, world_size, seed):
    import fusedist

    torch.manual_seed(seed)
    base = _Unused()
    runs = []
    for wrap in (nn.parallel.DistributedDataParallel, fusedist.DistributedDataParallel):
        model = wrap(copy.deepcopy(base), static_graph=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(seed + rank)
        grads = []
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(3, 4, generator=gen)).pow(2).sum().backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.step()
        runs.append((grads, [p.detach().clone() for p in model.parameters()]))
    models.assert_same_steps(*runs)


def test_static_graph_takes_parameters_no_iteration_uses_as_torch(launched):
    results_of(launched, "static graph")


@dataclasses.dataclass
class _Output:
    main: torch.Tensor
    aux: torch.Tensor
    note: str


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.main, self.aux = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return _Output(self.main(h), self.aux(h), "two heads")


def _two_losses_worker(rank, world_size, seed):
    import fusedist

    torch.manual_seed(seed)
    base = _TwoHeads()
    model = fusedist.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + rank))
    out = model(x)
    out.main.pow(2).sum().backward(retain_graph=True)
    out.aux.pow(2).sum().backward()
    # README: the second backward through the wrapper's output synchronizes too: avg(g1) + avg(g2)
    ref = copy.deepcopy(base)
    out = ref(x)
    (out.main.pow(2).sum() + out.aux.pow(2).sum()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        expected = q.grad.clone()
        dist.all_reduce(expected)
        torch.testing.assert_close(p.grad, expected / world_size)
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # (refused after a local backward)


def test_second_loss_of_a_dataclass_output_synchronizes(launched):
    results_of(launched, "two losses")


class _ChildNamedModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.module, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.module(x))


def _bare_keys_worker(rank, world_size, seed):
    import fusedist

    torch.manual_seed(seed)
    saved = _ChildNamedModule().state_dict()
    ours = fusedist.DistributedDataParallel(_ChildNamedModule())
    theirs = nn.parallel.DistributedDataParallel(_ChildNamedModule())
    ours.load_state_dict(saved)  # the bare module's keys, accepted as documented
    theirs.load_state_dict({"module." + k: v for k, v in saved.items()})
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b)
    ours.load_state_dict(theirs.state_dict())  # and the wrapper's own keys still


def test_bare_state_dict_of_a_module_with_a_child_named_module_loads(launched):
    results_of(launched, "bare keys")


def _compiled_autograd_worker(rank, world_size):
    import torch._dynamo.compiled_autograd as compiled_autograd

    import fusedist

    model = fusedist.DistributedDataParallel(nn.Linear(4, 2))
    replicated = fusedist.replicate(nn.Linear(4, 2))
    refused = []
    with compiled_autograd._enable(torch.compile(backend="eager")):
        for m in (model, replicated):
            try:
                m(torch.randn(3, 4)).sum().backward()
            except RuntimeError as exc:
                refused.append(str(exc))
        with torch.no_grad():
            model(torch.randn(3, 4))  # (an eval forward computes no gradients: not refused)
    model(torch.randn(3, 4)).sum().backward()  # without it, training goes on
    return refused


def test_compiled_autograd_is_refused_at_the_forward_not_a_stall(launched):
    """torch's DDP runs under compiled autograd with optimize_ddp='python_reducer'; fusedist's
    reducer cannot (its end-of-backward callback never runs): a clear error on every rank."""
    for refused in results_of(launched, "compiled autograd"):
        assert len(refused) == 2, refused
        assert all("compiled autograd is enabled" in r for r in refused), refused


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    def seed():
        return int(torch.randint(0, 10_000, ()).item())

    return launch_for_selected(request, {
        "test_static_graph_takes_parameters_no_iteration_uses_as_torch": {
            "static graph": (_static_graph_worker, (seed(),))},
        "test_second_loss_of_a_dataclass_output_synchronizes": {"two losses": (_two_losses_worker, (seed(),))},
        "test_bare_state_dict_of_a_module_with_a_child_named_module_loads": {
            "bare keys": (_bare_keys_worker, (seed(),))},
        "test_compiled_autograd_is_refused_at_the_forward_not_a_stall": {
            "compiled autograd": (_compiled_autograd_worker, ())},
    }, 2, timeout=240)
