"""A pipelined ``Checkpointer``'s LR schedulers and GradScalers at restore (Note [LR scheduler
states before the load] in fusedist/checkpoint/pipeline.py):

- an ordinary checkpoint of the whole model restored into pipeline parts: its one LR scheduler
  state goes into each part whose param groups are the saved ones in their order (the
  learning rates go on as the whole model's), and a part whose groups are in another order is
  refused, its scheduler unchanged (it took the saved per-group base rates as they were, so
  LambdaLR gave the weights the biases' rate), and so is a part of a pipelined checkpoint whose
  groups are in another order than its stage's; the states of several schedulers of the whole
  model are refused too;
- a pipelined checkpoint's per-part scheduler states are matched before the load, from the
  checkpoint's files (a stage saved without a scheduler was found only by the load);
- several stages without parameters each take their own GradScaler (each took the first one's
  scale and growth tracker);
- an ordinary checkpoint of an older fusedist (``_orig_mod.`` in its names) loads into pipeline
  parts strictly (the optimizer state they took by its names now was reported as taken by none).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

import models
from fusedist.testing import run_distributed
from test_checkpoint_pipelined_stage_without_parameters import _error

WIDTH = 4


_Layers = functools.partial(models.WholeModelLayers, width=WIDTH, count=4)


def _optimizer(module, order: str):
    """AdamW over two param groups, the weights' and the biases' (in ``order``: "wb" or "bw")."""
    groups = {"w": {"params": [p for n, p in module.named_parameters() if n.endswith("weight")], "lr": 1e-2},
              "b": {"params": [p for n, p in module.named_parameters() if n.endswith("bias")], "lr": 3e-2}}
    return torch.optim.AdamW([groups[c] for c in order])


def _scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)


def _train(module, opt, schedulers, seed: int) -> None:
    module(torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
    opt.step()
    opt.zero_grad()
    for scheduler in schedulers:
        scheduler.step()


def _schedulers_worker(rank, world_size, root):
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.checkpoint import Checkpointer, load, save

    group = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"]
    out = {}
    # an ordinary checkpoint of the whole model, one schedule over the weights' and biases' groups
    whole = _Layers(range(4), 0)
    opt = _optimizer(whole, "wb")
    scheduler = _scheduler(opt)
    ckpt = Checkpointer(os.path.join(root, "ordinary"))
    ckpt.restore(whole, opt, lr_scheduler=scheduler)
    for k in range(3):
        _train(whole, opt, [scheduler], k)
    ckpt.save(3)
    ckpt.close()
    _train(whole, opt, [scheduler], 3)
    out["whole rates"] = scheduler.get_last_lr()
    for order in ("wb", "bw"):
        part = _Layers([2 * rank, 2 * rank + 1], 9)
        part_opt = _optimizer(part, order)
        part_scheduler = _scheduler(part_opt)
        ckpt = Checkpointer(os.path.join(root, "ordinary"), process_group=group, pipeline=True)
        out[order] = _error(lambda: ckpt.restore(part, part_opt, lr_scheduler=part_scheduler))
        ckpt.close()
        if not out[order]:
            _train(part, part_opt, [part_scheduler], 3)
        out[f"{order} rates"] = part_scheduler.get_last_lr()
    # the states of two schedulers of the whole model
    whole = _Layers(range(4), 0)
    opt = _optimizer(whole, "wb")
    two = [_scheduler(opt), torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]
    ckpt = Checkpointer(os.path.join(root, "two"))
    ckpt.restore(whole, opt, lr_scheduler=two)
    _train(whole, opt, two, 0)
    ckpt.save(1)
    ckpt.close()
    part = _Layers([2 * rank, 2 * rank + 1], 9)
    part_opt = _optimizer(part, "wb")
    ckpt = Checkpointer(os.path.join(root, "two"), process_group=group, pipeline=True)
    out["two"] = _error(lambda: ckpt.restore(part, part_opt, lr_scheduler=_scheduler(part_opt)))
    ckpt.close()

    # an ordinary checkpoint of an older fusedist: names with torch.compile's ``_orig_mod.``
    legacy = nn.Module()
    legacy._orig_mod = whole
    save(os.path.join(root, "legacy"), legacy, opt)
    part = _Layers([2 * rank, 2 * rank + 1], 9)
    part_opt = _optimizer(part, "wb")
    out["legacy"] = _error(lambda: load(os.path.join(root, "legacy"), part, part_opt, pipeline=True))
    by_name = dict(whole.named_parameters())
    out["legacy differs"] = [n for n, p in part.named_parameters() if not torch.equal(p, by_name[n])]
    out["legacy differs"] += [n for n, p in part.named_parameters() if "exp_avg" not in part_opt.state[p]
                              or not torch.equal(part_opt.state[p]["exp_avg"], opt.state[by_name[n]]["exp_avg"])]

    # a pipelined checkpoint whose stage of rank 1 was saved without a scheduler
    part = _Layers([2 * rank, 2 * rank + 1], 0)
    part_opt = _optimizer(part, "wb")
    scheduler = _scheduler(part_opt) if rank == 0 else None
    ckpt = Checkpointer(os.path.join(root, "pipelined"), process_group=group, pipeline=True)
    ckpt.restore(part, part_opt, lr_scheduler=scheduler)
    _train(part, part_opt, [scheduler] if scheduler else [], 5)
    ckpt.save(1)
    ckpt.close()
    # ... restored into parts whose groups are in another order, schedulers where saved
    fresh = _Layers([2 * rank, 2 * rank + 1], 9)
    fresh_opt = _optimizer(fresh, "bw")
    fresh_scheduler = _scheduler(fresh_opt) if rank == 0 else None
    ckpt = Checkpointer(os.path.join(root, "pipelined"), process_group=group, pipeline=True)
    out["pipelined bw"] = _error(lambda: ckpt.restore(fresh, fresh_opt, lr_scheduler=fresh_scheduler))
    ckpt.close()
    # both stages saved with a scheduler, restored into another split whose groups are in another
    # order: each group named by the stage it was saved in (both stages' groups are numbered 0 and 1)
    part = _Layers([2 * rank, 2 * rank + 1], 0)
    part_opt = _optimizer(part, "wb")
    scheduler = _scheduler(part_opt)
    ckpt = Checkpointer(os.path.join(root, "both"), process_group=group, pipeline=True)
    ckpt.restore(part, part_opt, lr_scheduler=scheduler)
    _train(part, part_opt, [scheduler], 5)
    ckpt.save(1)
    ckpt.close()
    fresh = _Layers([[1, 2], [0, 3]][rank], 9)
    fresh_opt = _optimizer(fresh, "bw")
    ckpt = Checkpointer(os.path.join(root, "both"), process_group=group, pipeline=True)
    out["resplit bw"] = _error(lambda: ckpt.restore(fresh, fresh_opt, lr_scheduler=_scheduler(fresh_opt)))
    ckpt.close()
    path = os.path.join(root, "pipelined", "step-00000001")
    meta = torch.load(os.path.join(path, "common.pt"), weights_only=True)["extra"]  # what restore reads before
    fresh = _Layers([2 * rank, 2 * rank + 1], 9)                                   # the load
    fresh_opt = _optimizer(fresh, "wb")
    ckpt = Checkpointer(os.path.join(root, "empty"), process_group=group, pipeline=True)
    ckpt.restore(fresh, fresh_opt, lr_scheduler=_scheduler(fresh_opt))  # (registers them: nothing to restore)
    out["before the load"] = _error(lambda: ckpt._lr_scheduler_states(path, meta))
    ckpt.close()
    return out


def test_lr_scheduler_states_of_a_whole_model_checkpoint_and_before_the_load(tmp_path):
    results = run_distributed(_schedulers_worker, 2, str(tmp_path), timeout=120)
    for rank, out in enumerate(results):
        # the saved groups in their order: each part's schedule goes on as the whole model's
        assert out["wb"] == "" and torch.allclose(torch.tensor(out["wb rates"]), torch.tensor(out["whole rates"]))
        # another order: refused (it took the biases' base rate for the weights), its schedule unchanged
        assert "holds for it was saved over the whole model's optimizer, with 2 param group(s); this part's " \
               "optimizer has 2 (its group 0 from saved group 1 of the whole model's optimizer; its group 1 from " \
               "saved group 0 of the whole model's optimizer)" in out["bw"], out["bw"]
        assert out["bw rates"] == [3e-2, 1e-2], out["bw rates"]
        assert "holds the states of 2 LR schedulers of the whole model" in out["two"], out["two"]
        assert "cannot load the LR scheduler state of model part 0 (rank 0): the LR scheduler state" in \
               out["pipelined bw"] and "was saved over the optimizer of the stage of ranks [0] (its part 0), with 2 " \
               "param group(s); this part's optimizer has 2 (its group 0 from saved group 1 of part 0 of ranks [0]; " \
               "its group 1 from saved group 0 of part 0 of ranks [0])" in out["pipelined bw"]
        assert "this part's optimizer has 2 (its group 0 from saved groups 1 of part 0 of ranks [0] and 1 of part 0 " \
               "of ranks [1]; its group 1 from saved groups 0 of part 0 of ranks [0] and 0 of part 0 of ranks [1])" \
               in out["resplit bw"], out["resplit bw"]
        # the parts take an older checkpoint's state by its names now: all of it, so the strict load goes on
        assert out["legacy"] == "" and out["legacy differs"] == [], (rank, out["legacy"], out["legacy differs"])
        # rank 1's stage was saved without a scheduler: refused from the files, on every rank's check
        expected = "holds no LR scheduler state for model part(s) [0]" if rank == 1 else ""
        assert (expected in out["before the load"]) and (rank == 1) == bool(out["before the load"]), \
            (rank, out["before the load"])


def _scalers_worker(rank, world_size, root):
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.checkpoint import Checkpointer, load, save

    group = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("pp", "dp"))["dp"]

    def stage():  # rank 0 holds the layers; the other stages none (a loss head, say)
        if rank > 0:
            return nn.Identity(), None
        module = _Layers(range(4), 0)
        return module, torch.optim.SGD(module.parameters(), lr=0.1)

    def scaler():  # each stage's own scale and growth tracker
        own = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** (4 + rank), growth_interval=7)
        own._init_growth_tracker = rank
        return own

    module, opt = stage()
    saved = scaler()
    save(os.path.join(root, "saved"), module, opt, saved, process_group=group, pipeline=True)
    ckpt = Checkpointer(os.path.join(root, "periodic"), process_group=group, pipeline=True)
    ckpt.restore(module, opt, saved)
    ckpt.save(1)
    ckpt.close()
    loaded, restored = fusedist.amp.GradScaler("cpu"), fusedist.amp.GradScaler("cpu")
    module, opt = stage()
    load(os.path.join(root, "saved"), module, opt, loaded, process_group=group, pipeline=True)
    ckpt = Checkpointer(os.path.join(root, "periodic"), process_group=group, pipeline=True)
    ckpt.restore(module, opt, restored)
    ckpt.close()
    return [(s.get_scale(), s.state_dict()["_growth_tracker"]) for s in (loaded, restored)]


def test_each_stage_without_parameters_takes_its_own_grad_scaler(tmp_path):
    for rank, got in enumerate(run_distributed(_scalers_worker, 3, str(tmp_path), timeout=120)):
        assert got == [(2.0 ** (4 + rank), rank), (2.0 ** (4 + rank), rank)], (rank, got)
