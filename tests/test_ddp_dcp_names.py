"""torch's distributed-checkpoint helpers name a fusedist DDP model's state as torch DDP's
(Note [checkpoint names through the DDP wrapper] in fusedist/ddp/dcp_names.py): without DDP's
``module.``, for the model and the optimizer, nested and flattened, also under
``torch.compile``. So a ``dcp.save`` of a torch DDP job resumes on fusedist DDP with
``dcp.load`` + ``set_state_dict``, and the reverse, continuing as the uninterrupted torch run.
Before, the names kept ``module.`` and the load failed ("Missing key in checkpoint state_dict:
model.module.a.weight").

Tolerance: fp32 AdamW on 2 gloo ranks, both sides averaging the same two gradients: the
resumed runs equal the uninterrupted torch DDP run to 1e-6 (a few ulps per step on
parameters of magnitude ~0.5; a lost optimizer state moves them by ~lr = 1e-2).
"""

from __future__ import annotations

import torch
from torch import nn

from fusedist.testing import run_distributed

TOL = 1e-6


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _steps(model, opt, rank, seed, first, last):
    for step in range(first, last):
        g = torch.Generator().manual_seed(seed + 100 * step + rank)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _names(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opt)
    _, flat_osd = get_state_dict(model, opt, options=flat)
    return sorted(msd), sorted(osd["state"]), sorted(flat_osd)


def _resume(kind_from, kind_to, directory, rank, seed):
    """Three steps on ``kind_from``, dcp.save, a fresh ``kind_to`` model dcp.load-ed, three more."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fusedist

    wrap = dict(torch=TorchDDP, fusedist=fusedist.DistributedDataParallel)
    model = wrap[kind_from](_net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, rank, seed, 0, 3)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)
    model = wrap[kind_to](nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    box = {"model": msd, "optim": osd}
    dcp.load(box, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=box["model"], optim_state_dict=box["optim"])
    _steps(model, opt, rank, seed, 3, 6)
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank, world, seed, root):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fusedist

    out = {}
    theirs, ours = TorchDDP(_net()), fusedist.DistributedDataParallel(_net())
    for model in (theirs, ours):
        _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, seed, 0, 1)
    out["names"] = (_names(theirs, torch.optim.AdamW(theirs.parameters())),
                    _names(ours, torch.optim.AdamW(ours.parameters())))
    out["compiled"] = [sorted(get_model_state_dict(torch.compile(m, backend="eager"))) for m in (theirs, ours)]
    reference = TorchDDP(_net())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _steps(reference, ref_opt, rank, seed, 0, 6)
    expected = [p.detach().clone() for p in reference.parameters()]
    for kind_from, kind_to in (("torch", "fusedist"), ("fusedist", "torch"), ("fusedist", "fusedist")):
        directory = f"{root}/{kind_from}-{kind_to}"
        dist.barrier()
        got = _resume(kind_from, kind_to, directory, rank, seed)
        out[f"{kind_from}->{kind_to}"] = max((a - b).abs().max().item() for a, b in zip(expected, got))
    return out


def test_dcp_names_match_torch_ddp_and_checkpoints_move_both_ways(tmp_path):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    for out in run_distributed(_worker, 2, seed, str(tmp_path), timeout=180):
        theirs, ours = out["names"]
        assert ours == theirs, (seed, theirs, ours)
        assert not any(k.startswith("module.") for k in ours[0]), (seed, ours)
        assert out["compiled"][0] == out["compiled"][1], (seed, out["compiled"])
        for case in ("torch->fusedist", "fusedist->torch", "fusedist->fusedist"):
            assert out[case] <= TOL, (seed, case, out[case])
