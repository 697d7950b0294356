"""SyncBatchNorm as torch's layer to other code: ``torch.fx`` symbolic tracing and
``isinstance`` checks, against torch.

torch's tracer keeps its own layers (``torch.nn.SyncBatchNorm`` included) as leaves and
traces into every other module; fusedist's layer records itself as the same leaf, so a
converted model traces (fx tools: feature extraction, FX quantization, conv-bn fusion) and
the traced model still synchronizes. Oracle: ``nn.BatchNorm`` on the concatenated global batch
(torch's SyncBatchNorm does not run on CPU). The layer is a ``torch.nn.SyncBatchNorm``, so
code that recognizes torch's layer by ``isinstance`` (weight-decay groupings, Lightning's
revert, torch's own conversion) treats it the same way.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from shared_rank_launch import launch_for_selected, results_of


def _net(bn_cls):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 1), bn_cls(4), nn.ReLU(),
                         nn.Sequential(nn.Conv2d(4, 4, 1), bn_cls(4, momentum=None)))


def _converted():
    from fusedist.nn import SyncBatchNorm

    model = SyncBatchNorm.convert_sync_batchnorm(_net(nn.BatchNorm2d))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SyncBatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-1, 1)
    return model


def test_fx_trace_of_a_converted_model_keeps_the_layers_as_leaves():
    from fusedist.nn import SyncBatchNorm

    model = _converted()
    reference = _net(nn.BatchNorm2d)
    reference.load_state_dict(model.state_dict())
    traced = torch.fx.symbolic_trace(model)
    called = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert called == ["0", "1", "2", "3.0", "3.1"], called
    assert isinstance(traced.get_submodule("3.1"), SyncBatchNorm)
    x = torch.randn(5, 3, 4, 3)
    for _ in range(2):  # training without a process group: the local batch, running stats updated
        torch.testing.assert_close(traced(x), reference(x))
    torch.testing.assert_close(traced.state_dict(), reference.state_dict())
    # an fx tool on the traced model: conv-bn fusion in eval, as for torch's BatchNorm
    from torch.fx.experimental.optimization import fuse

    model.eval()
    reference.eval()
    fused = fuse(copy.deepcopy(model))
    torch.testing.assert_close(fused(x), reference(x), atol=1e-5, rtol=1e-5)


def _traced_training_worker(rank, world):
    model = _converted()
    reference = _net(nn.BatchNorm2d)
    reference.load_state_dict(model.state_dict())
    traced = torch.fx.symbolic_trace(model)
    worst = 0.0
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        xs = [torch.randn(2 + r, 3, 3, 2, generator=gen) for r in range(world)]
        dys = [torch.randn(2 + r, 4, 3, 2, generator=gen) for r in range(world)]
        out = traced(xs[rank])
        out.backward(dys[rank])
        full = reference(torch.cat(xs))
        full.backward(torch.cat(dys))
        start = sum(x.shape[0] for x in xs[:rank])
        worst = max(worst, (out - full[start:start + out.shape[0]]).abs().max().item())
        for p, q in zip(traced.parameters(), reference.parameters()):
            grad = p.grad.clone()
            torch.distributed.all_reduce(grad)
            worst = max(worst, (grad - q.grad).abs().max().item())
            p.grad = q.grad = None
    for name, buf in reference.state_dict().items():
        worst = max(worst, (traced.state_dict()[name].double() - buf.double()).abs().max().item())
    return worst


def test_fx_traced_model_still_synchronizes_in_training(launched):
    worst = results_of(launched, "traced training")
    assert max(worst) < 1e-5, worst


def _applied_twice_worker(rank, world):
    """A model applying one BatchNorm twice (``nn.Sequential(bn, act, bn)``), converted, against
    the unconverted model on the global batch: both calls synchronize (Note [a layer held under
    several names] in fusedist/nn/_convert.py). The worst difference."""
    from fusedist.nn import SyncBatchNorm

    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3, momentum=None)
    reference = nn.Sequential(nn.Linear(4, 3), bn, nn.Tanh(), bn)
    model = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
    worst = 0.0
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        xs = [torch.randn(2 + r, 4, generator=gen) for r in range(world)]
        dys = [torch.randn(2 + r, 3, generator=gen) for r in range(world)]
        out = model(xs[rank])
        out.backward(dys[rank])
        full = reference(torch.cat(xs))
        full.backward(torch.cat(dys))
        start = sum(x.shape[0] for x in xs[:rank])
        worst = max(worst, (out - full[start:start + out.shape[0]]).abs().max().item())
        for p, q in zip(model.parameters(), reference.parameters()):
            grad = p.grad.clone()
            torch.distributed.all_reduce(grad)
            worst = max(worst, (grad - q.grad).abs().max().item())
            p.grad = q.grad = None
    for name, buf in reference.state_dict().items():
        worst = max(worst, (model.state_dict()[name].double() - buf.double()).abs().max().item())
    return worst


def test_a_batchnorm_applied_twice_synchronizes_both_calls(launched):
    worst = results_of(launched, "applied twice")
    assert max(worst) < 1e-5, worst


# ----------------------------------------------------------------------------- isinstance
def _decayed(model: nn.Module) -> list:
    """A detectron2-style weight-decay grouping: no decay for the parameters of norm layers,
    recognized by ``isinstance`` against torch's classes."""
    norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.GroupNorm, nn.LayerNorm)
    return sorted(f"{m_name}.{p_name}".lstrip(".") for m_name, m in model.named_modules()
                  if not isinstance(m, norms) for p_name, _ in m.named_parameters(recurse=False))


def test_third_party_isinstance_checks_treat_the_layer_as_torchs():
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    from fusedist.nn import SyncBatchNorm

    ours = _converted()
    theirs = nn.SyncBatchNorm.convert_sync_batchnorm(_net(nn.BatchNorm2d))
    theirs.load_state_dict(ours.state_dict())
    layer = ours[3][1]
    assert isinstance(layer, nn.SyncBatchNorm) and isinstance(layer, _BatchNorm)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [type(b) for b in ours.buffers()] == [type(b) for b in theirs.buffers()]
    assert _decayed(ours) == _decayed(theirs) == sorted(["0.weight", "0.bias", "3.0.weight", "3.0.bias"]), \
        (_decayed(ours), _decayed(theirs))
    # torch's own conversion of an already converted model rebuilds the layers as torch's
    again = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ours))
    assert type(again[1]) is nn.SyncBatchNorm
    assert torch.equal(again[1].running_var, ours[1].running_var)
    # conv-bn fusion on the eval model
    ours.eval()
    x = torch.randn(3, 3, 4, 2)
    fused = fuse_conv_bn_eval(ours[0], ours[1])
    torch.testing.assert_close(fused(x), ours[1](ours[0](x)), atol=1e-5, rtol=1e-5)
    assert isinstance(SyncBatchNorm(2, process_group=None), nn.SyncBatchNorm)


def test_lightning_revert_gives_batchnorm_on_the_same_tensors():
    layer_sync = pytest.importorskip("lightning.pytorch.plugins.layer_sync")

    model = _converted()
    x = torch.randn(4, 3, 3, 3)
    model(x)  # one training step of statistics
    model.eval()
    expected = model(x)
    weight = model[1].weight
    reverted = layer_sync.TorchSyncBatchNorm().revert(model)
    kinds = [type(m).__name__ for m in reverted.modules()]
    assert "SyncBatchNorm" not in kinds and kinds.count("_BatchNormXd") == 2, kinds
    assert reverted[1].weight is weight
    torch.testing.assert_close(reverted.eval()(x), expected)  # (Lightning's revert does not keep the eval flag)


def _wrap_both(rank, world):
    import fusedist

    model = _converted()
    with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU modules"):
        torch.nn.parallel.DistributedDataParallel(model)  # torch's check, as for its own layer
    fusedist.DistributedDataParallel(model)(torch.randn(4, 3, 5, 5)).sum().backward()


def test_torchs_ddp_refuses_it_on_cpu_as_its_own_and_fusedists_runs_it(launched):
    results_of(launched, "wrap both")


@pytest.fixture(scope="module")
def launched(request):
    """The 2-rank checks in one launch (each builds its own model)."""
    return launch_for_selected(request, {
        "test_fx_traced_model_still_synchronizes_in_training": {"traced training": (_traced_training_worker, ())},
        "test_torchs_ddp_refuses_it_on_cpu_as_its_own_and_fusedists_runs_it": {"wrap both": (_wrap_both, ())},
        "test_a_batchnorm_applied_twice_synchronizes_both_calls": {"applied twice": (_applied_twice_worker, ())},
    }, 2, timeout=240)
