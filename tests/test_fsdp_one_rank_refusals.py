"""What ``fully_shard`` refuses or takes must be decided alike on every rank, world size 2 on gloo:

* ``param.data = <whole value>`` on a parameter that the row-aligned layout places wholly on one
  rank: that rank's piece is the whole, the other's is empty. The empty-piece rank refused it
  alone and the other waited in the all-gather until the stall report. Every rank now takes the
  whole value (cut to its piece): the model then computes and trains as the unsharded model
  holding that value (FSDP2 silently keeps its old shard). A value of any other shape is refused
  on every rank with the same message.
  A parametrization's setter (``module.weight = value`` calls ``original.set_``) given the whole
  weight is taken the same way.
* a module inside a unit called on its own (``net.tail[0](x)`` after ``fully_shard([net.body,
  net.tail])``) computed on this rank's pieces (an empty output on one rank) and failed later in
  backward: refused at its forward on every rank, naming it and the member to call.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusedist
from fusedist.fsdp.state import state_of
from shared_rank_launch import launch_for_selected, results_of


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.tail = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))

    def forward(self, x):
        return self.tail(self.body(x))


def _sharded(reference):
    net = copy.deepcopy(reference)
    fusedist.fully_shard([net.body, net.tail])
    fusedist.fully_shard(net)
    return net


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def _train(net, batches, lr=0.1):
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def _whole_value_taken(rank, world, seed):
    torch.manual_seed(seed)
    reference = Net()
    net = _sharded(reference)
    _train(net, [_batch(0, rank)])
    _train(reference, [(torch.cat([_batch(0, r)[0] for r in range(world)]),
                        torch.cat([_batch(0, r)[1] for r in range(world)]))])
    unit = state_of(net.body).unit
    index = unit.names.index("[1].0.weight")
    sizes = [unit.layout.piece(index, r).numel for r in range(world)]
    value = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + 1))
    net.tail[0].weight.data = value.clone()  # the same whole value on every rank
    with torch.no_grad():
        reference.tail[0].weight.copy_(value)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed + 2))
    out, want = net(x).detach(), reference(x).detach()
    batches = [_batch(s, r) for s in (1, 2) for r in range(world)]
    _train(net, [batches[2 * i + rank] for i in range(2)])
    _train(reference, [(torch.cat([batches[2 * i + r][0] for r in range(world)]),
                        torch.cat([batches[2 * i + r][1] for r in range(world)])) for i in range(2)])
    got = fusedist.fsdp.full_state_dict(net)
    return sizes, out, want, {k: (got[k], v.detach()) for k, v in reference.state_dict().items()}


def _parametrization_setter_taken(rank, world, seed):
    from torch.nn.utils import parametrizations

    torch.manual_seed(seed)
    reference = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    parametrizations.weight_norm(reference[0])
    net = copy.deepcopy(reference)
    fusedist.fully_shard(net[0])
    fusedist.fully_shard(net)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + 1))
    net(x).sum().backward()  # the setter comes on a model that ran
    value = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed + 2))
    for model in (net, reference):
        model[0].weight = value  # weight_norm's setter: set_ on original0 (g) and original1 (v)
    return net(x).detach(), reference(x).detach()


def _other_shape_refused(rank, world, seed):
    torch.manual_seed(seed)
    net = _sharded(Net())
    net(torch.randn(2, 4)).sum().backward()
    net.tail[0].weight.data = torch.randn(2, 4)  # neither the whole (3, 4) nor a piece
    try:
        net(torch.randn(2, 4))
    except ValueError as exc:
        return str(exc)
    return None


def _child_called_alone(rank, world, seed):
    torch.manual_seed(seed)
    reference = Net()
    net = _sharded(reference)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed + 1))
    texts = []
    for stage in ("before any forward", "after a step"):
        try:
            net.tail[0](x).sum().backward()
            texts.append(None)
        except RuntimeError as exc:
            texts.append(str(exc))
        if stage == "before any forward":
            _train(net, [_batch(0, rank)])
            _train(reference, [(torch.cat([_batch(0, r)[0] for r in range(world)]),
                                torch.cat([_batch(0, r)[1] for r in range(world)]))])
    out, want = net(x).detach(), reference(x).detach()  # the unit's own forward still runs its modules
    return texts, out, want


SCENARIOS = {
    "test_whole_value_assigned_on_every_rank_is_taken_as_the_unsharded_model_takes_it": {
        "whole": (_whole_value_taken, (11,))},
    "test_parametrization_setter_given_the_whole_weight_is_taken_as_torch_takes_it": {
        "setter": (_parametrization_setter_taken, (14,))},
    "test_value_of_another_shape_is_refused_alike_on_every_rank": {"other": (_other_shape_refused, (12,))},
    "test_module_inside_a_group_unit_called_alone_is_refused_on_every_rank": {"child": (_child_called_alone, (13,))},
}


@pytest.fixture(scope="module")
def launched(request):
    # a short stall report: before the fix one rank waited in the gather its peer never joined
    return launch_for_selected(request, SCENARIOS, 2, timeout=120, env={"FUSEDIST_TIMEOUT_S": "20"})


def test_whole_value_assigned_on_every_rank_is_taken_as_the_unsharded_model_takes_it(launched):
    """fp32, the same ops on the same values: outputs to default fp32 tolerance; after two SGD
    steps on the global batch (the gradient mean summed in another order), 1e-5."""
    for sizes, out, want, entries in results_of(launched, "whole"):
        assert sorted(sizes) == [0, 12], sizes  # the premise: wholly on one rank
        torch.testing.assert_close(out, want)
        for key, (got, ref) in entries.items():
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_parametrization_setter_given_the_whole_weight_is_taken_as_torch_takes_it(launched):
    """fp32, the same ops on the same values: default fp32 tolerance."""
    for out, want in results_of(launched, "setter"):
        torch.testing.assert_close(out, want)


def test_value_of_another_shape_is_refused_alike_on_every_rank(launched):
    texts = results_of(launched, "other")
    assert texts[0] is not None and texts[0] == texts[1], texts
    assert "0.weight" in texts[0] and "(2, 4)" in texts[0] and "rank 0: " in texts[0], texts[0]


def test_module_inside_a_group_unit_called_alone_is_refused_on_every_rank(launched):
    for texts, out, want in results_of(launched, "child"):
        before, after = texts  # the unit's path under the root is known from the first forward on
        assert before is not None and "'<Sequential, item 1 of the list>.0' (Linear)" in before, before
        assert after is not None and "module 'tail.0' (Linear)" in after and "Call 'tail'" in after, after
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
