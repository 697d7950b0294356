"""Parameters whose storage is replaced between ZeroRedundancyOptimizer steps, and DTensor entries
given to ``fusedist.fsdp.load_full_state_dict``, against torch, world size 2 on gloo.

* ``p.set_(t)`` under no_grad, a parametrization's setter (``orthogonal``: ``module.weight = Q``
  calls ``original.set_``) and ``p.data = t`` replace a parameter's storage after the first step
  pointed it into ZeRO's flat buffer: the next steps update the new values, as torch's optimizers
  do (Note [parameters moved off the flat buffer] in fusedist/zero/shards.py). Every rank sees the
  same batch, so a single-process ``torch.optim.AdamW`` on the same model is the reference.
* A state dict whose values are DTensors (torch's FSDP2 ``state_dict()``) loads whole (Note
  [DTensor entries loaded] in fusedist/fsdp/state_dict_hooks.py).
"""

import pytest
import torch
from torch import nn

from models import TwoLinearTanh
from shared_rank_launch import launch_for_selected, results_of


def _replace(kind: str, model: TwoLinearTanh) -> None:
    """Replace the storage of ``fc``'s weight (and ``out``'s bias) with new values."""
    with torch.no_grad():
        if kind == "set_":
            model.fc.weight.set_(torch.full((4, 4), 0.5))
            model.out.bias.set_(torch.randn(2, generator=torch.Generator().manual_seed(3)))
        elif kind == "orthogonal":
            q, _ = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(3)))
            model.fc.weight = q.contiguous()  # (qr's Q is column-major; the setter keeps its strides)
        else:
            model.fc.weight.data = torch.full((4, 4), 0.5)


def _train(model, opt, forward, kind: str) -> dict:
    gen = torch.Generator().manual_seed(1)  # the same batches on every rank
    for s in range(3):
        if s == 1:
            _replace(kind, model)
        x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(forward(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _replaced_worker(rank, world_size):
    import fusedist

    errors = {}
    cases = [("set_", 1, True, None), ("orthogonal", 2, True, None), ("data", 1, False, None),
             ("set_", 2, True, "cpu")]
    for kind, stage, with_ddp, offload in cases:
        ref_model = TwoLinearTanh(kind == "orthogonal")
        ref = _train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=0.05), ref_model, kind)
        model = TwoLinearTanh(kind == "orthogonal")
        forward = fusedist.DistributedDataParallel(model) if with_ddp else model
        opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.05,
                                               offload=offload)
        got = _train(model, opt, forward, kind)
        errors[kind, stage, with_ddp, offload] = max((got[k] - ref[k]).abs().max().item() for k in ref)

    model = TwoLinearTanh()
    ddp = fusedist.DistributedDataParallel(model)
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05)
    ddp(torch.randn(2, 4)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.out.bias.set_(torch.zeros(1))  # broadcasts in the forward; its shard has 2 elements
    ddp(torch.randn(2, 4)).sum().backward()
    try:
        opt.step()
        refusal = None
    except RuntimeError as exc:
        refusal = str(exc)
    return errors, refusal


def test_replaced_parameter_storage_is_stepped_as_torch(launched):
    for errors, refusal in results_of(launched, "replaced"):
        for case, err in errors.items():
            assert err < 1e-5, (case, err)
        assert refusal is not None and "'out.bias'" in refusal and "(1,)" in refusal, refusal


def _dtensor_worker(rank, world_size):
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    fully_shard(theirs[0], mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    torch.manual_seed(1)
    ours = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    fusedist.fully_shard(ours[0], mesh=mesh)
    fusedist.fully_shard(ours, mesh=mesh)
    sd = theirs.state_dict()  # DTensor values
    fusedist.fsdp.load_full_state_dict(ours, sd)
    got = fusedist.fsdp.full_state_dict(ours)
    return max((got[k] - v.full_tensor()).abs().max().item() for k, v in sd.items())


def test_load_full_state_dict_takes_dtensor_entries(launched):
    assert results_of(launched, "dtensor") == [0.0, 0.0]


@pytest.fixture(scope="module")
def launched(request):
    """Both tests' cases in one launch of 2 ranks (each builds its own models)."""
    return launch_for_selected(request, {
        "test_replaced_parameter_storage_is_stepped_as_torch": {"replaced": (_replaced_worker, ())},
        "test_load_full_state_dict_takes_dtensor_entries": {"dtensor": (_dtensor_worker, ())},
    }, 2, timeout=240)
