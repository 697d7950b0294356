"""``SyncBatchNorm.convert_sync_batchnorm`` on a model that holds one BatchNorm under several
names (Note [a layer held under several names] in fusedist/nn/_convert.py).

torch's conversion walks ``named_children``, which yields a shared child once per parent: in
``nn.Sequential(bn, act, bn)`` the second name kept the plain BatchNorm, which normalizes each
rank's batch alone. Every name must become the one synchronized layer. The 2-rank comparison
with ``nn.BatchNorm`` on the global batch is
tests/test_syncbn_torch_subclass_and_fx_leaf.py::test_a_batchnorm_applied_twice_synchronizes_both_calls.
"""

from __future__ import annotations

import warnings

import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from fusedist.nn import SyncBatchNorm


class _Reused(nn.Module):
    """A block applying its norm before and after its conv, the second use under another name."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(3)
        self.conv = nn.Conv1d(3, 3, 1)
        self.norm_again = self.norm

    def forward(self, x):
        return self.norm_again(self.conv(self.norm(x)))


def test_every_name_of_a_shared_batchnorm_becomes_the_one_synchronized_layer():
    bn = nn.BatchNorm1d(3, momentum=None)
    shared_branch = nn.BatchNorm1d(3)
    model = nn.Sequential(bn, nn.Tanh(), bn, _Reused(), nn.ModuleDict({"a": shared_branch, "b": shared_branch}))
    keys = list(model.state_dict())
    weight, running_var = bn.weight, bn.running_var
    converted = SyncBatchNorm.convert_sync_batchnorm(model)
    kinds = {name: type(m).__name__ for name, m in converted.named_modules(remove_duplicate=False)
             if isinstance(m, _BatchNorm)}
    assert set(kinds.values()) == {"SyncBatchNorm"} and len(kinds) == 6, kinds
    assert converted[0] is converted[2] and isinstance(converted[0], SyncBatchNorm)
    assert converted[3].norm is converted[3].norm_again
    assert converted[4]["a"] is converted[4]["b"]
    assert converted[0].weight is weight and converted[0].running_var is running_var
    assert converted[0].momentum is None
    assert list(converted.state_dict()) == keys


def test_a_shared_batchnorm_as_the_root_and_inside_itself_is_converted_once():
    class Holding(nn.BatchNorm1d):
        """A BatchNorm subclass holding a child (as timm's BatchNormAct2d holds its act)."""

    root = Holding(3)
    inner = nn.BatchNorm1d(3)
    root.add_module("extra", nn.Sequential(inner, inner))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the subclass's own forward is named in a warning)
        converted = SyncBatchNorm.convert_sync_batchnorm(root)
    assert isinstance(converted, SyncBatchNorm)
    assert converted.extra[0] is converted.extra[1] and isinstance(converted.extra[0], SyncBatchNorm)
    assert not any(type(m) is not SyncBatchNorm for m in converted.modules() if isinstance(m, _BatchNorm))


def test_lightnings_revert_turns_every_name_of_a_shared_layer_back_into_the_one_batchnorm():
    """Trainer(sync_batchnorm=True) reverts the layers at teardown: a shared layer converted into
    one SyncBatchNorm must become one BatchNorm again under every name, on the same tensors (the
    revert walked ``named_children`` too and left the second name a SyncBatchNorm)."""
    from fusedist.integrations.lightning import _FusedistSyncBatchNorm

    plugin = _FusedistSyncBatchNorm()
    norm = nn.BatchNorm1d(3)
    model = nn.Sequential(norm, nn.Tanh(), norm, _Reused())
    converted = plugin.apply(model)
    weight = converted[0].weight
    reverted = plugin.revert(converted)
    kinds = {name: type(m).__name__ for name, m in reverted.named_modules(remove_duplicate=False)
             if isinstance(m, _BatchNorm)}
    assert all(not isinstance(m, SyncBatchNorm) for m in reverted.modules()), kinds
    assert reverted[0] is reverted[2] and reverted[3].norm is reverted[3].norm_again, kinds
    assert reverted[0].weight is weight
