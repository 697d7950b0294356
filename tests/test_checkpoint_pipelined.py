"""Pipelined checkpoints (Note [pipelined checkpoints] in fusedist/checkpoint/pipeline.py): every
stage of a pipeline-parallel job saved into one directory with ``pipeline=True``, loaded into
another pipeline split, into a job without pipeline parallelism, and from an ordinary checkpoint
or torchtitan's torch distributed checkpoint of a pipeline-parallel job; and a ``Checkpointer``
with ``pipeline=True`` (one root) whose saves restore at other splits.

On 4 gloo ranks a model of 8 layers, each stage holding some layers under the whole model's
names (torchtitan's split), each part trained a step so its AdamW holds state:

- saved at pp 2 x dp 2 (fully_shard over dp) -> loaded at pp 4 (plain modules), by the whole
  model under fully_shard over 4 ranks (no pipeline), and by an interleaved layout (two parts
  per rank, each with its optimizer);
- that interleaved layout saved (two parts per rank) -> loaded at pp 4;
- an ordinary checkpoint of a ZeRO-2 run of the whole model -> loaded at pp 2 x dp 2;
- stages of fusedist DDP + ZeRO-2 over each stage's group, saved pipelined -> loaded at pp 4;
- the GradScaler of the stage that saved a part's layers, each rank's ``per_rank`` state, a
  load with ``strict=False`` of a part the checkpoint holds only some of;
- refused on every rank: stages loading one after the other without ``pipeline=True`` (each
  would take only its own layers), one optimizer over two parts; and before anything is written,
  a save of stages whose names clash (``nn.Sequential`` slices), or over groups that do not
  split the job.

Every load must give each part exactly the saved values of its layers and their AdamW state
(bit for bit: the values are copied, not recomputed).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

import models
from fusedist.testing import run_distributed

LAYERS, WIDTH = 8, 8


_Layers = functools.partial(models.WholeModelLayers, width=WIDTH, count=LAYERS)


def _part(ids, mesh, seed: int, shift: float):
    """A part of layers ``ids`` (fully_shard over ``mesh`` unless None), its weights moved by
    ``shift`` (a load must overwrite them), trained one step with AdamW."""
    import fusedist

    module = _Layers(ids, seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(shift)
    if mesh is not None:
        for layer in module.layers.values():
            fusedist.fully_shard(layer, mesh=mesh)
        fusedist.fully_shard(module, mesh=mesh)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2 * (1 + shift))
    _step(module, opt, seed + int(10 * shift))
    return module, opt


def _step(module, opt, seed: int) -> None:
    import torch.distributed as dist

    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    module(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _state(module, opt) -> dict:
    """The part's whole model entries by key and AdamW state by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True)
    out = {k: v.clone() for k, v in get_model_state_dict(module, options=full).items()}
    optim = get_optimizer_state_dict(module, opt, options=full)
    out.update({f"{name}/{k}": torch.as_tensor(v).clone() for name, st in optim["state"].items()
                for k, v in st.items()})
    out.update({f"{name}/lr": torch.tensor(g["lr"]) for g in optim["param_groups"] for name in g["params"]})
    return out


def _whole(parts) -> dict:
    """Every rank's parts' state, merged: the saved model."""
    import torch.distributed as dist

    mine = {}
    for module, opt in parts:
        mine.update(_state(module, opt))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for d in everyone for k, v in d.items()}


def _matches(parts, saved: dict) -> list:
    """The keys of the parts' state that differ from ``saved`` (empty: an exact load)."""
    got = {}
    for module, opt in parts:
        got.update(_state(module, opt))
    layers = sum(len(module.layers) for module, _ in parts)
    # per layer: weight, bias; their exp_avg, exp_avg_sq, step and lr
    assert len(got) == 10 * layers, sorted(got)
    return [k for k, v in got.items() if k not in saved or not torch.equal(v, saved[k])]


def _worker(rank, world_size, seed, root):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.checkpoint import CheckpointError, load, save

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    single = init_device_mesh("cpu", (4, 1), mesh_dim_names=("pp", "dp"))
    whole = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    pp, out = mesh["pp"].get_local_rank(), {}

    # pp 2 x dp 2: stage pp holds layers 4pp..4pp+3
    saved_part = _part(range(4 * pp, 4 * pp + 4), mesh["dp"], seed, 0.0)
    saved = _whole([saved_part])
    first = os.path.join(root, "pp2xdp2")
    scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** (10 + pp))  # the stages' own, each saved
    save(first, *saved_part, scaler, extra={"step": 7}, per_rank={"rank": rank}, process_group=mesh["dp"],
         pipeline=True)
    out["files"] = sorted(os.listdir(first))
    out["saved"] = saved if rank == 0 else None

    four = _part([2 * rank, 2 * rank + 1], None, seed, 1.0)  # pp 4: plain modules
    loaded_scaler = fusedist.amp.GradScaler("cpu")
    out["extra"] = load(first, *four, loaded_scaler, process_group=single["dp"], pipeline=True)
    out["pp4"] = _matches([four], saved)
    out["scale"] = loaded_scaler.get_scale()  # from the stage that saved the part's layers
    out["per_rank"] = fusedist.checkpoint.load_per_rank(first)

    # strict=False: a part of some saved layers (and one the checkpoint lacks) takes what it has
    some, _ = _part([1, 6], None, seed, 1.5)
    some.head = nn.Linear(WIDTH, 2)
    head = {k: v.clone() for k, v in some.head.state_dict().items()}
    load(first, some, process_group=single["dp"], pipeline=True, strict=False)
    out["not strict"] = [k for k, v in some.state_dict().items()
                         if not torch.equal(v, saved[k] if k in saved else head[k[len("head."):]])]

    everything = _part(range(LAYERS), whole["dp"], seed, 2.0)  # no pipeline: the whole model
    load(first, *everything)
    out["whole"] = _matches([everything], saved)

    # interleaved: 4 stages of 2 layers, pp rank r holds stages r and r + 2
    interleaved = [_part(range(2 * s, 2 * s + 2), mesh["dp"], seed, 3.0) for s in (pp, pp + 2)]
    load(first, [m for m, _ in interleaved], [o for _, o in interleaved], process_group=mesh["dp"], pipeline=True)
    out["interleaved"] = _matches(interleaved, saved)
    for module, opt in interleaved:  # a step more, then saved with two parts per rank
        _step(module, opt, seed + 5)
    resaved = _whole(interleaved)
    second = os.path.join(root, "interleaved")
    save(second, [m for m, _ in interleaved], [o for _, o in interleaved], process_group=mesh["dp"], pipeline=True)
    again = _part([2 * rank, 2 * rank + 1], None, seed, 4.0)
    load(second, *again, process_group=single["dp"], pipeline=True)
    out["interleaved -> pp4"] = _matches([again], resaved)

    # an ordinary checkpoint of a ZeRO-2 run of the whole model, loaded at pp 2 x dp 2
    ddp = fusedist.DistributedDataParallel(_Layers(range(LAYERS), seed))
    zero = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=2, lr=3e-2)
    _step(ddp, zero, seed + 6)
    third = os.path.join(root, "zero2")
    save(third, ddp, zero)
    halves = _part(range(4 * pp, 4 * pp + 4), mesh["dp"], seed, 5.0)
    load(third, *halves, process_group=mesh["dp"], pipeline=True)
    full = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    out["zero2 model"] = [k for k, v in _state(*halves).items() if "/" not in k and not torch.equal(v, full[k])]
    out["zero2 optimizer"] = _zero_state_matches(zero, ddp.module, halves)

    # stages of fusedist DDP with ZeRO-2 over each stage's group, saved pipelined, loaded at pp 4
    stage_ddp = fusedist.DistributedDataParallel(_Layers(range(4 * pp, 4 * pp + 4), seed + 1),
                                                 process_group=mesh["dp"].get_group())
    stage_zero = fusedist.ZeroRedundancyOptimizer(stage_ddp.parameters(), torch.optim.AdamW, stage=2,
                                                  process_group=mesh["dp"].get_group(), lr=2e-2)
    _step(stage_ddp, stage_zero, seed + 8)
    fourth = os.path.join(root, "zero2 stages")
    save(fourth, stage_ddp, stage_zero, process_group=mesh["dp"], pipeline=True)
    reference = {k: v.clone() for k, v in stage_ddp.module.state_dict().items()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (reference, _zero_by_name(stage_zero, stage_ddp.module)))
    from_stages = _part([2 * rank, 2 * rank + 1], None, seed, 7.0)
    load(fourth, *from_stages, process_group=single["dp"], pipeline=True)
    expected = {k: v for model_state, optim_state in everyone for k, v in {**model_state, **optim_state}.items()}
    got = {k: v for k, v in _state(*from_stages).items() if not k.endswith("/lr")}
    out["zero2 stages"] = [k for k, v in got.items() if not torch.equal(v, expected[k])]

    # refused on every rank, nothing loaded: each stage alone without pipeline=True
    untouched = _part(range(4 * pp, 4 * pp + 4), mesh["dp"], seed, 6.0)
    before = _state(*untouched)
    with pytest.raises(CheckpointError) as refused:
        load(first, *untouched, process_group=mesh["dp"])
    out["alone"] = (str(refused.value), _matches([untouched], before))
    with pytest.raises(ValueError) as refused:
        save(os.path.join(root, "refused"), [m for m, _ in interleaved], interleaved[0][1], process_group=mesh["dp"],
             pipeline=True)
    out["one optimizer"] = str(refused.value)
    # groups that do not split the job (rank 1 in two): refused before writing
    pairs = [dist.new_group([0, 1]), dist.new_group([1, 2]), dist.new_group([2, 3])]
    with pytest.raises(CheckpointError) as refused:
        save(os.path.join(root, "pairs"), _Layers([rank], seed), process_group=pairs[min(rank, 2)], pipeline=True)
    out["pairs"] = str(refused.value)
    # stages whose names clash (nn.Sequential slices renumber layers): refused before writing
    sliced = nn.Sequential(*list(_Layers(range(LAYERS), seed).layers.values())[4 * pp:4 * pp + 4])
    clash = os.path.join(root, "clash")
    with pytest.raises(CheckpointError) as refused:
        save(clash, sliced, process_group=mesh["dp"], pipeline=True)
    dist.barrier()
    out["clash"] = (str(refused.value), os.path.exists(clash))
    # a stage's file damaged: every rank refuses, even those whose parts do not read it
    damaged = os.path.join(root, "damaged")
    if rank == 0:
        import shutil

        shutil.copytree(first, damaged)
        with open(os.path.join(damaged, "common-stage-001.pt"), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    dist.barrier()
    with pytest.raises(CheckpointError) as refused:
        load(damaged, *untouched, process_group=mesh["dp"], pipeline=True)
    out["damaged"] = (str(refused.value), _matches([untouched], before))
    return out


def _zero_by_name(zero, module) -> dict:
    """A ZeroRedundancyOptimizer's whole AdamW state by parameter name (a collective)."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(zero.process_group) if zero.process_group is not None else [0]
    box = [zero.consolidate_state_dict(0)]
    dist.broadcast_object_list(box, src=ranks[0], group=zero.process_group)
    names = [n for n, _ in module.named_parameters()]
    return {f"{names[i]}/{k}": torch.as_tensor(v) for i, st in box[0]["state"].items() for k, v in st.items()}


def _zero_state_matches(zero, module, part) -> list:
    """The part's AdamW state entries that differ from the ZeRO optimizer's for the same names."""
    by_name = _zero_by_name(zero, module)
    got = {k: v for k, v in _state(*part).items() if "/" in k and not k.endswith("/lr")}
    assert len(got) == 6 * len(part[0].layers), sorted(got)
    return [k for k, v in got.items() if k not in by_name or not torch.equal(v, by_name[k])]


def test_pipelined_checkpoints_load_into_any_split(tmp_path):
    from fusedist.checkpoint import load

    results = run_distributed(_worker, 4, 1234, str(tmp_path), timeout=300)
    # and in one process without torch.distributed (an export): the whole model and its AdamW
    whole = _Layers(range(LAYERS), 1)
    opt = torch.optim.AdamW(whole.parameters(), lr=0.5)
    assert load(str(tmp_path / "pp2xdp2"), whole, opt) == {"step": 7}
    state = opt.state_dict()
    names = [n for n, _ in whole.named_parameters()]
    got = {**whole.state_dict(), **{f"{names[i]}/{k}": torch.as_tensor(v) for i, st in state["state"].items()
                                     for k, v in st.items()},
           **{f"{n}/lr": torch.tensor(state["param_groups"][0]["lr"]) for n in names}}
    saved = results[0]["saved"]
    assert sorted(got) == sorted(saved) and all(torch.equal(v, saved[k]) for k, v in got.items())
    for rank, out in enumerate(results):
        assert out["files"] == ["common-stage-000.pt", "common-stage-001.pt", "common.pt", "manifest.json",
                                "rank-00000.pt", "rank-00001.pt", "rank-00002.pt", "rank-00003.pt"], out["files"]
        assert out["extra"] == {"step": 7} and out["per_rank"] == {"rank": rank}, out
        assert out["scale"] == 2.0 ** (10 + rank // 2), out  # layers 2r, 2r + 1 are stage r // 2's
        assert out["not strict"] == [], out["not strict"]
        message, written = out["clash"]
        assert "'0.bias' is the name of an entry of two pipeline stages" in message and not written, out["clash"]
        for case in ("pp4", "whole", "interleaved", "interleaved -> pp4", "zero2 model", "zero2 optimizer",
                     "zero2 stages"):
            assert out[case] == [], (rank, case, out[case])
        message, changed = out["alone"]
        assert "no model part of this job loads" in message and "pipeline=True" in message, message
        assert changed == [], changed
        assert "one optimizer per part" in out["one optimizer"], out["one optimizer"]
        message, changed = out["damaged"]
        assert "common-stage-001.pt" in message and changed == [], out["damaged"]
        assert "the pipeline stages do not agree: rank 0 saves its part 0 over ranks [0, 1], rank 1 its part 0 over " \
               "[1, 2]" in out["pairs"], out["pairs"]


def _periodic_worker(rank, world_size, seed, root):
    """A Checkpointer with pipeline=True: one root for the job, asynchronous saves of pp 2 x dp 2
    restored by the interleaved layout, whose save restores at pp 4 and by an ordinary
    Checkpointer of the whole model (pipeline parallelism dropped), LR schedulers and all."""
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.checkpoint import Checkpointer

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    single = init_device_mesh("cpu", (4, 1), mesh_dim_names=("pp", "dp"))
    whole = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    pp, out = mesh["pp"].get_local_rank(), {}

    def layouts():
        yield "pp2xdp2", [_part(range(4 * pp, 4 * pp + 4), mesh["dp"], seed, 0.0)], mesh["dp"]
        yield "interleaved", [_part(range(2 * s, 2 * s + 2), mesh["dp"], seed, 1.0) for s in (pp, pp + 2)], mesh["dp"]
        yield "pp4", [_part([2 * rank, 2 * rank + 1], None, seed, 2.0)], single["dp"]
        yield "no pipeline", [_part(range(LAYERS), whole["dp"], seed, 3.0)], None  # an ordinary Checkpointer

    saved = None
    for name, held, group in layouts():  # each restores the one before and (but the last) trains on and saves
        schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for _, opt in held]
        ckpt = Checkpointer(root, process_group=group, pipeline=group is not None)
        models, optimizers = [m for m, _ in held], [o for _, o in held]
        out[name] = {"restored": ckpt.restore(models if len(held) > 1 else models[0], optimizers,
                                              lr_scheduler=schedulers)}
        if saved is not None:
            out[name].update(differ=_matches(held, saved), extra=ckpt.extra,
                             scheduler=[s.last_epoch for s in schedulers])
        if name not in ("pp4", "no pipeline"):
            for scheduler in schedulers:
                scheduler.step()
            for module, opt in held:
                _step(module, opt, seed + 7)
            step = out[name]["restored"] + 2
            ckpt.save(step, extra={"tokens": 32 * step})
            ckpt.wait()
            saved = _whole(held)
            out[name]["files"] = sorted(os.listdir(os.path.join(root, f"step-{step:08d}")))
        ckpt.close()
    return out


def test_a_pipelined_checkpointer_restores_any_split(tmp_path):
    results = run_distributed(_periodic_worker, 4, 4321, str(tmp_path / "root"), timeout=300)
    ranks = ["rank-00000.pt", "rank-00001.pt", "rank-00002.pt", "rank-00003.pt"]
    for rank, out in enumerate(results):
        assert out["pp2xdp2"]["restored"] == 0
        assert out["pp2xdp2"]["files"] == ["common-stage-000.pt", "common-stage-001.pt", "common.pt",
                                           "manifest.json", *ranks], out
        assert out["interleaved"]["files"] == ["common-stage-000.pt", "common-stage-001.pt", "common-stage-002.pt",
                                               "common-stage-003.pt", "common.pt", "manifest.json", *ranks], out
        for name, step in (("interleaved", 2), ("pp4", 4), ("no pipeline", 4)):
            assert out[name]["restored"] == step and out[name]["extra"] == {"tokens": 32 * step}, (rank, out[name])
            assert out[name]["differ"] == [], (rank, name, out[name])
            assert set(out[name]["scheduler"]) == {step // 2}, (rank, name, out[name])


def _dcp_worker(rank, world_size, seed, root):
    """torchtitan's checkpoint of a pipeline-parallel job (torch's fully_shard stages, one
    torch distributed checkpoint of every stage, the optimizer flattened by name), continued at
    pp 4 and on fusedist's fully_shard stages."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fusedist.checkpoint import load

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    single = init_device_mesh("cpu", (4, 1), mesh_dim_names=("pp", "dp"))
    pp = mesh["pp"].get_local_rank()
    module = _Layers(range(4 * pp, 4 * pp + 4), seed)
    for layer in module.layers.values():
        torch_fully_shard(layer, mesh=mesh["dp"])
    torch_fully_shard(module, mesh=mesh["dp"])
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    _step(module, opt, seed)
    model_state, optim_state = get_state_dict(module, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=root)
    saved = _whole([(module, opt)])
    out = {}
    four = _part([2 * rank, 2 * rank + 1], None, seed, 1.0)
    load(root, *four, process_group=single["dp"], pipeline=True)
    out["pp4"] = _matches([four], saved)
    ours = _part(range(4 * pp, 4 * pp + 4), mesh["dp"], seed, 2.0)
    load(root, *ours, process_group=mesh["dp"], pipeline=True)
    out["fusedist stages"] = _matches([ours], saved)
    return out


def test_torchtitans_pipelined_dcp_checkpoint_loads_into_any_split(tmp_path):
    for rank, out in enumerate(run_distributed(_dcp_worker, 4, 99, str(tmp_path / "dcp"), timeout=300)):
        assert out == {"pp4": [], "fusedist stages": []}, (rank, out)


def test_optimizer_state_by_name_takes_the_optimizers_order_and_keeps_an_empty_group():
    """The by-name state a part takes from several stages (their groups put together) is put in
    the optimizer's order, each group with its parameters' saved settings; a group
    the optimizer holds empty keeps its own (it made the conversion fail with an IndexError)."""
    from fusedist.checkpoint import CheckpointError, _from_dcp

    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    opt = torch.optim.AdamW([{"params": [a, b], "lr": 1.0}, {"params": [], "lr": 2.0}, {"params": [c], "lr": 3.0}])
    saved = {"state": {"b": {"step": torch.tensor(5.0)}, "c": {"step": torch.tensor(7.0)}},
             "param_groups": [{"params": ["c"], "lr": 0.3}, {"params": ["a", "b"], "lr": 0.1}]}
    full = _from_dcp.to_torch_format(saved, ["a", "b", "c"], opt.param_groups, "test", one_saved=False)
    assert [g["params"] for g in full["param_groups"]] == [[0, 1], [], [2]]
    assert [g["lr"] for g in full["param_groups"]] == [0.1, 2.0, 0.3]
    assert sorted(full["state"]) == [1, 2] and float(full["state"][2]["step"]) == 7.0
    opt.load_state_dict(full)
    with pytest.raises(CheckpointError, match="param group 0 of the optimizer holds 'a', saved in param group 0 of the "
                       "checkpoint with lr=0.1, and 'b', saved in param group 1 of the checkpoint with lr=0.5"):
        _from_dcp.to_torch_format(dict(saved, param_groups=[{"params": ["a", "c"], "lr": 0.1},
                                                           {"params": ["b"], "lr": 0.5}]),
                                  ["a", "b", "c"], opt.param_groups, "test", one_saved=False)


def test_a_saved_group_over_two_groups_of_other_settings_is_refused_for_torchs_checkpoint_of_a_pipelined_job():
    """torch's distributed checkpoint of a pipeline-parallel job (its parts' groups by name, as
    torchtitan saves them) loaded into a part whose two groups differ in ``weight_decay`` but hold
    parameters of one saved group: each took the saved group's settings, silently (torch's
    ``set_optimizer_state_dict`` leaves the first group without any). Refused naming the groups,
    the setting and the values; groups of equal settings still split."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from fusedist.checkpoint import CheckpointError, _from_dcp

    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    saved = {"state": {}, "param_groups": [{"params": ["a", "b", "c"], "lr": 0.1, "weight_decay": 0.01}]}

    def groups(decay: float) -> list:
        return torch.optim.AdamW([{"params": [a, b], "weight_decay": 0.0}, {"params": [c], "weight_decay": decay}],
                                 lr=1.0).param_groups

    full = _from_dcp.to_torch_format(saved, ["a", "b", "c"], groups(0.0), "test", others=True)
    assert [(g["lr"], g["weight_decay"]) for g in full["param_groups"]] == [(0.1, 0.01), (0.1, 0.01)]
    with pytest.raises(CheckpointError, match=r"test: param groups 0 and 1 of the optimizer differ in weight_decay "
                       r"\(0.0 and 0.5\) but both hold parameters saved in param group 0 of the checkpoint \('a' "
                       r"\.\.\.\), whose weight_decay=0.01 the load would give both"):
        _from_dcp.to_torch_format(saved, ["a", "b", "c"], groups(0.5), "test", others=True)
    module = nn.ParameterDict({"a": a, "b": b, "c": c})
    opt = torch.optim.AdamW([{"params": [a, b], "weight_decay": 0.0}, {"params": [c], "weight_decay": 0.5}])
    state = get_optimizer_state_dict(module, opt)
    state["param_groups"] = [dict(state["param_groups"][1], params=["a", "b", "c"], weight_decay=0.01)]
    set_optimizer_state_dict(module, opt, state)
    assert "weight_decay" not in opt.param_groups[0]  # torch's answer


def test_parameters_no_stage_holds_optimizer_state_for_are_named_capped_as_every_refusal():
    """A part whose optimizer steps parameters no saved stage holds state for is refused naming
    them, capped as the other refusals are (``_load_plan.capped``: the first ones and how many
    more), not the first five and a bare ``...`` that hid how many were missing."""
    from fusedist.checkpoint import CheckpointError, _load_plan, pipeline

    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(13)))  # 26 parameters, state saved for the first
    opt = torch.optim.AdamW(model.parameters())

    class _OneSavedParameter:
        def optimizer(self, stage):
            return {"state": {}, "param_groups": [dict(opt.param_groups[0], params=[0])]}

    meta = {"class": "AdamW", "param_names": ["0.weight"], "param_shapes": [[2, 2]]}
    stage = {"optimizer": meta, "ranks": None, "part": None}
    with pytest.raises(CheckpointError) as raised:
        pipeline._prepare_optimizer("DIR", [(0, stage)], _OneSavedParameter(), model, opt, [], "part 0 of rank 0")
    missing = [f"'{n}'" for n, _ in model.named_parameters()][1:]
    shown = "; ".join(missing[:_load_plan.SHOWN_SHAPE_MISMATCHES])
    more = len(missing) - _load_plan.SHOWN_SHAPE_MISMATCHES
    assert (f"no stage of DIR holds optimizer state for the parameters {shown}; and {more} more: "
            "the optimizers saved did not hold them; load the model alone (optimizer=None)") in str(raised.value)
