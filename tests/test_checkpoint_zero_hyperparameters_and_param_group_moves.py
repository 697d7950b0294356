"""Param groups at ``fusedist.checkpoint.load``, checked against torch:

- ranks of a ZeroRedundancyOptimizer whose param groups differ in a setting the checkpoint does
  not hold loaded silently, each keeping its own: here ``initial_lr``, which an LR scheduler
  built after a rank-local change of ``lr`` (a per-host config applied after construction) set
  apart, and which a checkpoint saved without a scheduler lacks; the scheduler then stepped each
  rank's slices at its own rate. ``load_state_dict`` of the same state compares the groups across
  ranks and refuses (Note [the same hyperparameters after a load] in
  fusedist/checkpoint/_same_hyperparameters.py). Both ranks now refuse, naming the group, the
  setting and each rank's value, and nothing changes; ranks built alike load and continue as
  torch's AdamW given the saved state (fp32, the same operations on every slice: exactly equal).
  Two ranks, one launch.
- a parameter the loading optimizer holds in another param group (of as many) than the one it
  was saved in was regrouped by name and loaded when the groups' settings were equal; torch's
  ``set_optimizer_state_dict`` leaves a group without settings (its next step fails: Note
  [parameters moved between param groups] in fusedist/checkpoint/_from_dcp.py). Refused before
  anything changes, naming the parameter and both groups, for torch's
  distributed checkpoint (nested, or flattened with the record of its groups that
  ``checkpoint.record_param_groups`` adds: Note [param groups of a flattened optimizer state] in
  fusedist/checkpoint/_group_record.py) and a pipelined fusedist one. The saved grouping loads as
  torch's ``set_state_dict`` loads it (copies: exactly equal). Two saved groups of equal settings
  loaded into one were merged by name, where torch's ``load_state_dict`` refuses another number
  of groups: refused, naming both counts. torch reads a file with the record as its own, and a
  flattened state without it loads as before.
- a pipeline part without state whose optimizer over no parameters has another number of
  groups than the checkpoint's optimizer (an ordinary fusedist checkpoint, or torch's
  ``optimizer.state_dict()`` saved by DCP) was told the groups "of [0] parameters" differ from
  "[0, 0]": it now names both counts and what to pass, as torch's ``load_state_dict`` refuses.
  With as many it takes the saved settings; from torch's ``optimizer.state_dict()`` saved by DCP
  a strict load was refused besides, the saved indices taken for parameters no part loads.
- a pipelined load that is not strict listed each rank's parts' missing keys, a key every part
  holds once per part: every rank now lists the job's, once, in the order torch's
  ``load_state_dict(strict=False)`` of the whole model lists them (two ranks, same launch).
- a pipelined checkpoint loaded into another split (two ranks, same launch): groups by saved part,
  and a saved group over two groups of equal settings, load; a group over saved groups of
  another ``lr`` (torch's ``set_optimizer_state_dict`` takes the last) and a saved group over two
  groups of another ``weight_decay`` (torch leaves a group without settings) are refused naming
  the part, the groups, the setting and its values; groups of optimizers built from
  ``named_parameters()`` merge (their ``param_names`` differed: "different settings").
- a ZeRO-2 checkpoint loaded into torch's ``fully_shard`` (DTensor parameters) failed half loaded;
  it continues as torch's AdamW on the unsharded model (same launch).
- a data file of torch's distributed checkpoint cut short (a copy interrupted) or removed, or
  its metadata cut short, failed inside torch's reader with its traceback and an unzip or
  unpickling error naming no file: the file is named, with its size and the size its metadata
  records (torch's ``dcp.load`` refuses it too).
- torch's ``dcp.save`` into a directory of a fusedist checkpoint: load read fusedist's older
  manifest, the state torch's save replaced, silently; refused naming both (Note [two
  checkpoints in one directory] in fusedist/checkpoint/_which_checkpoint.py).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from fusedist import checkpoint


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _steps(model, opt, seeds) -> None:
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(5, 4, generator=gen)), torch.randn(5, 3, generator=gen)).backward()
        opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _dcp_saved(path: str, seed: int, lr: float) -> tuple:
    """A torch DCP checkpoint of a model and AdamW(lr) after two steps, and its state dicts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    _steps(model, opt, [seed, seed + 1])
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (one process: DCP warns that it saves alone)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return model.state_dict(), opt.state_dict()


def _zero_with_rank_local_initial_lr(rank: int, world: int, path: str, seed: int) -> dict:
    from fusedist import ZeroRedundancyOptimizer

    model = _net(seed + 7)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    zero.param_groups[0]["lr"] = 1e-3 * (rank + 1)  # (after construction: its check saw the same lr)
    torch.optim.lr_scheduler.LambdaLR(zero, lambda step: 1.0)  # (records initial_lr in the group)
    before = _flat(model).clone()
    try:
        checkpoint.load(path, model, zero)
        refusal = None
    except checkpoint.CheckpointError as exc:
        refusal = str(exc)
    unchanged = torch.equal(_flat(model), before) and zero.param_groups[0]["lr"] == 1e-3 * (rank + 1)
    zero.param_groups[0]["initial_lr"] = 1e-3  # (built alike: loads)
    checkpoint.load(path, model, zero)
    _steps(model, zero, [seed + 2, seed + 3])
    return {"refusal": refusal, "unchanged": unchanged, "after": _flat(model), "lr": zero.param_groups[0]["lr"]}


class _Block(nn.Module):
    def __init__(self, gated: bool):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        if gated:  # (the loaded model's layers have a gate the saved ones lack)
            self.gate = nn.Linear(3, 1)


def _whole(new: bool) -> nn.Module:
    """The saved model (``new=False``), or the loaded one: a root buffer and gates added since."""
    model = nn.Module()
    if new:
        model.register_buffer("rope", torch.ones(2))
    model.emb = nn.Linear(2, 3)
    model.layers = nn.ModuleDict({str(i): _Block(new) for i in range(4)})
    model.head = nn.Linear(3, 2)
    return model


def _cut(whole: nn.Module, keep: set, layers: set) -> nn.Module:
    """A pipeline part as torchtitan cuts one: the other layers removed, the names kept."""
    import copy

    part = copy.deepcopy(whole)
    for name in [n for n in part._modules if n not in keep]:
        delattr(part, name)
    for i in [i for i in part.layers if int(i) not in layers]:
        del part.layers[i]
    return part


def _parts_list_missing_keys(rank: int, world: int, path: str, seed: int) -> list:
    torch.manual_seed(seed + 1)
    loaded = _whole(True)
    part = _cut(loaded, {"emb", "layers"}, {0, 1}) if rank == 0 else _cut(loaded, {"layers", "head"}, {2, 3})
    return list(checkpoint.load(path, [part], [None], pipeline=True, strict=False).missing_keys)


def _layers(ids, seed: int) -> nn.Module:
    import models

    return models.WholeModelLayers(ids, seed, width=3, count=4)


def _regrouped_after_a_resplit(rank: int, world: int, path: str, seed: int) -> dict:
    """Saved at pp 2 (layers [0, 1] and [2, 3], one AdamW group each: ``lr`` 0.1 and 0.2, then
    both 0.1), loaded into parts of other layers and other groups (Note [param groups across a
    pipeline re-split] in fusedist/checkpoint/_part_groups.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    group = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"]
    saved = _layers([2 * rank, 2 * rank + 1], seed)
    opt = torch.optim.AdamW(saved.parameters(), lr=0.1 * (rank + 1))
    saved(torch.randn(2, 3)).square().sum().backward()
    opt.step()
    checkpoint.save(path + "-lr", saved, opt, process_group=group, pipeline=True)
    opt.param_groups[0]["lr"] = 0.1
    checkpoint.save(path + "-same", saved, opt, process_group=group, pipeline=True)
    by_name = torch.optim.AdamW(saved.named_parameters())  # torch's param_names in its group
    by_name.load_state_dict(opt.state_dict())
    checkpoint.save(path + "-named", saved, by_name, process_group=group, pipeline=True)
    ids = [[1, 2], [0, 3]][rank]  # each part takes a layer of each saved part

    def load(which: str, layout) -> dict:
        part = _layers(ids, seed + 1)
        named = dict(part.named_parameters())
        opt = torch.optim.AdamW([{"params": [named[n] for n in names], **own} for names, own in layout(named)],
                                lr=1.0)
        before = [p.clone() for p in part.parameters()]
        try:
            checkpoint.load(path + which, part, opt, process_group=group, pipeline=True)
        except checkpoint.CheckpointError as exc:
            return {"refusal": str(exc), "unchanged": all(torch.equal(a, b) for a, b in zip(before, part.parameters()))}
        names = [n for g in layout(named) for n in g[0]]
        state = opt.state_dict()["state"]
        return {"groups": [(g["lr"], g["weight_decay"]) for g in opt.param_groups],
                "param_names": [g.get("param_names") for g in opt.param_groups],
                "state": {names[i]: {k: v.clone() for k, v in st.items()} for i, st in state.items()}}

    by_layer = [([f"layers.{i}.weight", f"layers.{i}.bias"], {}) for i in ids]
    out = {"merged": load("-lr", lambda named: [(list(named), {})]),
           "named, merged": load("-named", lambda named: [(list(named), {})]),
           "by saved part": load("-lr", lambda named: by_layer),
           "split alike": load("-same", lambda named: [([n for n in named if n.endswith(k)], {}) for k in "ts"]),
           "split apart": load("-same", lambda named: [([n for n in named if n.endswith("t")], {"weight_decay": 0.5}),
                                                       ([n for n in named if n.endswith("s")], {"weight_decay": 0.0})])}
    out["saved"] = {name: opt.state[p] for name, p in saved.named_parameters()}
    return out


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(1000 + step))


def _zero2_into_torchs_fully_shard(rank: int, world: int, path: str, seed: int) -> dict:
    """A ZeRO-2 checkpoint (fusedist DDP, the global batch split over the ranks) loaded into
    torch's fully_shard and AdamW, which train on (Note [a load into DTensor parameters] in
    fusedist/checkpoint/_dtensor_targets.py); the whole parameters after each phase."""
    import fusedist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    ddp = fusedist.DistributedDataParallel(_layers(range(3), seed))
    zero = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=2, lr=3e-2)
    for step in range(2):
        zero.zero_grad()
        (ddp(_batch(step)[rank::world]).square().sum() * world).backward()  # (the gradients are averaged)
        zero.step()
    checkpoint.save(path, ddp, zero)
    sharded = _layers(range(3), seed + 1)
    for layer in sharded.layers.values():
        fully_shard(layer)
    fully_shard(sharded)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1.0)
    checkpoint.load(path, sharded, opt)
    for step in range(2, 4):
        opt.zero_grad()
        (sharded(_batch(step)[rank::world]).square().sum() * world).backward()
        opt.step()
    full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
    return {"lr": opt.param_groups[0]["lr"], "after": {k: v.clone() for k, v in full.items()}}


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    from shared_rank_launch import launch_for_selected

    root = tmp_path_factory.mktemp("zero_hyper")
    seed = int.from_bytes(os.urandom(2), "little")
    state = _dcp_saved(str(root / "dcp"), seed, 1e-2)
    torch.manual_seed(seed)
    saved_whole = _whole(False)
    checkpoint.save(str(root / "whole"), saved_whole)
    launched = launch_for_selected(request, {
        "test_every_rank_lists_the_jobs_missing_keys_once_in_torchs_order": {
            "missing keys": (_parts_list_missing_keys, (str(root / "whole"), seed))},
        "test_ranks_whose_groups_differ_in_a_setting_the_checkpoint_lacks_refuse_naming_it": {
            "rank-local initial_lr": (_zero_with_rank_local_initial_lr, (str(root / "dcp"), seed))},
        "test_a_resplit_merges_and_splits_groups_that_agree_and_refuses_those_that_do_not_naming_the_setting": {
            "regrouped": (_regrouped_after_a_resplit, (str(root / "pipelined"), seed))},
        "test_a_zero2_checkpoint_continues_in_torchs_fully_shard_as_the_unsharded_run": {
            "into fully_shard": (_zero2_into_torchs_fully_shard, (str(root / "zero2"), seed))},
    }, world=2, timeout=120)
    return launched, state, seed, saved_whole


def test_ranks_whose_groups_differ_in_a_setting_the_checkpoint_lacks_refuse_naming_it(two_ranks):
    from shared_rank_launch import results_of

    launched, (model_state, opt_state), seed, _ = two_ranks
    assert "initial_lr" not in opt_state["param_groups"][0]  # (the case: the checkpoint does not set it)
    results = results_of(launched, "rank-local initial_lr")
    for result in results:
        assert result["refusal"] is not None, "ranks with different groups loaded silently"
        assert ("param group 0: initial_lr=0.001 on ranks [0]; param group 0: initial_lr=0.002 on ranks [1]"
                in result["refusal"]), result["refusal"]
        assert "nothing was loaded" in result["refusal"]
        assert result["unchanged"]
    reference = _net(seed + 7)
    reference.load_state_dict(model_state)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    torch_opt.load_state_dict(opt_state)
    _steps(reference, torch_opt, [seed + 2, seed + 3])
    for result in results:
        assert result["lr"] == 1e-2
        assert torch.equal(result["after"], _flat(reference))


def test_every_rank_lists_the_jobs_missing_keys_once_in_torchs_order(two_ranks):
    from shared_rank_launch import results_of

    launched, _, seed, saved_whole = two_ranks
    torch.manual_seed(seed + 1)
    expected = _whole(True).load_state_dict(saved_whole.state_dict(), strict=False)
    assert expected.missing_keys[0] == "rope" and len(expected.missing_keys) == 9  # (the case is torch's)
    assert results_of(launched, "missing keys") == [expected.missing_keys] * 2


def test_a_resplit_merges_and_splits_groups_that_agree_and_refuses_those_that_do_not_naming_the_setting(two_ranks):
    """A part of another pipeline split takes each group's settings from the saved groups of its
    parameters: groups by saved part load (the settings of each, the state copied), a saved group
    over two groups whose own settings agree loads. A group over saved groups of another ``lr``,
    and a saved group over two groups of another ``weight_decay``, were loaded (the first) or are
    loaded by torch's ``set_optimizer_state_dict`` with the last saved group's ``lr`` / a group
    left without settings: both refused naming the part, the groups, the setting and its values."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from shared_rank_launch import results_of

    launched, _, seed, _ = two_ranks
    results = results_of(launched, "regrouped")
    saved = {n: st for r in results for n, st in r["saved"].items()}
    for rank, result in enumerate(results):
        loaded = result["by saved part"]
        assert loaded["groups"] == [(0.1, 0.01), (0.2, 0.01)], (rank, loaded)  # (layers 1, 2 and 0, 3)
        assert loaded["state"].keys() == {f"layers.{i}.{k}" for i in [[1, 2], [0, 3]][rank] for k in ("weight", "bias")}
        for name, state in loaded["state"].items():
            assert all(torch.equal(v, saved[name][k]) for k, v in state.items()), (rank, name)
        assert result["split alike"]["groups"] == [(0.1, 0.01), (0.1, 0.01)], (rank, result["split alike"])
        # saved by optimizers built from named_parameters(): their param_groups list them ("param_names"),
        # which differ between the saved parts' groups (a merge was refused for "different settings");
        # each group takes its members' saved names, as torch's load_state_dict installs the saved ones
        named = result["named, merged"]
        layers = [[1, 2], [0, 3]][rank]
        assert named.get("groups") == [(0.1, 0.01)], (rank, named)
        assert named["param_names"] == [[f"layers.{i}.{k}" for i in layers for k in ("weight", "bias")]], named
        for name, state in named["state"].items():
            assert all(torch.equal(v, saved[name][k]) for k, v in state.items()), (rank, name)
        merged, apart = result["merged"], result["split apart"]
        assert merged.get("unchanged") and apart.get("unchanged"), (rank, merged, apart)
        assert ("param group 0 of part 0 of rank 0 holds 'layers.1.weight', saved in group 0 of part 0 of ranks [0] "
                "with lr=0.1, and 'layers.2.weight', saved in group 0 of part 0 of ranks [1] with lr=0.2"
                in merged["refusal"]), (rank, merged)
        assert ("param groups 0 and 1 of part 0 of rank 0 differ in weight_decay (0.5 and 0.0) but both hold "
                "parameters saved in group 0 of part 0 of ranks [0] ('layers.1.weight' ...), whose weight_decay=0.01 "
                "the load would give both" in apart["refusal"]), (rank, apart)
        assert "nothing was loaded" in merged["refusal"] and "nothing was loaded" in apart["refusal"]
    # torch's answer to the merged groups: the last saved group's lr, silently
    part = _layers([1, 2], seed)
    opt = torch.optim.AdamW(part.parameters(), lr=1.0)
    state = get_optimizer_state_dict(part, opt)
    group = state["param_groups"][0]
    state["param_groups"] = [dict(group, params=group["params"][:2], lr=0.1), dict(group, params=group["params"][2:],
                                                                                    lr=0.2)]
    set_optimizer_state_dict(part, opt, state)
    assert [g["lr"] for g in opt.param_groups] == [0.2]


def test_a_zero2_checkpoint_continues_in_torchs_fully_shard_as_the_unsharded_run(two_ranks):
    """torch's fully_shard holds DTensor parameters: the load copied whole tensors into them and
    failed ("got mixed torch.Tensor and DTensor") after copying the plain entries. Each rank
    now takes its slices of the model and of the AdamW state, and the run goes on as torch's
    AdamW on the unsharded model (fp32, other summation orders: within 1e-5)."""
    from shared_rank_launch import results_of

    launched, _, seed, _ = two_ranks
    results = results_of(launched, "into fully_shard")
    reference = _layers(range(3), seed)
    opt = torch.optim.AdamW(reference.parameters(), lr=3e-2)
    for step in range(4):
        opt.zero_grad()
        reference(_batch(step)).square().sum().backward()
        opt.step()
    for rank, result in enumerate(results):
        assert result["lr"] == 3e-2
        assert result["after"].keys() == reference.state_dict().keys()
        for key, value in reference.state_dict().items():
            assert torch.allclose(result["after"][key], value, atol=1e-5), (rank, key)


def _grouped(model: nn.Module, layout: list, lr: float = 1e-2):
    named = dict(model.named_parameters())
    return torch.optim.AdamW([{"params": [named[n] for n in group]} for group in layout], lr=lr)


_SAVED = [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
_MOVED = [["0.weight", "2.weight"], ["0.bias", "2.bias"]]


def _saved_grouped(path: str, seed: int, kind: str, layout: list) -> tuple:
    """A model and AdamW in param groups ``layout`` after a step, saved as ``kind``; torch's
    state dicts of it (the optimizer's flattened for the flattened kinds)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = _net(seed)
    opt = _grouped(model, layout)
    _steps(model, opt, [seed])
    flat = kind.startswith("torch dcp flattened")
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    if kind == "fusedist pipelined":
        checkpoint.save(path, [model], [opt], pipeline=True)
        return msd, osd
    if kind == "torch dcp flattened, groups recorded":
        osd = checkpoint.record_param_groups(model, opt, osd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (one process: DCP warns that it saves alone)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return msd, osd


def _load(path: str, kind: str, model, opt) -> None:
    pipelined = kind == "fusedist pipelined"
    checkpoint.load(path, [model] if pipelined else model, [opt] if pipelined else opt, pipeline=pipelined)


_KINDS = ["torch dcp", "torch dcp flattened, groups recorded", "fusedist pipelined"]


@pytest.mark.parametrize("kind", _KINDS)
def test_a_parameter_moved_to_another_param_group_is_refused_naming_both_groups(tmp_path, kind):
    from torch.distributed.checkpoint.state_dict import set_state_dict

    seed = int.from_bytes(os.urandom(2), "little")
    path = str(tmp_path / "ckpt")
    msd, osd = _saved_grouped(path, seed, kind, _SAVED)
    if kind != "torch dcp flattened, groups recorded":
        torch_moved = _net(seed + 1)
        torch_opt = _grouped(torch_moved, _MOVED)
        set_state_dict(torch_moved, torch_opt, model_state_dict=msd, optim_state_dict=osd)
        assert "lr" not in torch_opt.param_groups[0]  # torch's: a group left without settings (its step fails)
        with pytest.raises(KeyError):
            torch_opt.step()

    fresh = _net(seed + 1)
    moved = _grouped(fresh, _MOVED, lr=5e-3)
    before = _flat(fresh).clone()
    with pytest.raises(checkpoint.CheckpointError, match=r"parameter '2\.weight' is in param group 0 of the optimizer "
                       r"but was saved in param group 1 with '2\.bias'.*nothing was loaded"):
        _load(path, kind, fresh, moved)
    assert torch.equal(_flat(fresh), before) and not moved.state and moved.param_groups[0]["lr"] == 5e-3

    # the saved grouping: as torch's set_state_dict loads it
    reference = _net(seed + 1)
    reference_opt = _grouped(reference, _SAVED)
    set_state_dict(reference, reference_opt, model_state_dict=msd, optim_state_dict=osd)
    same = _grouped(fresh, _SAVED, lr=5e-3)
    _load(path, kind, fresh, same)
    _steps(fresh, same, [seed + 1])
    _steps(reference, reference_opt, [seed + 1])
    assert torch.equal(_flat(fresh), _flat(reference))


@pytest.mark.parametrize("kind", _KINDS)
def test_saved_param_groups_merged_into_one_are_refused_naming_both_counts(tmp_path, kind):
    """Two saved groups of equal settings, one group here: torch's load_state_dict refuses another
    number of groups (and set_optimizer_state_dict merges them); load, whose contract is
    load_state_dict's, merged them by name. Refused now, nothing changed; one group saved and
    loaded as torch's load_state_dict loads it."""
    seed = int.from_bytes(os.urandom(2), "little")
    path = str(tmp_path / "ckpt")
    _saved_grouped(path, seed, kind, _SAVED)
    reference = _net(seed)
    with pytest.raises(ValueError, match="different number of parameter groups"):  # (torch's refusal)
        torch.optim.AdamW(reference.parameters()).load_state_dict(_grouped(reference, _SAVED).state_dict())
    fresh = _net(seed + 1)
    merged = torch.optim.AdamW(fresh.parameters(), lr=5e-3)
    before = _flat(fresh).clone()
    with pytest.raises(checkpoint.CheckpointError, match=r"holds its parameters in 1 param group\(s\), the checkpoint "
                       r"in 2 \(group 0: '0\.weight', '0\.bias'; group 1: '2\.weight', '2\.bias'\).*Build the "
                       r"optimizer with the 2 saved groups.*nothing was loaded"):
        _load(path, kind, fresh, merged)
    assert torch.equal(_flat(fresh), before) and not merged.state and merged.param_groups[0]["lr"] == 5e-3


def test_torch_reads_a_flattened_state_with_recorded_groups_and_an_unrecorded_one_loads_as_before(tmp_path):
    """The record is an entry torch's dcp.load and set_state_dict leave alone: torch loads the
    file as its own (exactly equal). A flattened state without it (torch's own, or older) still
    loads into the saved grouping, as torch's set_state_dict loads it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    seed = int.from_bytes(os.urandom(2), "little")
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    for kind in ("torch dcp flattened, groups recorded", "torch dcp flattened"):
        path = str(tmp_path / kind.replace(" ", "_").replace(",", ""))
        msd, osd = _saved_grouped(path, seed, kind, _SAVED)
        assert ("param_group_members" in osd) == kind.endswith("recorded")
        torch_model = _net(seed + 1)
        torch_opt = _grouped(torch_model, _SAVED, lr=5e-3)
        target = dict(zip(("model", "optim"), get_state_dict(torch_model, torch_opt, options=flat)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, checkpoint_id=path)
        set_state_dict(torch_model, torch_opt, model_state_dict=target["model"], optim_state_dict=target["optim"],
                       options=flat)
        fresh = _net(seed + 2)
        ours = _grouped(fresh, _SAVED, lr=5e-3)
        _load(path, kind, fresh, ours)
        _steps(fresh, ours, [seed + 1])
        _steps(torch_model, torch_opt, [seed + 1])
        assert torch.equal(_flat(fresh), _flat(torch_model)), kind


class _Loss(nn.Module):
    """A part without parameters or buffers (a pipeline's last stage holding only the loss)."""

    def forward(self, x):
        return x.square().mean()


@pytest.mark.parametrize("kind", ["fusedist", "torch dcp of state_dict()"])
def test_a_stateless_parts_optimizer_of_another_group_count_is_told_both_counts(tmp_path, kind):
    import torch.distributed.checkpoint as dcp

    seed = int.from_bytes(os.urandom(2), "little")
    model = _net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.25)
    _steps(model, opt, [seed])
    path = str(tmp_path / "ckpt")
    if kind == "fusedist":
        checkpoint.save(path, model, opt)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    with pytest.raises(ValueError, match="different number of parameter groups"):  # (torch's refusal)
        torch.optim.AdamW([{"params": []}, {"params": []}]).load_state_dict(
            dict(opt.state_dict(), param_groups=[dict(g, params=[]) for g in opt.state_dict()["param_groups"]]))
    fresh = _net(seed + 1)
    two = torch.optim.AdamW([{"params": []}, {"params": []}], lr=1e-3)
    before = _flat(fresh).clone()
    with pytest.raises(checkpoint.CheckpointError, match=r"the optimizer over no parameters \(a model part without "
                       r"state's\) has 2 param group\(s\); the saved optimizer whose settings it takes has 1.*"
                       r"pass one with 1 param group\(s\)"):
        checkpoint.load(path, [fresh, _Loss()], [torch.optim.AdamW(fresh.parameters()), two], pipeline=True)
    assert torch.equal(_flat(fresh), before) and [g["lr"] for g in two.param_groups] == [1e-3, 1e-3]
    one = torch.optim.AdamW([{"params": []}], lr=1e-3)  # (as many: takes the saved group's settings)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    checkpoint.load(path, [fresh, _Loss()], [fresh_opt, one], pipeline=True)
    assert one.param_groups[0]["lr"] == 0.25
    reference = _net(seed + 1)  # (and the part with state as torch's load_state_dict of the saved state)
    reference.load_state_dict(model.state_dict())
    reference_opt = torch.optim.AdamW(reference.parameters())
    reference_opt.load_state_dict(opt.state_dict())
    _steps(fresh, fresh_opt, [seed + 1])
    _steps(reference, reference_opt, [seed + 1])
    assert torch.equal(_flat(fresh), _flat(reference))


@pytest.mark.parametrize("how", ["cut short", "removed", "metadata cut short"])
def test_a_torch_dcp_data_file_cut_short_is_named(tmp_path, how):
    import torch.distributed.checkpoint as dcp

    seed = int.from_bytes(os.urandom(2), "little")
    path = str(tmp_path / "dcp")
    _dcp_saved(path, seed, 1e-2)
    data = ".metadata" if how.startswith("metadata") else next(n for n in os.listdir(path) if n.endswith(".distcp"))
    size = os.path.getsize(os.path.join(path, data))
    if how == "removed":
        os.remove(os.path.join(path, data))
    else:
        os.truncate(os.path.join(path, data), size // 2)
    with pytest.raises(BaseException), warnings.catch_warnings():  # (torch's reader refuses it too)
        warnings.simplefilter("ignore")
        dcp.load({"model": _net(seed).state_dict()}, checkpoint_id=path)
    fresh = _net(seed + 1)
    before = _flat(fresh).clone()
    found = "is missing" if how == "removed" else f"has {size // 2} bytes"
    named = (r"the metadata file \.metadata of torch's distributed checkpoint .* cannot be read \(UnpicklingError: "
             r".*\): it was cut short" if how.startswith("metadata") else
             rf"file {data} of torch's distributed checkpoint .* {found}, and its metadata records data up to byte \d+")
    with pytest.raises(checkpoint.CheckpointError, match=named + ".*nothing was loaded"):
        checkpoint.load(path, fresh, torch.optim.AdamW(fresh.parameters()))
    assert torch.equal(_flat(fresh), before)


def test_torch_dcp_saved_into_a_fusedist_checkpoints_directory_is_not_loaded_as_the_stale_one(tmp_path):
    """torch's dcp.save into a directory of a fusedist checkpoint leaves fusedist's files and
    manifest there, and load read the manifest: the state torch's save replaced, silently (torch's
    dcp.load reads its own). Refused now, naming both; the other way round (a fusedist save into
    a directory of torch's checkpoint) loads fusedist's, the one saved last, as torch's
    load_state_dict of its state loads it (exactly equal)."""
    import torch.distributed.checkpoint as dcp

    seed = int.from_bytes(os.urandom(2), "little")
    path = str(tmp_path / "ckpt")
    stale = _net(seed)
    stale_opt = torch.optim.AdamW(stale.parameters(), lr=1e-2)
    _steps(stale, stale_opt, [seed])
    checkpoint.save(path, stale, stale_opt)
    newer_state = _dcp_saved(path, seed + 1, 1e-2)  # (into the same directory)
    assert os.path.exists(os.path.join(path, "manifest.json"))
    newer = _net(seed + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": newer.state_dict()}, checkpoint_id=path)  # (torch's reads its own)
    assert torch.equal(_flat(newer), torch.cat([v.reshape(-1) for v in newer_state[0].values()]))
    fresh = _net(seed + 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=5e-3)
    before = _flat(fresh).clone()
    with pytest.raises(checkpoint.CheckpointError, match=r"holds two checkpoints: torch's distributed checkpoint "
                       r"\(\.metadata, written .*\) and, older, fusedist's \(manifest\.json, written "
                       r".*nothing was loaded"):
        checkpoint.load(path, fresh, fresh_opt)
    assert torch.equal(_flat(fresh), before) and not fresh_opt.state

    other = str(tmp_path / "other")  # a fusedist save into a directory of torch's checkpoint: the last one loads
    _dcp_saved(other, seed + 3, 1e-2)
    checkpoint.save(other, stale, stale_opt)
    checkpoint.load(other, fresh, fresh_opt)
    reference = _net(seed + 4)
    reference.load_state_dict(stale.state_dict())
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=5e-3)
    reference_opt.load_state_dict(stale_opt.state_dict())
    _steps(fresh, fresh_opt, [seed + 5])
    _steps(reference, reference_opt, [seed + 5])
    assert torch.equal(_flat(fresh), _flat(reference))
