"""Parts of torch's ZeroRedundancyOptimizer surface, in one process (no launch):

* torch exposes its whole-parameter partition as ``_partition_parameters()`` and
  ``_param_to_rank``, which scripts read to see which rank owns a layer. fusedist's shards cut
  parameters between ranks, so it has no such partition: reading either failed with a bare
  ``AttributeError: ... has no attribute '_param_to_rank'``. Each now raises an AttributeError
  saying why and what to read instead (Note [torch's whole-parameter partition] in
  fusedist/zero/torch_partition.py); ``hasattr`` still answers False.
* A string in an optimizer's per-parameter state survives ``load_state_dict``: torch's
  ``Optimizer.load_state_dict`` (which the inner optimizer's load went through) turned it into the
  text of a generator, different on every piece, so the next ``consolidate_state_dict`` raised on
  its receiving rank; torch's ZeroRedundancyOptimizer sets its local state directly and keeps it.
"""

import pytest
import torch
from torch import nn

import fusedist


@pytest.mark.parametrize("name, read", [("_partition_parameters()", lambda opt: opt._partition_parameters()),
                                        ("_param_to_rank", lambda opt: opt._param_to_rank)])
def test_torch_partition_attributes_say_why_there_is_no_owner_rank(name, read):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    assert hasattr(TorchZeRO, name.rstrip("()"))  # torch's optimizer has it
    model = nn.Linear(4, 3)
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    with pytest.raises(AttributeError) as caught:
        read(opt)
    text = str(caught.value)
    assert text.startswith(f"fusedist.ZeroRedundancyOptimizer (rank 0) has no {name}: it does not assign whole "
                           "parameters to ranks"), text
    assert "shard_state_dict()" in text and "consolidate_state_dict(to=...)" in text, text
    assert not hasattr(opt, name.rstrip("()"))
    model(torch.randn(2, 4)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()  # the optimizer trains on
    assert not torch.equal(before, model.weight)


class _Tagged(torch.optim.SGD):
    """SGD that records, per parameter, which rule stepped it (a string, as an optimizer's state may hold)."""

    _fusedist_elementwise = True

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p].setdefault("rule", "plain")
        return super().step(closure)


def test_a_string_in_the_loaded_state_survives_the_load_and_consolidation():
    model = nn.Linear(4, 3)
    model.empty = nn.Parameter(torch.zeros(0))  # (no shard holds it: its state is kept apart)
    params = list(model.parameters())
    opt = fusedist.ZeroRedundancyOptimizer(params, _Tagged, lr=0.1, momentum=0.9)
    saved = _Tagged([p.detach().clone().requires_grad_() for p in params], lr=0.1, momentum=0.9).state_dict()
    saved["state"] = {i: {"rule": "restarted", "momentum_buffer": torch.full(p.shape, 0.5)}
                      for i, p in enumerate(params)}
    opt.load_state_dict(saved)
    assert [st["rule"] for st in opt.optim.state.values()] == ["restarted"] * len(opt.optim.state), opt.optim.state
    (model(torch.randn(2, 4)).sum() + model.empty.sum()).backward()
    opt.step()
    opt.consolidate_state_dict(to=0)
    full = opt.state_dict()
    assert [full["state"][i]["rule"] for i in range(3)] == ["restarted"] * 3, full["state"]
