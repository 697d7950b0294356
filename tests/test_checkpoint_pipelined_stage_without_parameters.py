"""Pipelined checkpoints of a job with a pipeline stage that has no parameters (Note [an optimizer
per pipeline stage] in fusedist/checkpoint/_checks.py).

A last stage holding only the loss has no parameters, and torch refuses to build an optimizer
over none: that stage passes ``optimizer=None`` while the others pass theirs. On pp 2 x dp 2
(gloo, 4 ranks), stage 0 a fusedist DDP model over its data-parallel group with AdamW, stage 1
a parameter-free loss head, activations and their gradients sent between the stages:

- ``save``/``load`` with ``pipeline=True`` and a ``Checkpointer`` with ``pipeline=True`` save and
  restore it (both were refused: "optimizer is AdamW on ranks [0, 1]; None on ranks [2, 3]"), each
  stage's GradScaler included, and fresh parts loaded from either train on bit for bit as the
  uninterrupted run;
- so does torch's distributed checkpoint of such a job (the parameter-free part found no model
  state to take);
- the ranks of ONE stage passing different optimizers are still refused, at save (nothing
  written) and at load (nothing loaded), naming the stage;
- a strict load where a stage with saved optimizer state passes no optimizer is refused on every
  rank alike; ``strict=False`` loads the model, and lists the keys of torch's distributed
  checkpoint no part loads on the stateless stage's ranks too, in the order torch's
  ``load_state_dict`` of the whole model lists them (they came in the order the checkpoint read
  them back: ``bias`` first).
"""

from __future__ import annotations

import os

import torch
from torch import nn

import models
from fusedist.testing import run_distributed

WIDTH, STEPS, SAVED_AT = 6, 4, 2


def _Body(seed: int, ids=(0, 1)):
    """Stage 0: layers ``ids`` of two, under the whole model's names."""
    return models.WholeModelLayers(ids, seed, width=WIDTH, count=2)


class _Loss(nn.Module):
    """Stage 1: a loss head without parameters or buffers."""

    def forward(self, x):
        return nn.functional.layer_norm(x, (WIDTH,)).square().mean()


def _stage(pp: int, dp_group, seed: int):
    """This rank's part and optimizer (None on the parameter-free stage)."""
    import fusedist

    if pp == 1:
        return _Loss(), None
    model = fusedist.DistributedDataParallel(_Body(seed), process_group=dp_group)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, pp: int, dp: int, step: int) -> None:
    """One pipeline step: stage 0's activations to its stage-1 peer, their gradient back."""
    import torch.distributed as dist

    peer = 2 * (1 - pp) + dp
    if pp == 0:
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + dp))
        out = model(x)
        dist.send(out.detach(), peer)
        grad = torch.empty_like(out)
        dist.recv(grad, peer)
        out.backward(grad)
        opt.step()
        opt.zero_grad()
    else:
        x = torch.empty(4, WIDTH)
        dist.recv(x, peer)
        x.requires_grad_(True)
        model(x).backward()
        dist.send(x.grad, peer)


def _state(model, opt) -> dict:
    out = {k: v.clone() for k, v in model.state_dict().items()}
    if opt is not None:
        out.update({f"{i}/{k}": torch.as_tensor(v).clone() for i, st in opt.state_dict()["state"].items()
                    for k, v in st.items()})
    return out


def _differ(a: dict, b: dict) -> list:
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return ""


def _resume_worker(rank, world_size, seed, root):
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.checkpoint import Checkpointer, load, save

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp, group = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["dp"]
    model, opt = _stage(pp, group.get_group(), seed)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** (4 + pp))  # each stage's own, saved with it
    ckpt = Checkpointer(os.path.join(root, "periodic"), process_group=group, pipeline=True)
    out = {"fresh start": ckpt.restore(model, opt, scaler)}
    for step in range(STEPS):
        if step == SAVED_AT:
            save(os.path.join(root, "saved"), model, opt, scaler, extra={"step": step}, process_group=group,
                 pipeline=True)
            ckpt.save(step)
            ckpt.close()
        _train(model, opt, pp, dp, step)
    uninterrupted = _state(model, opt)

    resumed, scalers = [], [fusedist.amp.GradScaler("cpu") for _ in range(2)]
    fresh, fresh_opt = _stage(pp, group.get_group(), seed + 1)
    out["extra"] = load(os.path.join(root, "saved"), fresh, fresh_opt, scalers[0], process_group=group, pipeline=True)
    resumed.append((fresh, fresh_opt))
    fresh, fresh_opt = _stage(pp, group.get_group(), seed + 2)
    ckpt = Checkpointer(os.path.join(root, "periodic"), process_group=group, pipeline=True)
    out["restored"] = ckpt.restore(fresh, fresh_opt, scalers[1])
    ckpt.close()
    resumed.append((fresh, fresh_opt))
    out["scales"] = [s.get_scale() for s in scalers]
    out["differ"] = []
    for fresh, fresh_opt in resumed:
        for step in range(SAVED_AT, STEPS):
            _train(fresh, fresh_opt, pp, dp, step)
        out["differ"].append(_differ(_state(fresh, fresh_opt), uninterrupted))
    return out


def test_a_stage_without_parameters_is_saved_restored_and_trains_on(tmp_path):
    """Both were refused ("optimizer is AdamW on ranks [0, 1]; None on ranks [2, 3]"); and the
    stage without parameters found no GradScaler state ("holds no GradScaler state for this
    part's stages"): it takes nothing else, so none of the stages was its."""
    for rank, out in enumerate(run_distributed(_resume_worker, 4, 5, str(tmp_path), timeout=120)):
        assert out["fresh start"] == 0 and out["restored"] == SAVED_AT, (rank, out)
        assert out["extra"] == {"step": SAVED_AT}, (rank, out)
        assert out["scales"] == [2.0 ** (4 + rank // 2)] * 2, (rank, out)  # the stage without parameters' too
        assert out["differ"] == [[], []], (rank, out["differ"])


def _refusal_worker(rank, world_size, seed, root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.checkpoint import load, save

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp, group = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["dp"]
    model, opt = _stage(pp, group.get_group(), seed)
    _train(model, opt, pp, dp, 0)
    saved = os.path.join(root, "saved")
    save(saved, model, opt, process_group=group, pipeline=True)
    out = {}

    # torch's distributed checkpoint of the same job (torchtitan's: the optimizer flattened by name)
    if pp == 0:
        model_state, optim_state = get_state_dict(model.module, opt,
                                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
    else:
        model_state, optim_state = {}, {}
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(root, "dcp"))
    fresh, fresh_opt = _stage(pp, group.get_group(), seed + 1)
    out["dcp"] = _error(lambda: load(os.path.join(root, "dcp"), fresh, fresh_opt, process_group=group, pipeline=True))
    out["dcp differ"] = _differ(_state(fresh, fresh_opt), _state(model, opt))

    # the ranks of one stage disagree: rank 1 passes no optimizer for stage 0
    fresh, fresh_opt = _stage(pp, group.get_group(), seed + 2)
    before = _state(fresh, fresh_opt)
    one_short = None if rank == 1 else fresh_opt
    refused = os.path.join(root, "refused")
    out["save"] = _error(lambda: save(refused, fresh, one_short, process_group=group, pipeline=True))
    dist.barrier()
    out["written"] = os.path.exists(os.path.join(refused, "manifest.json"))
    out["load"] = _error(lambda: load(saved, fresh, one_short, process_group=group, pipeline=True))
    out["load changed"] = _differ(_state(fresh, fresh_opt), before)

    # no optimizer on any rank: the model alone
    out["model alone"] = _error(lambda: load(saved, fresh, None, process_group=group, pipeline=True))
    out["model differ"] = _differ(fresh.state_dict(), model.state_dict())

    # split 1 + 1: layer 1's optimizer state left out by stage 1, refused on every rank alike
    split = _Body(seed + 3, ids=[pp])
    split_opt = torch.optim.AdamW(split.parameters(), lr=1e-2) if pp == 0 else None
    before = _state(split, split_opt)
    out["strict"] = _error(lambda: load(saved, split, split_opt, process_group=group, pipeline=True))
    out["strict changed"] = _differ(_state(split, split_opt), before)
    out["not strict"] = _error(lambda: load(saved, split, split_opt, process_group=group, pipeline=True,
                                            strict=False))
    whole = model.module.state_dict() if pp == 0 else None
    box = [whole]
    dist.broadcast_object_list(box, src=0)
    out["split differ"] = _differ(split.state_dict(), {k: v for k, v in box[0].items() if k in split.state_dict()})

    # torch's distributed checkpoint, not strict, into stage 0 holding layer 0 alone and stage 1
    # without state: the keys no part loads, on every rank as torch's load_state_dict of the whole
    # model (layer 0) lists them (stage 1's ranks listed none)
    part = _Body(seed + 4, ids=[0]) if pp == 0 else _Loss()
    left = load(os.path.join(root, "dcp"), part, None, process_group=group, pipeline=True, strict=False)
    out["dcp not strict"] = (left.missing_keys, left.unexpected_keys)
    out["torch not strict"] = tuple(_Body(seed + 4, ids=[0]).load_state_dict(box[0], strict=False))
    return out


def test_stage_optimizers_are_compared_within_each_stage(tmp_path):
    for rank, out in enumerate(run_distributed(_refusal_worker, 4, 9, str(tmp_path), timeout=120)):
        assert out["dcp"] == "" and out["dcp differ"] == [], (rank, out)
        assert "the ranks of one pipeline stage (part 0 of ranks [0, 1]) passed different optimizers: AdamW on " \
               "ranks [0]; None on ranks [1]" in out["save"] and "nothing was written" in out["save"], (rank, out)
        assert not out["written"], (rank, out)
        assert "the ranks of one pipeline stage (the part holding 'layers.0.bias') passed different optimizers: " \
               "AdamW on ranks [0]; None on ranks [1]" in out["load"], (rank, out)
        assert "nothing was loaded" in out["load"] and out["load changed"] == [], (rank, out)
        assert out["model alone"] == "" and out["model differ"] == [], (rank, out)
        assert "holds 2 parameters' optimizer state that no model part of this job loads (['layers.1.weight', " \
               "'layers.1.bias']; saved by ranks [0, 1]): every rank of a pipeline-parallel job passes its parts " \
               "with pipeline=True, each part holding parameters with its optimizer" in out["strict"], (rank, out)
        assert out["strict changed"] == [], (rank, out)
        assert out["not strict"] == "" and out["split differ"] == [], (rank, out)
        # in torch's order: the checkpoint reads them back bias first (each from another saving rank's file)
        assert out["dcp not strict"] == out["torch not strict"] == ([], ["layers.1.weight", "layers.1.bias"]), \
            (rank, out)


class _Wrapped(nn.Module):
    """A stage whose only child is called ``module``: every key starts with ``module.``."""

    def __init__(self, seed: int, ids):
        super().__init__()
        torch.manual_seed(seed)
        every = [nn.Linear(WIDTH, WIDTH) for _ in range(4)]
        self.module = nn.ModuleDict({str(i): every[i] for i in ids})

    def forward(self, x):
        for layer in self.module.values():
            x = torch.tanh(layer(x))
        return x


class _Biasless(nn.Module):
    """``_Wrapped``'s layers without biases, registered in the order of ``ids``."""

    def __init__(self, ids):
        super().__init__()
        self.module = nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH, bias=False) for i in ids})


def _resplit_worker(rank, world_size, seed, root):
    import warnings

    import numpy
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.checkpoint import load, save

    group = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"]
    ids = [2 * rank, 2 * rank + 1]
    model = _Wrapped(seed, ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, WIDTH)).square().mean().backward()
    opt.step()
    save(root, model, opt, process_group=group, pipeline=True)
    held = [_Wrapped(seed + 1 + i, [i]) for i in ids]  # another split: one layer per part, two parts per rank
    opts = [torch.optim.AdamW(part.parameters(), lr=1e-2) for part in held]
    error = _error(lambda: load(root, held, opts, process_group=group, pipeline=True))
    got = {k: v for part, part_opt in zip(held, opts) for k, v in _by_name(part, part_opt).items()}

    # a value load reads only with trusted=True in the param groups of the second stage: warned
    # on the rank that writes them, as an ordinary save warns (only rank 0's were looked at)
    opt.param_groups[0]["lr"] = numpy.float64(0.5) if rank == 1 else 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save(root + "-numpy", model, opt, process_group=group, pipeline=True)
    warned = [str(w.message) for w in caught if "cannot be read back by load() without trusted=True" in str(w.message)]

    # not strict, into layers without biases, rank 1's part holding layers 3 and 2 in that order:
    # the biases no part loads in torch's order of the whole model, which rank 0 learns from rank 1
    left = load(root, _Biasless([0, 1] if rank == 0 else [3, 2]), None, process_group=group, pipeline=True,
                strict=False)
    torch_left = _Biasless([0, 1, 3, 2]).load_state_dict(_Wrapped(seed, range(4)).state_dict(), strict=False)
    return error, _differ(got, _by_name(model, opt)), warned, (tuple(left), tuple(torch_left))


def _by_name(model, opt) -> dict:
    """The model's state and its AdamW state by parameter name."""
    names = [n for n, _ in model.named_parameters()]
    out = {k: v.clone() for k, v in model.state_dict().items()}
    out.update({f"{names[i]}/{k}": torch.as_tensor(v).clone() for i, st in opt.state_dict()["state"].items()
                for k, v in st.items()})
    return out


def test_stages_of_module_keys_load_into_another_split_and_each_stages_groups_are_checked(tmp_path):
    """A stage whose only child is ``module``: its keys lost their ``module.`` segment, normalized
    against a part holding some of them ("missing keys [module.0.weight ...]" on every load into
    another split). And a NumPy learning rate in the second stage's param groups, which a load
    reads only with trusted=True, was written without the warning an ordinary save gives. And a load
    that is not strict listed the keys no part loads in the checkpoint's order on the rank whose
    part did not tell torch's (one registering its layers in another order)."""
    for rank, (error, differ, warned, keys) in enumerate(run_distributed(_resplit_worker, 2, 3,
                                                                          str(tmp_path / "c"))):
        assert error == "" and differ == [], (rank, error, differ)
        assert len(warned) == rank and all("param_groups" in w for w in warned), (rank, warned)
        left, torch_left = keys
        assert left == torch_left == ([], [f"module.{i}.bias" for i in (0, 1, 3, 2)]), (rank, keys)
