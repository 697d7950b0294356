"""A pipelined ``Checkpointer``'s LR schedulers, one per model part (Note [an LR scheduler per
pipeline part] in fusedist/checkpoint/_snapshot.py), and its samplers, on the stages that read
data only (Note [a sampler per pipeline stage] there); and a checkpoint of a model whose only
child is ``module`` loaded with ``pipeline=True``.

- parts whose schedulers differ (each part's own learning rates and schedule), on one rank
  (interleaved) and across ranks, and a stage without parameters and so without an optimizer or
  a scheduler: saved and restored into fresh parts, every learning rate and parameter goes on as
  in the uninterrupted run (the first part's state was loaded into every part, and a stage
  without a scheduler was refused: "lr_scheduler is an LR scheduler on ranks [0]; None on ranks
  [1]"); also when rank 0 holds no scheduler, restored by a Checkpointer of the whole model;
- the ranks of one stage registering different schedulers are refused, naming the stage;
- an ordinary checkpoint, or torch's distributed checkpoint, of a model whose only child is
  ``module`` loads into its pipeline split (its keys lost their ``module.`` against a part
  holding only some of them: "missing keys"), and alike on every rank when a rank holds a part
  without state (that rank refused the load the other rank went on with);
- one stage holding an ElasticDistributedSampler and the other none: saved (refused: "the
  sampler passed to restore() is ElasticDistributedSampler on ranks [0], None on ranks [1]"),
  and the data position restored, also when rank 0 holds no sampler.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

import models
from fusedist.testing import run_distributed
from test_checkpoint_pipelined_stage_without_parameters import _differ, _error

WIDTH, STEPS, SAVED_AT = 4, 4, 2


_Layers = functools.partial(models.WholeModelLayers, width=WIDTH, count=4)


def _part(spec, seed: int):
    """``(module, optimizer, scheduler)`` of a part: ``spec`` is ``(layer ids, lr, schedule)``,
    or None for a part without parameters (no optimizer, no scheduler)."""
    if spec is None:
        return nn.Identity(), None, None
    ids, lr, schedule = spec
    module = _Layers(ids, seed)
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    if schedule == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    elif schedule == "exp":
        scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    else:
        scheduler = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1, 3], gamma=0.1)
    return module, opt, scheduler


def _train(held, step: int) -> list:
    """One step of every part with parameters; returns every part's learning rates after it."""
    import torch.distributed as dist

    for j, (module, opt, scheduler) in enumerate(held):
        if opt is None:
            continue
        x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(100 * step + 10 * dist.get_rank() + j))
        module(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    return [None if s is None else s.get_last_lr() for _, _, s in held]


def _params(held) -> dict:
    return {f"{j}/{k}": v.clone() for j, (module, _, _) in enumerate(held) for k, v in module.state_dict().items()}


def _run(root: str, specs: list, group) -> dict:
    """Train STEPS steps saving at SAVED_AT; then restore fresh parts and train on: the learning
    rates of every step after the restore and the final parameters must be the uninterrupted
    run's."""
    from fusedist.checkpoint import Checkpointer

    def register(ckpt, held):
        schedulers = [s for _, _, s in held]
        return ckpt.restore([m for m, _, _ in held], [o for _, o, _ in held],
                            lr_scheduler=schedulers if any(schedulers) else None)

    held = [_part(spec, seed=j) for j, spec in enumerate(specs)]
    ckpt = Checkpointer(root, process_group=group, pipeline=True)
    out = {"fresh start": register(ckpt, held)}
    rates = []
    for step in range(STEPS):
        if step == SAVED_AT:
            ckpt.save(step)
        rates.append(_train(held, step))
    ckpt.close()
    fresh = [_part(spec, seed=10 + j) for j, spec in enumerate(specs)]
    ckpt = Checkpointer(root, process_group=group, pipeline=True)
    out["restored"] = _error(lambda: out.update(step=register(ckpt, fresh)))
    out["rates"] = [_train(fresh, step) for step in range(SAVED_AT, STEPS)] == rates[SAVED_AT:]
    out["params"] = _differ(_params(fresh), _params(held))
    ckpt.close()
    return out


def _schedulers_worker(rank, world_size, root):
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.checkpoint import Checkpointer

    group = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"]
    out = {}
    # interleaved: rank 0 holds layers 0 and 2, each with its schedule; rank 1 layer 1 and a
    # part without parameters (a loss head)
    interleaved = [[([0], 1e-2, "step"), ([2], 3e-2, "exp")], [([1], 2e-2, "multistep"), None]][rank]
    out["interleaved"] = _run(os.path.join(root, "interleaved"), interleaved, group)
    # rank 0 holds the part without parameters alone: it saves no scheduler state of its own
    alone = [[None], [([0, 1, 2, 3], 2e-2, "exp")]][rank]
    out["alone"] = _run(os.path.join(root, "alone"), alone, group)
    # ... and a Checkpointer of the whole model (no pipeline) restores its schedule
    whole = _part(([0, 1, 2, 3], 2e-2, "exp"), seed=20)
    ckpt = Checkpointer(os.path.join(root, "alone"))
    ckpt.restore(whole[0], whole[1], lr_scheduler=whole[2])
    ckpt.close()
    out["whole model"] = whole[2].get_last_lr()
    # the ranks of one stage (both ranks) disagree: rank 1 registers no scheduler
    both = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))["dp"]
    module, opt, scheduler = _part(([0, 1], 1e-2, "step"), seed=0)
    ckpt = Checkpointer(os.path.join(root, "refused"), process_group=both, pipeline=True)
    ckpt.restore(module, opt, lr_scheduler=scheduler if rank == 0 else None)
    out["refused"] = _error(lambda: ckpt.save(1))
    ckpt.close()
    return out


def test_each_parts_lr_scheduler_is_saved_with_its_stage_and_restored_into_it(tmp_path):
    results = run_distributed(_schedulers_worker, 2, str(tmp_path), timeout=120)
    for rank, out in enumerate(results):
        for layout in ("interleaved", "alone"):
            got = out[layout]
            assert got["fresh start"] == 0 and got["restored"] == "" and got["step"] == SAVED_AT, (rank, layout, got)
            assert got["rates"] and got["params"] == [], (rank, layout, got)
        assert "the ranks of one pipeline stage (part 0 of ranks [0, 1]) passed different LR schedulers: an LR " \
               "scheduler on ranks [0]; None on ranks [1]" in out["refused"], (rank, out["refused"])
        assert "nothing was written for step 1" in out["refused"], (rank, out["refused"])
    # the whole model restored rank 1's part's schedule: ExponentialLR(0.9) stepped SAVED_AT times
    expected = [2e-2 * 0.9 ** SAVED_AT]
    assert all(torch.allclose(torch.tensor(out["whole model"]), torch.tensor(expected)) for out in results), results


def _by_name(module, opt) -> dict:
    """The module's state and its AdamW state by parameter name."""
    out = {k: v.clone() for k, v in module.state_dict().items()}
    if opt is not None:
        names = [n for n, _ in module.named_parameters()]
        out.update({f"{names[i]}/{k}": torch.as_tensor(v).clone() for i, st in opt.state_dict()["state"].items()
                    for k, v in st.items()})
    return out


def _module_child_worker(rank, world_size, root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.checkpoint import load, save

    whole = _Layers(range(4), 0, child="module")
    opt = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    whole(torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(5))).square().mean().backward()
    opt.step()
    save(os.path.join(root, "ordinary"), whole, opt)  # keys module.0.weight, ...
    saved = _by_name(whole, opt)
    # torchtitan's torch distributed checkpoint of the job at pp 2: each rank its stage's half
    stage = _Layers([2 * rank, 2 * rank + 1], 0, child="module")
    stage.load_state_dict({k: v for k, v in whole.state_dict().items() if k in stage.state_dict()})
    stage_opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    stage(torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(5))).square().mean().backward()
    stage_opt.step()
    model_state, optim_state = get_state_dict(stage, stage_opt,
                                              options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(root, "dcp"))
    halves = [None, None]
    dist.all_gather_object(halves, _by_name(stage, stage_opt))
    group = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"]
    out = {}
    for checkpoint, state in (("ordinary", saved), ("dcp", {**halves[0], **halves[1]})):
        for layout, ids in (("split", [2 * rank, 2 * rank + 1]), ("without state", range(4) if rank == 0 else [])):
            part = _Layers(ids, 7, child="module") if ids else nn.Identity()
            part_opt = torch.optim.AdamW(part.parameters(), lr=1e-2) if ids else None
            error = _error(lambda: load(os.path.join(root, checkpoint), part, part_opt, process_group=group,
                                        pipeline=True))
            got = _by_name(part, part_opt)
            out[checkpoint, layout] = (error, len(got), [k for k, v in got.items() if not torch.equal(v, state[k])])
    return out


def test_a_checkpoint_of_a_model_whose_only_child_is_module_loads_pipelined_alike_on_every_rank(tmp_path):
    """Its keys lost their ``module.`` against a part holding some of them ("missing keys
    [module.0.weight ...]"); and a rank of a part without state normalized them against none,
    refusing the load ("holds 8 model keys that no model part of this job loads") that the
    other rank went on with."""
    for rank, out in enumerate(run_distributed(_module_child_worker, 2, str(tmp_path), timeout=120)):
        for checkpoint in ("ordinary", "dcp"):
            # per layer: weight, bias and their AdamW step, exp_avg, exp_avg_sq
            assert out[checkpoint, "split"] == ("", 16, []), (rank, checkpoint, out)
            assert out[checkpoint, "without state"] == ("", 32 if rank == 0 else 0, []), (rank, checkpoint, out)


def _sampler_worker(rank, world_size, root):
    """pp 2: one stage reads the data (an ElasticDistributedSampler), the other none."""
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.checkpoint import Checkpointer, ElasticDistributedSampler

    group = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"]
    out = {}
    for reader in (0, 1):  # the rank whose stage holds the sampler (rank 0 writes the position)
        def build(seed):
            module, opt, _ = _part(([rank], 1e-2, "step"), seed)
            return module, opt, ElasticDistributedSampler(range(40), num_replicas=1, rank=0, seed=3) \
                if rank == reader else None

        module, opt, sampler = build(0)
        ckpt = Checkpointer(os.path.join(root, str(reader)), process_group=group, pipeline=True)
        ckpt.restore(module, opt, sampler=sampler)
        batches = iter(sampler) if sampler is not None else None
        for step in range(STEPS):
            if step == SAVED_AT:
                out[f"save {reader}"] = _error(lambda: ckpt.save(step))
            if sampler is not None:
                seen = [next(batches) for _ in range(4)]
                sampler.advance(4)
        ckpt.close()
        module, opt, sampler = build(1)
        ckpt = Checkpointer(os.path.join(root, str(reader)), process_group=group, pipeline=True)
        out[f"restore {reader}"] = _error(lambda: ckpt.restore(module, opt, sampler=sampler))
        ckpt.close()
        if sampler is not None:  # the next batches after the saved step are the uninterrupted run's last
            batches = iter(sampler)
            out["resumed"] = [[next(batches) for _ in range(4)] for _ in range(SAVED_AT, STEPS)][-1] == seen
    return out


def test_a_stage_without_a_sampler_is_saved_and_the_data_position_restored(tmp_path):
    """Every rank's sampler was compared with every other's: refused ("the sampler passed to
    restore() is ElasticDistributedSampler on ranks [0]; None on ranks [1]")."""
    from types import SimpleNamespace

    from fusedist.checkpoint._snapshot import SnapshotMixin

    for rank, out in enumerate(run_distributed(_sampler_worker, 2, str(tmp_path), timeout=120)):
        assert set(out.values()) == {"", True}, (rank, out)
    # within a stage the ranks still agree on the sampler's kind, and the positions across stages
    differs = SnapshotMixin._positions_differ
    pipelined = SimpleNamespace(pipeline=True)
    infos = [([(0, 1)], {}), ([(0, 1)], {}), ([(2, 3)], {}), ([(2, 3)], {})]
    position = ("ElasticDistributedSampler", {"epoch": 0, "consumed": 8})
    assert differs(pipelined, [position, position, ("None", None), ("None", None)], infos) is None
    assert differs(pipelined, [position, ("None", None), ("None", None), ("None", None)], infos) == \
        "the sampler passed to restore() by the ranks of one pipeline stage ([0, 1]) is ElasticDistributedSampler " \
        "on ranks [0], None on ranks [1]"
    later = ("ElasticDistributedSampler", {"epoch": 0, "consumed": 12})
    assert differs(pipelined, [position, position, later, later], infos) == \
        "consumed is 8 on ranks [0, 1], 12 on ranks [2, 3]"
