"""``fully_shard`` refusals and names decided before any collective, in one process:

* a module listed twice in ``fully_shard([...])``: torch's FSDP2 refuses it (its second
  application to the module); fusedist took it once, silently. Refused now, naming the
  module's class and the items it is at, before anything changes.
* the root unit in messages: "the root module (ClassName)", as other units are named by their
  path and class.
"""

from __future__ import annotations

import pytest
from torch import nn

import fusedist
from fusedist.fsdp.state import state_of
from fusedist.fsdp.unit import ShardedUnit


@pytest.mark.parametrize("items", [(0, 0), (1, 0, 2, 0)], ids=["twice", "among-others"])
def test_a_module_listed_twice_is_refused_as_torch_does(items):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for shard in (torch_fully_shard, fusedist.fully_shard):
        pool = [nn.Linear(2, 2), nn.Linear(2, 3), nn.Tanh()]
        listed = [pool[i] for i in items]
        with pytest.raises((AssertionError, ValueError)) as info:
            shard(listed)  # both refuse before any collective: no process group needed
        if shard is fusedist.fully_shard:
            places = ", ".join(str(k) for k, i in enumerate(items) if i == 0)
            assert f"the same Linear at items {places}" in str(info.value), str(info.value)
            assert isinstance(info.value, ValueError)
            assert all(state_of(m) is None for m in pool), "the refusal changed a module"
            assert type(pool[0]) is nn.Linear


class _Unit:
    """What the naming helpers read of a unit: its class, its path under the root once the root
    named it (None before, "" for the root's own unit) and its parameters' names in it."""

    label = ShardedUnit.label

    def __init__(self, name, path, names):
        self.name, self.path, self.names, self.member_paths = name, path, names, None


def test_the_root_unit_is_named_the_root_module_with_its_class():
    from fusedist.fsdp.param_view import param_name
    from fusedist.fsdp.replaced_modules import _refuse
    from fusedist.fsdp.tree_names import unit_listed, unit_named, unit_where

    root, block, unnamed = _Unit("Net", "", ["head.weight"]), _Unit("Block", "blocks.0", ["fc.weight"]), \
        _Unit("Net", None, ["head.weight"])
    assert unit_where(root) == unit_named(root) == unit_listed(root) == "the root module (Net)"
    assert param_name(root, 0, with_unit=True) == "'head.weight' of the root module (Net)"
    # other units, and the root before its first forward, as they were named
    assert unit_where(block) == "'blocks.0' (Block)" and unit_named(block) == "unit blocks.0 (Block)"
    assert unit_listed(block) == "blocks.0 (Block)"
    assert param_name(block, 0, with_unit=True) == "'blocks.0.fc.weight' of fully_shard(Block)"
    assert unit_where(unnamed) == "Net"
    assert param_name(unnamed, 0, with_unit=True) == "'head.weight' of fully_shard(Net)"
    with pytest.raises(RuntimeError, match=r"held parameters of the root module \(Net\), sharded"):
        head = nn.Linear(2, 2)
        _refuse("head", head, nn.Linear(2, 2), head, root)
