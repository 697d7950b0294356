"""fully_shard numerics against torch's FSDP2 where the mixed-precision policy meets unusual
parameters.

Complex parameters: ``MixedPrecisionPolicy.param_dtype`` casts floating parameters only, and a
real ``reduce_dtype`` must not apply to a complex gradient either (the cast would drop its
imaginary part: Note [unit gradients] in fusedist/fsdp/grads.py, ``UnitGrads.dtype_of``). FSDP2
clamps ``reduce_dtype`` to None where it equals ``param_dtype``, so its complex units reduce in
their own dtype; with another ``reduce_dtype`` its copy-in fails on the cast, so the reference
there is FSDP2 without a policy on the complex unit (``param_dtype`` does not touch it anyway).
NCCL has no complex dtypes, so the units' all-gathers and reduce-scatters carry complex buffers
as their real parts (``real_pairs`` in fusedist/_dtypes.py), as torch's NCCL backend does;
``NcclDtypes`` applies the direct-NCCL communicator's dtype check to a gloo run.

Gradient accumulation without synchronization (``set_requires_gradient_sync(False)``) with a
``reduce_dtype`` narrower than the gradients (fp32 parameters, bf16 reduce): FSDP2 keeps the
accumulator in ``reduce_dtype`` and adds each later fp32 gradient with ``+=``, one rounding per
addition; casting the gradient to bf16 before adding rounds twice.

At world size 2 a reduction is one addition (commutative) and a division by 2 (exact), so the
gradients and optimizer steps are bit-identical to FSDP2's.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fusedist.testing import run_distributed


class ComplexLinear(nn.Module):
    """``x @ w.T`` with a complex weight (a spectral or unitary layer)."""

    def __init__(self, d_out: int, d_in: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_out, d_in, dtype=torch.complex64))

    def forward(self, x):
        return x.to(torch.complex64) @ self.w.T


class ComplexNet(nn.Module):
    """A complex unit (5 rows: uneven at world size 2) feeding a real head."""

    def __init__(self):
        super().__init__()
        self.spectral = ComplexLinear(5, 3)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        return self.head(self.spectral(x).abs().to(self.head.weight.dtype)).float()


def _whole(model):
    """The whole parameters: DTensors' full tensors (FSDP2), or fusedist's full state dict."""
    import fusedist

    sd = model.state_dict()
    if any(hasattr(v, "full_tensor") for v in sd.values()):
        return {k: v.full_tensor().clone() for k, v in sd.items()}
    return {k: v.clone() for k, v in fusedist.fsdp.full_state_dict(model).items()}


def _steps(model, rank, steps=2):
    """The whole parameters before and after each SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    states = [_whole(model)]
    for _ in range(steps):
        model(torch.randn(4, 3, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        states.append(_whole(model))
    return states


class NcclDtypes:
    """A unit's communicator that refuses what NCCL cannot carry (complex tensors), with the
    direct-NCCL communicator's own dtype check; the collectives themselves are the wrapped one's."""

    def __init__(self, comm):
        self.comm = comm

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def _checked(self, *tensors):
        from fusedist.comm._nccl_types import nccl_dtype

        for t in tensors:
            nccl_dtype(t.dtype, "fully_shard collective")

    def all_gather(self, out, src, **kw):
        self._checked(out, src)
        return self.comm.all_gather(out, src, **kw)

    def reduce_scatter(self, out, src, **kw):
        self._checked(out, src)
        return self.comm.reduce_scatter(out, src, **kw)


def _complex_worker(rank, ws):
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    base = ComplexNet()
    out = {}
    # (policy, NCCL's dtypes only): FSDP2 on NCCL sends complex tensors as their real parts
    for name, kw, nccl in (("bf16 reduce", dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16), False),
                           ("fp32 reduce", dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), False),
                           ("nccl dtypes", {}, True)):
        ours, ref = copy.deepcopy(base), copy.deepcopy(base)
        fusedist.fully_shard(ours.spectral, mesh=mesh, mp_policy=fusedist.MixedPrecisionPolicy(**kw))
        fusedist.fully_shard(ours, mesh=mesh, mp_policy=fusedist.MixedPrecisionPolicy(**kw))
        if nccl:
            units = (ours.spectral._fs_state().unit, ours._fs_state().unit)
            comm = NcclDtypes(units[0].comm)  # one for both: the units must share their communicator
            for unit in units:
                unit.comm = comm
        # FSDP2 fails casting complex gradients to a real reduce_dtype other than param_dtype
        spectral_mp = TorchMP() if kw.get("reduce_dtype") == torch.float32 else TorchMP(**kw)
        torch_fully_shard(ref.spectral, mesh=mesh, mp_policy=spectral_mp)
        torch_fully_shard(ref, mesh=mesh, mp_policy=TorchMP(**kw))
        out[name] = (_steps(ours, rank), _steps(ref, rank))
    return out


def test_complex_parameters_match_fsdp2_under_real_policies_and_nccl_dtypes():
    for rank, out in enumerate(run_distributed(_complex_worker, 2)):
        for case, (got, want) in out.items():
            assert isinstance(got, list), (rank, case, got)
            step = want[1]["spectral.w"] - want[0]["spectral.w"]
            assert step.imag.abs().max() > 0  # the scenario: gradients with an imaginary part
            for i, (a, b) in enumerate(zip(got, want)):
                for k in b:
                    assert a[k].dtype == b[k].dtype, (rank, case, i, k, a[k].dtype)
                    assert torch.equal(a[k], b[k]), (rank, case, i, k, (a[k] - b[k]).abs().max())


def _accumulation_worker(rank, ws):
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 38), nn.ReLU(), nn.Linear(38, 6))
    out = {}
    for who, shard, mp in (("fusedist", fusedist.fully_shard, fusedist.MixedPrecisionPolicy),
                           ("torch", torch_fully_shard, TorchMP)):
        model = copy.deepcopy(base)
        for m in (model[0], model[2], model):
            shard(m, mesh=mesh, mp_policy=mp(reduce_dtype=torch.bfloat16))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(2):
            for micro in range(3):
                model.set_requires_gradient_sync(micro == 2)
                model(torch.randn(4, 16, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        out[who] = _whole(model)
    return out


def test_unsynchronized_accumulation_in_a_narrower_reduce_dtype_rounds_as_fsdp2():
    for rank, out in enumerate(run_distributed(_accumulation_worker, 2)):
        for k, want in out["torch"].items():
            got = out["fusedist"][k]
            assert torch.equal(got, want), (rank, k, (got - want).abs().max())
