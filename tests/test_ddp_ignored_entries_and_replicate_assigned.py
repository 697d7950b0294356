"""Entries of the model that move or leave after wrapping, and Parameters assigned into a replicated
module before its first forward; one 2-rank launch (gloo) for the file.

* Parameters and buffers named in ``_ddp_params_and_buffers_to_ignore`` stay rank-local by identity
  after a ``ModuleList.insert`` renumbers their entry: trained as torch's DDP trains a model built with
  the entry under its new name from the start (torch's own buffer broadcast matches the names at every
  forward, so it broadcasts the moved entry's buffers); an entry inserted under the ignored names is
  refused as any inserted one; a copy of the wrapper ignores the copied entries (Note [ignored entries
  followed by identity] in fusedist/ddp/torch_surface.py).
* A submodule removed from the model is not followed any more: collected once the user drops it, and a
  Parameter assigned into it later is not taken for one of the model's (Note [modules that left the
  tree] in fusedist/ddp/module_tree.py).
* A module built on the meta device, replicated, loaded with ``load_state_dict(assign=True)``: a step
  before its first forward is refused (also after ``module.w = nn.Parameter(...)`` or a submodule
  assigned), and it trains as torch's replicate through the same flow and torch.optim.SGD on the global
  batch (Note [assigned before the first forward] in fusedist/ddp/replicate.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of


class Local(nn.Module):
    """A rank-local scale and running count (DDP ignores both)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.total.add_(torch.distributed.get_rank() + 1)  # (rank-dependent)
        return x * self.scale + self.total


class Stack(nn.Module):
    def __init__(self, lead=()):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([*lead, nn.Linear(4, 4), Local(), nn.Linear(4, 4)])
        self.register_buffer("shared", torch.zeros(1))  # (broadcast: torch's DDP syncs buffers with one)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _train(model, ddp, rank, change, steps=3):
    """SGD steps on rank-dependent inputs, ``change(model)`` before the second; the state dict's values,
    or the error's text."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    torch.manual_seed(100 + rank)
    try:
        for s in range(steps):
            if s == 1:
                change(model)
            ddp(torch.randn(3, 4) + rank).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as exc:
        return str(exc)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ignored_after_insert(rank, world):
    import fusedist

    def insert_and_assign(at):
        def change(model):
            model.layers.insert(0, nn.Identity())  # the ignored entry becomes layers.2
            model.layers[at].scale = nn.Parameter(model.layers[at].scale.detach() * (2 + rank))
        return change

    out = {}
    model = Stack()
    model._ddp_params_and_buffers_to_ignore = ["layers.1.scale", "layers.1.total"]
    out["ours"] = _train(model, fusedist.DistributedDataParallel(model), rank, insert_and_assign(2))
    # the reference: torch's DDP over the model with the entry under its new name from the start
    model = Stack(lead=[nn.Identity()])
    model._ddp_params_and_buffers_to_ignore = ["layers.2.scale", "layers.2.total"]
    out["torch"] = _train(model, nn.parallel.DistributedDataParallel(model), rank,
                          lambda m: setattr(m.layers[2], "scale",
                                            nn.Parameter(m.layers[2].scale.detach() * (2 + rank))))
    # torch's DDP through the same insertion: its buffer broadcast matches names, so the moved entry's
    # count is broadcast from rank 0
    model = Stack()
    model._ddp_params_and_buffers_to_ignore = ["layers.1.scale", "layers.1.total"]
    out["torch moved"] = _train(model, nn.parallel.DistributedDataParallel(model), rank,
                                lambda m: m.layers.insert(0, nn.Identity()))
    # a copy of the wrapper made after the insertion ignores the copies of the same entries
    model = Stack()
    model._ddp_params_and_buffers_to_ignore = ["layers.1.scale", "layers.1.total"]
    ddp = fusedist.DistributedDataParallel(model)
    model.layers.insert(0, nn.Identity())
    twin = copy.deepcopy(ddp)
    out["copy"] = ([n for n, _ in twin.ignored_parameters()], [n for n, _ in twin.synced_buffers()])
    # an entry with parameters inserted under the ignored names is refused as any inserted one
    model = Stack()
    model._ddp_params_and_buffers_to_ignore = ["layers.1.scale", "layers.1.total"]
    out["inserted"] = _train(model, fusedist.DistributedDataParallel(model), rank,
                             lambda m: m.layers.insert(1, Local()))
    return out


class Acts(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.acts = nn.ModuleList([nn.Tanh()])

    def forward(self, x):
        x = self.fc(x)
        for act in self.acts:
            x = act(x)
        return x


def _removed_modules(rank, world):
    """Parameterless activations swapped in and out, a forward after each; one removed activation kept
    by the user and given a Parameter."""
    import gc
    import weakref

    import fusedist
    from fusedist.ddp import trainable

    def cycles(ddp):
        refs = []
        for _ in range(20):
            ddp.module.acts.insert(0, nn.ReLU())
            ddp(torch.randn(2, 4)).sum().backward()
            refs.append(weakref.ref(ddp.module.acts[0]))
            del ddp.module.acts[0]
            ddp(torch.randn(2, 4)).sum().backward()
        return refs

    out = {}
    model = Acts()
    ddp = fusedist.DistributedDataParallel(model)
    before = len(trainable._followed)
    refs = cycles(ddp)
    gc.collect()
    out["collected"] = sum(r() is None for r in refs)
    out["entries grown"] = len(trainable._followed) - before

    def kept_and_assigned(m):
        gone = m.acts[0]
        del m.acts[0]
        m(torch.randn(2, 4) + rank)  # (the change is seen)
        gone.alpha = nn.Parameter(torch.ones(1))  # no longer the model's

    model = Acts()
    out["ours"] = _train(model, fusedist.DistributedDataParallel(model), rank, kept_and_assigned)
    model = Acts()
    out["torch"] = _train(model, nn.parallel.DistributedDataParallel(model), rank, kept_and_assigned)
    return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _refused(opt) -> "str | None":
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None


def _assigned_before_first_forward(rank, world):
    from torch.distributed._composable.replicate import replicate as torch_replicate

    import fusedist

    torch.manual_seed(3)
    state = Net().state_dict()
    g = torch.Generator().manual_seed(5)
    x_all, y_all = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    x, y = x_all[4 * rank:4 * rank + 4], y_all[4 * rank:4 * rank + 4]
    out = {}

    def meta_loaded():
        with torch.device("meta"):
            model = fusedist.replicate(Net())
        model.load_state_dict(state, assign=True)
        return model

    model = meta_loaded()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.fc1(x).sum().backward()  # a submodule on its own: this rank's gradients
    out["loaded"] = _refused(opt)
    opt.zero_grad()
    ref = Net()  # torch.optim.SGD on the global batch
    ref.load_state_dict(state)
    with torch.device("meta"):
        theirs = torch_replicate(Net())  # torch's replicate through the same flow
    theirs.load_state_dict(state, assign=True)
    trained = ((model, x, y), (ref, x_all, y_all), (theirs, x, y))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m, _, _ in trained[1:]]
    for _ in range(3):
        for (m, inputs, targets), o in zip(trained, [opt, *opts]):
            (m(inputs) - targets).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    out["params"] = [[p.detach().clone() for p in m.parameters()] for m, _, _ in trained]

    model = fusedist.replicate(Net())
    model.fc2.weight = nn.Parameter(torch.randn(3, 5))
    opt = torch.optim.SGD([model.fc2.weight], lr=0.1)  # (only the assigned one)
    model.fc2(torch.randn(2, 5)).sum().backward()
    out["assigned"] = _refused(opt)

    model = fusedist.replicate(Net())
    model.fc2 = nn.Linear(5, 3)
    opt = torch.optim.SGD(model.fc2.parameters(), lr=0.1)
    model.fc2(torch.randn(2, 5)).sum().backward()
    out["submodule"] = _refused(opt)
    return out


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, {
        "test_ignored_entries_stay_ignored_after_an_insertion": {"ignored": (_ignored_after_insert, ())},
        "test_removed_submodules_are_not_followed": {"removed": (_removed_modules, ())},
        "test_parameters_assigned_before_a_replicated_first_forward_are_watched": {
            "assigned": (_assigned_before_first_forward, ())},
    }, world=2, timeout=180)


def test_ignored_entries_stay_ignored_after_an_insertion(launched):
    per_rank = results_of(launched, "ignored")
    for rank, out in enumerate(per_rank):
        ours, theirs = out["ours"], out["torch"]
        assert isinstance(ours, dict), f"rank {rank}: {ours}"
        assert list(ours) == list(theirs)
        for key in ours:  # fp32, 3 SGD steps of the same averaged gradients
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-6, msg=key)
        assert out["copy"] == (["layers.2.scale"], ["shared"]), out["copy"]
        msg = out["inserted"]
        assert isinstance(msg, str), f"rank {rank}: an entry inserted under the ignored names trained"
        assert "['layers.1 (Local)'] registered without torch's registration hook" in msg, msg
        assert "'layers.1.scale'" in msg, msg
    # each rank's count is its own (3 forwards adding rank + 1); torch's DDP through the same insertion
    # broadcasts the moved entry's count from rank 0 before each forward
    assert [out["ours"]["layers.2.total"].tolist() for out in per_rank] == [[3.0] * 4, [6.0] * 4]
    assert [out["torch moved"]["layers.2.total"].tolist() for out in per_rank] == [[3.0] * 4, [4.0] * 4]


def test_removed_submodules_are_not_followed(launched):
    for rank, out in enumerate(results_of(launched, "removed")):
        assert out["collected"] == 20, out
        assert out["entries grown"] <= 0, out
        ours, theirs = out["ours"], out["torch"]
        assert isinstance(ours, dict), f"rank {rank}: {ours}"
        for key in ours:  # fp32, the same averaged gradients
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-6, msg=key)


def test_parameters_assigned_before_a_replicated_first_forward_are_watched(launched):
    for rank, out in enumerate(results_of(launched, "assigned")):
        for case in ("loaded", "assigned", "submodule"):
            msg = out[case]
            assert msg is not None, f"rank {rank}: the step before the first forward ({case}) was taken"
            assert "before the first forward of the replicated Net" in msg, (case, msg)
        ours, global_batch, theirs = out["params"]
        for a, b, c in zip(ours, global_batch, theirs):
            # fp32, a batch of 8 summed in another order across the ranks' halves: a few ulps
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
