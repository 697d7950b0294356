"""torch's distributed checkpoint (DCP) of a model whose modules keep extra state
(``get_extra_state()`` / ``set_extra_state()``), continued with ``fusedist.checkpoint.load``.

DCP writes a module's extra state as an object beside the tensors. ``load`` read only the
tensors of such a checkpoint, so it refused it, naming the ``_extra_state`` key as missing from
the checkpoint that holds it (Note [torch's distributed checkpoints in load] in
``fusedist/checkpoint/_from_dcp.py``). Here torch's DDP and AdamW (two param groups with
different settings) save at 2 ranks; fusedist's DDP with a ZeroRedundancyOptimizer loads at 3,
takes the extra state as torch's ``load_state_dict`` does, and continues as the uninterrupted
run does (one global batch per step split over the ranks: within fp32 summation order).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusedist
from fusedist.testing import run_distributed

TOL = 1e-6


class Scaled(nn.Linear):
    """A layer with state outside its tensors (as an FP8 recipe's scaling history is kept)."""

    def __init__(self):
        super().__init__(8, 8)
        self.meta = {"scale": 1.0, "history": [0]}

    def forward(self, x):
        return super().forward(x) * self.meta["scale"]

    def get_extra_state(self):
        return dict(self.meta)

    def set_extra_state(self, state):
        self.meta = dict(state)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Scaled(), nn.Tanh(), nn.Linear(8, 3))
    model[2].meta = {"scale": 1.0 + seed, "history": list(range(seed + 1))}
    return model


def _groups(model) -> list:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 3e-2}]


def _steps(model, opt, rank, ws, first, last):
    for step in range(first, last):
        gen = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(12, 6, generator=gen), torch.randn(12, 3, generator=gen)
        n = 12 // ws
        loss = ((model(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]) ** 2).sum() * ws / 12
        loss.backward()
        opt.step()
        opt.zero_grad()


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _torch_save(rank, ws, where):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = nn.parallel.DistributedDataParallel(_model(0))
    opt = torch.optim.AdamW(_groups(model.module), lr=1e-2)
    _steps(model, opt, rank, ws, 0, 2)
    msd, osd = get_state_dict(model, opt)
    assert any(k.endswith("_extra_state") for k in msd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
    saved = _weights(model.module)
    _steps(model, opt, rank, ws, 2, 4)
    return {"saved": saved, "meta": dict(model.module[2].meta), "continued": _weights(model.module)}


def _fusedist_load(rank, ws, where):
    model = fusedist.DistributedDataParallel(_model(1))
    opt = fusedist.ZeroRedundancyOptimizer(_groups(model.module), optimizer_class=torch.optim.AdamW, lr=1e-2)
    fusedist.checkpoint.load(where, model, opt)
    loaded = _weights(model.module)
    _steps(model, opt, rank, ws, 2, 4)
    return {"loaded": loaded, "meta": dict(model.module[2].meta), "continued": _weights(model.module)}


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_torch_dcp_checkpoint_with_extra_state_loads_resharded(tmp_path):
    where = str(tmp_path / "ck")
    ref = run_distributed(_torch_save, 2, where)[0]
    assert ref["meta"] == {"scale": 1.0, "history": [0]}
    for res in run_distributed(_fusedist_load, 3, where):
        assert res["meta"] == ref["meta"]  # the saved extra state, not the target's own
        assert _diff(res["loaded"], ref["saved"]) == 0.0
        assert _diff(res["continued"], ref["continued"]) <= TOL


# ------------------------------------------------------------------ an EMA copy saved beside the model
def _ema_checkpoint(where, first: str, model_key: str = "model"):
    """A model, its AdamW, and an EMA copy with the model's names, saved with DCP (one process);
    ``first``: the entry written first."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model(0)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    _steps(model, opt, 0, 1, 0, 2)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    msd, osd = get_state_dict(model, opt)
    entries = {model_key: msd, "optim": osd, "ema": ema.state_dict()}
    order = [first] + [k for k in entries if k != first]
    dcp.save({k: entries[k] for k in order}, checkpoint_id=where)
    return _weights(model), _weights(ema)


def _load_single(where):
    model = _model(1)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    fusedist.checkpoint.load(where, model, opt)
    return _weights(model)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("first", ["ema", "model"])
def test_an_ema_copy_beside_the_model_is_not_loaded_as_the_model(tmp_path, first):
    weights, ema = _ema_checkpoint(str(tmp_path), first)
    loaded = _load_single(str(tmp_path))
    assert _diff(loaded, weights) == 0.0
    assert _diff(loaded, ema) > 0.1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_two_copies_of_the_model_none_called_model_are_refused(tmp_path):
    _ema_checkpoint(str(tmp_path), "ema", model_key="weights")
    with pytest.raises(fusedist.checkpoint.CheckpointError,
                       match=r"several entries \(('ema', 'weights'|'weights', 'ema')\) and none is called 'model'"):
        _load_single(str(tmp_path))


# ------------------------------------------------------------------ objects that run code when unpickled
class _Marks:
    """A pickle that, when loaded, creates the file ``path`` (what a hostile checkpoint would run)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_objects_in_a_torch_dcp_checkpoint_are_unpickled_restricted_unless_trusted(tmp_path):
    """Note [objects of a torch distributed checkpoint]: torch's planner unpickles a DCP
    checkpoint's objects with weights_only=False, so ``load`` ran a checkpoint's code where the
    docs promise the restricted unpickler unless trusted=True. The ordinary objects (extra state,
    step counts) still load restricted."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model(0)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    _steps(model, opt, 0, 1, 0, 2)
    msd, osd = get_state_dict(model, opt)
    plain, hostile = str(tmp_path / "plain"), str(tmp_path / "hostile")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=plain)
    assert _diff(_load_single(plain), _weights(model)) == 0.0  # (restricted: extra state, steps)
    marker = tmp_path / "ran"
    dcp.save({"model": msd, "optim": osd, "user": {"note": _Marks(str(marker))}}, checkpoint_id=hostile)
    with pytest.raises(fusedist.checkpoint.CheckpointError, match=r"entry 'user.note'.*trusted=True"):
        _load_single(hostile)
    assert not marker.exists()
    assert _diff(_load_single_trusted(hostile), _weights(model)) == 0.0
    assert marker.exists()


def _load_single_trusted(where):
    model = _model(1)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    fusedist.checkpoint.load(where, model, opt, trusted=True)
    return _weights(model)
