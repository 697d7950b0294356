"""convert_sync_batchnorm on BatchNorm subclasses: converted as torch converts them, and warned.

torch.nn.SyncBatchNorm.convert_sync_batchnorm turns every ``_BatchNorm`` -- subclasses
included -- into a plain SyncBatchNorm, so a subclass's own forward (timm's BatchNormAct2d
applies its activation there), its own parameters and its forward hooks are dropped without a
word. Ours converts the same way (the reference: torch's converted model, same structure and
state_dict) and warns once per such layer, naming its path and what it loses (Note
[converting BatchNorm subclasses] in fusedist/nn/sync_batch_norm.py). One process, no spawn.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn

from fusedist.nn import SyncBatchNorm


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's pattern: the activation is a child module applied by the layer's own forward."""

    def __init__(self, num_features):
        super().__init__(num_features)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(super().forward(x))


class ScaledBatchNorm1d(nn.BatchNorm1d):
    """A parameter of the subclass's own, used by its forward."""

    def __init__(self, num_features):
        super().__init__(num_features)
        self.alpha = nn.Parameter(torch.full((num_features,), 2.0))

    def forward(self, x):
        return super().forward(x) * self.alpha[:, None]


class NaiveSyncBatchNorm(nn.BatchNorm2d):
    """Another library's synchronizing BatchNorm (detectron2's pattern): replacing its forward is
    the point of the conversion."""

    def forward(self, x):
        return super().forward(x)


class StrictChecks2d(nn.BatchNorm2d):
    """Overrides only the input check: nothing of its own is lost."""

    def _check_input_dim(self, input):
        assert input.dim() == 4


def _model():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), BatchNormAct2d(4), StrictChecks2d(4), nn.BatchNorm2d(4),
                          nn.Sequential(nn.Flatten(), nn.Linear(64, 5), ScaledBatchNorm1d(5)))
    model[3].register_forward_hook(lambda m, i, o: None)
    return model


def _convert(converter, model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = converter(model)
    return converted, [str(w.message) for w in caught if "convert_sync_batchnorm" in str(w.message)]


def test_subclass_losses_are_named_and_conversion_matches_torchs():
    torch.manual_seed(0)
    model = _model()
    theirs, _ = _convert(nn.SyncBatchNorm.convert_sync_batchnorm, copy.deepcopy(model))
    ours, messages = _convert(SyncBatchNorm.convert_sync_batchnorm, model)
    # the same conversion as torch's: the same layers become SyncBatchNorm, the same state_dict
    assert [type(m).__name__ for m in ours.modules()] == [type(m).__name__ for m in theirs.modules()]
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert "4.2.alpha" not in ours.state_dict()
    # ... and every loss is named, by the layer's path, once per layer
    assert len(messages) == 3, messages
    act, hooked, scaled = messages
    assert "1 (BatchNormAct2d)" in act and "BatchNormAct2d.forward is not called" in act
    assert "3 (BatchNorm2d)" in hooked and "1 forward hook(s)" in hooked
    assert "4.2 (ScaledBatchNorm1d)" in scaled and "['alpha']" in scaled and "ScaledBatchNorm1d.forward" in scaled


def test_plain_layers_and_our_own_convert_silently():
    model = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.SyncBatchNorm(3), NaiveSyncBatchNorm(3),
                          StrictChecks2d(3), nn.BatchNorm3d(3, affine=False, track_running_stats=False))
    converted, messages = _convert(SyncBatchNorm.convert_sync_batchnorm, model)
    assert messages == []
    again, messages = _convert(SyncBatchNorm.convert_sync_batchnorm, converted)  # ours, converted again
    assert messages == [] and all(type(m) is SyncBatchNorm for m in again)
