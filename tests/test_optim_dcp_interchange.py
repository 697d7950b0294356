"""Fused optimizers' state dicts through torch's distributed checkpoint, both ways with torch's
optimizers (Note [param groups in torch's keys] in fusedist/optim/_base.py): DCP loads by the
target's flattened keys, so each library refused the other's checkpoint ("Missing key in
checkpoint state_dict: ...param_groups.0.master_weights" / "...foreach"). After the load the
two continue alike: one more step each, fp32, within 1e-6 (the fused kernels' operation order
differs from torch's by an ulp or so; a state lost or misplaced is off by ~1e-3)."""

from __future__ import annotations

import os

import pytest
import torch

from fusedist.optim import FusedAdam, FusedAdamW, FusedSGD
from shared_rank_launch import launch_for_selected, results_of

PAIRS = {
    "AdamW": (torch.optim.AdamW, FusedAdamW, dict(lr=0.01, weight_decay=0.1)),
    "Adam": (torch.optim.Adam, FusedAdam, dict(lr=0.01)),
    "SGD": (torch.optim.SGD, FusedSGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
}


def test_default_groups_have_torchs_keys():
    p = [torch.nn.Parameter(torch.zeros(2))]
    for torch_cls, fused_cls, kw in PAIRS.values():
        assert (set(fused_cls(p, **kw).state_dict()["param_groups"][0])
                == set(torch_cls(p, **kw).state_dict()["param_groups"][0]))
    # a setting torch has no equivalent for stays, and loads back
    saved = FusedAdamW(p, lr=0.01, master_weights=True).state_dict()
    assert saved["param_groups"][0]["master_weights"] is True
    other = FusedAdamW(p, lr=0.01)
    other.load_state_dict(saved)
    assert other.param_groups[0]["master_weights"] is True


def test_groups_given_fusedist_settings_at_their_defaults_have_torchs_keys():
    """A group given ``master_weights=False`` / ``bias_correction=True`` (the defaults), in the
    constructor's list or by ``add_param_group``, kept the keys, which torch's DCP then looked for
    in a torch checkpoint ("Missing key ...param_groups.1.master_weights"). A setting unlike the
    optimizer's own stays, through a save and load."""
    ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    adam = dict(master_weights=False, bias_correction=True)
    own = {"AdamW": adam, "Adam": adam, "SGD": dict(master_weights=False)}
    for name, (torch_cls, fused_cls, kw) in PAIRS.items():
        ours = fused_cls([{"params": ps[:1], **own[name]}], **kw)
        ours.add_param_group({"params": ps[1:2], **own[name]})
        ours.add_param_group({"params": ps[2:], "lr": 0.5})
        theirs = torch_cls([{"params": ps[:1]}], **kw)
        theirs.add_param_group({"params": ps[1:2]})
        theirs.add_param_group({"params": ps[2:], "lr": 0.5})
        for gi, (a, b) in enumerate(zip(ours.state_dict()["param_groups"], theirs.state_dict()["param_groups"])):
            assert set(a) == set(b), (name, gi, set(a) ^ set(b))
    masters = FusedAdamW(ps[:1], lr=0.01, master_weights=True)
    masters.add_param_group({"params": ps[1:], "master_weights": False})
    again = FusedAdamW([ps[0]], lr=0.01, master_weights=True)
    again.add_param_group({"params": ps[1:]})
    again.load_state_dict(masters.state_dict())
    assert [g["master_weights"] for g in again.param_groups] == [True, False]


def _stepped(cls, kw, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = cls(model.parameters(), **kw)
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        opt.step()
    return model, opt


def _worker(rank, ws, where, name, direction, flatten):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)  # (flattened: torchtitan's form)
    torch_cls, fused_cls, kw = PAIRS[name]
    src, dst = {"torch->fused": (torch_cls, fused_cls), "fused->torch": (fused_cls, torch_cls),
                "fused->fused": (fused_cls, fused_cls)}[direction]
    model, opt = _stepped(src, kw, 0)
    msd, osd = get_state_dict(model, opt, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
    target, target_opt = _stepped(dst, kw, 1)  # other weights, other state
    msd, osd = get_state_dict(target, target_opt, options=options)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=where)
    set_state_dict(target, target_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)
    for m, o in ((model, opt), (target, target_opt)):
        o.zero_grad()
        m(torch.randn(3, 4, generator=torch.Generator().manual_seed(9))).square().sum().backward()
        o.step()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), target.parameters()))


DIRECTIONS = ["torch->fused", "fused->torch", "fused->fused"]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Every pair, direction and form in one launch (each its own checkpoint folder)."""
    root = str(tmp_path_factory.mktemp("dcp_interchange"))
    scenarios = {}
    for index, (name, direction, flatten) in enumerate(
            (n, d, f) for n in PAIRS for d in DIRECTIONS for f in (False, True)):
        where = os.path.join(root, f"ck{index}")
        scenarios[(name, direction, flatten)] = (_worker, (where, name, direction, flatten))
    return launch_for_selected(request, {"test_distributed_checkpoint_of_either_library_loads_into_the_other":
                                         scenarios}, 1, timeout=240)


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_distributed_checkpoint_of_either_library_loads_into_the_other(launched, name, direction, flatten):
    diff = results_of(launched, (name, direction, flatten))[0]
    assert diff < 1e-6, diff
