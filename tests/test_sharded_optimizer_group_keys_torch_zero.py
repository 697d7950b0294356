"""ZeroRedundancyOptimizer's param groups in the keys of torch's ZeroRedundancyOptimizer over the
same optimizer (Note [a sharded optimizer's groups in its inner optimizer's keys] in
fusedist/zero/optimizer.py), so checkpoints load both ways by the target's keys; and a sharded
optimizer swapped in by the Lightning integration refuses pickling clearly."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn as nn

from shared_rank_launch import launch_for_selected, results_of

TOL = 1e-6  # fp32, one Adam step: rounding of the same arithmetic in another order


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))


def _groups(m):
    return [{"params": [m[0].weight], "lr": 0.1}, {"params": [m[0].bias]}]


def _step(module, opt, rank, seed):
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed * 10 + rank))
    module(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _keys(groups):
    return [sorted(k for k in g if k != "params") for g in groups]


def _hyper(groups):
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _group_keys_worker(rank, world, seed):
    import fusedist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    from fusedist.optim import FusedAdamW

    kw = dict(lr=0.01, betas=(0.8, 0.9), weight_decay=0.05)
    tm = _model(seed)
    tddp = nn.parallel.DistributedDataParallel(tm)
    topt = TorchZeRO(_groups(tm), torch.optim.AdamW, **kw)
    topt.add_param_group({"params": list(tm[1].parameters()), "weight_decay": 0.0})
    fm = _model(seed)
    fddp = fusedist.DistributedDataParallel(fm)
    fopt = fusedist.ZeroRedundancyOptimizer(_groups(fm), FusedAdamW, master_weights=False, **kw)
    fopt.add_param_group({"params": list(fm[1].parameters()), "weight_decay": 0.0, "master_weights": False})
    out = {"built": (_hyper(fopt.param_groups), _hyper(topt.param_groups))}
    _step(tddp, topt, rank, seed)
    _step(fddp, fopt, rank, seed)
    out["live"] = (_hyper(fopt.param_groups), _hyper(topt.param_groups))
    topt.consolidate_state_dict(to=0)
    fopt.consolidate_state_dict(to=0)
    if rank == 0:
        tsd, fsd = topt.state_dict(), fopt.state_dict()
        out["saved"] = (fsd["param_groups"], tsd["param_groups"])
        worst = 0.0
        for i, st in tsd["state"].items():
            for k, v in st.items():
                worst = max(worst, (fsd["state"][i][k].float() - v.float()).abs().max().item())
        out["state"] = worst
        # fusedist's checkpoint into torch's AdamW, and torch's AdamW's back into a fresh fusedist ZeRO
        am = _model(seed)
        adamw = torch.optim.AdamW(_groups(am) + [{"params": list(am[1].parameters())}], **kw)
        adamw.load_state_dict(fsd)
        out["into AdamW"] = _keys(adamw.state_dict()["param_groups"])
        back = adamw.state_dict()
    else:
        back = None
    # torch's ZeRO checkpoint and torch's AdamW's, loaded by fusedist's ZeRO on every rank
    wrappers = []
    for name, sd in (("torch ZeRO into fusedist", tsd if rank == 0 else None), ("AdamW into fusedist", back)):
        box = [sd]
        torch.distributed.broadcast_object_list(box, src=0)
        gm = _model(seed + 1)
        wrappers.append(fusedist.DistributedDataParallel(gm))  # (the model ZeRO shards)
        again = fusedist.ZeroRedundancyOptimizer(_groups(gm), FusedAdamW, master_weights=False, **kw)
        again.add_param_group({"params": list(gm[1].parameters()), "weight_decay": 0.0})
        again.load_state_dict(box[0])
        out[name] = _keys(again.param_groups)
    # fusedist's checkpoint into torch's ZeRO
    box = [fsd if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    hm = _model(seed + 2)
    wrappers.append(nn.parallel.DistributedDataParallel(hm))
    theirs = TorchZeRO(_groups(hm), torch.optim.AdamW, **kw)
    theirs.add_param_group({"params": list(hm[1].parameters()), "weight_decay": 0.0})
    theirs.load_state_dict(box[0])
    out["fusedist into torch ZeRO"] = _keys(theirs.param_groups)
    out["torch keys"] = _keys(topt.param_groups)
    return out


def _pickle_worker(rank, world):
    import copy

    import fusedist
    from fusedist.integrations._optimizer_swap import convert_optimizer

    out = {}
    for stage in (1, 2):
        module = fusedist.DistributedDataParallel(_model(0))
        swapped = convert_optimizer(torch.optim.AdamW(module.parameters(), lr=0.1), fused_optimizer=True,
                                    zero_stage=stage, master_weights=False, strategy="test", fresh_from="")
        holder = nn.Module()
        holder.opt = swapped  # (a module keeping its optimizer, pickled whole)
        for what, fn in (("pickle", lambda: pickle.dumps(swapped)), ("pickle holder", lambda: pickle.dumps(holder)),
                         ("protocol 0", lambda: pickle.dumps(swapped, protocol=0)),
                         ("deepcopy", lambda: copy.deepcopy(swapped))):
            try:
                fn()
                out[f"stage {stage} {what}"] = (type(swapped).__name__, "no error")
            except Exception as exc:  # noqa: BLE001 - the test reads it
                out[f"stage {stage} {what}"] = (type(swapped).__name__, f"{type(exc).__name__}: {exc}")
    return out


@pytest.fixture(scope="module")
def launched(request):
    """The file's multi-rank checks in one launch of 2 ranks (shared_rank_launch.py)."""
    return launch_for_selected(request, {
        "test_sharded_optimizer_group_keys_match_torch_zero_and_load_both_ways": {
            "group keys": (_group_keys_worker, (7,))},
        "test_sharded_optimizer_group_keys_swapped_zero_refuses_pickling_clearly": {
            "pickle": (_pickle_worker, ())},
    }, world=2, timeout=180)


def test_sharded_optimizer_group_keys_match_torch_zero_and_load_both_ways(launched):
    """ZeRO(FusedAdamW, master_weights=False) kept ``master_weights`` in its groups and state dict,
    which torch's ZeroRedundancyOptimizer(AdamW) over the same groups never has: its groups (live,
    added by add_param_group, saved) now equal torch's, key for key and value for value, and its
    checkpoint loads into torch's AdamW / ZeRO and theirs into it with the same keys."""
    for rank, out in enumerate(results_of(launched, "group keys")):
        ours, theirs = out["live"]
        assert ours == theirs, f"rank {rank}: groups after a step {ours} != torch's {theirs}"
        # (torch's added group has the inner optimizer's keys from its first step on; ours at once)
        built, theirs_built = out["built"]
        assert built[:2] == theirs_built[:2] and built[2] == ours[2], f"rank {rank}: groups built {built}"
        torch_keys = out["torch keys"]
        for name in ("torch ZeRO into fusedist", "AdamW into fusedist", "fusedist into torch ZeRO"):
            assert out[name] == torch_keys, f"rank {rank}: {name}: keys {out[name]} != torch's {torch_keys}"
        if rank == 0:
            ours, theirs = out["saved"]
            assert ours == theirs, f"saved groups {ours} != torch's {theirs}"
            assert out["state"] <= TOL, f"state differs from torch's ZeRO by {out['state']}"
            assert out["into AdamW"] == torch_keys, out["into AdamW"]


def test_sharded_optimizer_group_keys_swapped_zero_refuses_pickling_clearly(launched):
    """The Lightning integration's ZeroRedundancyOptimizer under the user's class name (AdamW)
    refuses a pickle or copy -- of itself or of a module keeping it -- with ZeRO's refusal saying
    what to save instead, not a hollow copy or an unrelated error."""
    for rank, out in enumerate(results_of(launched, "pickle")):
        for what, (name, message) in out.items():
            assert name == "AdamW", (what, name)
            assert message.startswith(f"TypeError: ZeroRedundancyOptimizer (rank {rank} of 2) cannot be copied "
                                      "or pickled"), f"rank {rank}, {what}: {message}"
            assert "consolidate_state_dict(to=0)" in message, (what, message)
