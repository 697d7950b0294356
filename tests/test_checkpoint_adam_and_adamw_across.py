"""torch's AdamW is Adam with ``decoupled_weight_decay=True``: a checkpoint of either loads into the other.

``fusedist.checkpoint.load`` and ``Checkpointer.restore`` refused torch AdamW's state for
``Adam(decoupled_weight_decay=True)`` as another algorithm's (they compared classes only), and a
checkpoint of ``Adam(decoupled_weight_decay=True)`` could not be told from Adam's L2 decay. The
manifest now records each param group's algorithm (Note [Adam and AdamW are one class in torch]
in fusedist/zero/sharded_state.py). Adam's L2 decay into AdamW stays refused. Single process.

Reference: torch's optimizer of the loading kind, restored with ``load_state_dict`` from the
saving optimizer's state, stepped on the same inputs. fp32 throughout: the loaded state is torch's
exactly, so both sides run the same arithmetic (FusedAdamW and ZeRO's inner optimizer agree with
torch's AdamW to a few fp32 ulps of an update), hence 1e-6.
"""

from __future__ import annotations

import copy
import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import fusedist
from fusedist import checkpoint
from fusedist.checkpoint import Checkpointer, CheckpointError
from fusedist.optim import FusedAdamW

_LRS = (5e-2, 2e-2)


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _groups(model, decoupled=None, decay: float = 0.3) -> list:
    """Two param groups with weight decay (large enough that L2 and decoupled decay part ways);
    ``decoupled``: each group's ``decoupled_weight_decay`` (None: the class's default)."""
    out = []
    for i, (layer, lr) in enumerate(zip((model[0], model[2]), _LRS)):
        group = {"params": list(layer.parameters()), "lr": lr, "weight_decay": decay}
        if decoupled is not None:
            group["decoupled_weight_decay"] = decoupled[i]
        out.append(group)
    return out


def _adam(decoupled=(True, True)):
    return lambda m: torch.optim.Adam(_groups(m, decoupled))


_MAKE = {
    "AdamW": lambda m: torch.optim.AdamW(_groups(m)),
    "Adam(decoupled)": _adam(),
    "Adam(L2)": _adam((False, False)),
    "Adam(one of each)": _adam((True, False)),
    "FusedAdamW": lambda m: FusedAdamW(_groups(m)),
    "ZeRO(AdamW)": lambda m: fusedist.ZeroRedundancyOptimizer(_groups(m), torch.optim.AdamW),
    "ZeRO(Adam(decoupled))": lambda m: fusedist.ZeroRedundancyOptimizer(_groups(m, (True, True)), torch.optim.Adam),
    # without weight decay, Adam's steps are AdamW's (Note [Adam without weight decay is AdamW without it])
    "Adam(no decay)": lambda m: torch.optim.Adam(_groups(m, decay=0.0)),
    "ZeRO(Adam(no decay))": lambda m: fusedist.ZeroRedundancyOptimizer(_groups(m, decay=0.0), torch.optim.Adam),
}
# the torch optimizer each kind runs as (the reference)
_TORCH = {"AdamW": "AdamW", "FusedAdamW": "AdamW", "ZeRO(AdamW)": "AdamW",
          "Adam(decoupled)": "Adam(decoupled)", "ZeRO(Adam(decoupled))": "Adam(decoupled)"}


def _steps(model, opt, seeds) -> None:
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(6, 5, generator=gen)), torch.randn(6, 3, generator=gen)).backward()
        opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _torch_state(opt) -> dict:
    return opt.consolidate_state_dict() if isinstance(opt, fusedist.ZeroRedundancyOptimizer) else opt.state_dict()


def _save(kind: str, path: str, how: str):
    """A checkpoint of ``kind`` after two steps, written by ``how``: the saving model and optimizer
    (to continue) and the optimizer's state in torch's format, as saved."""
    model = _net(0)
    opt = _MAKE[kind](model)
    ck = None
    if how == "checkpointer":
        ck = Checkpointer(path, every_steps=1, async_save=False)
        assert ck.restore(model, opt) == 0  # (nothing yet: registers what the save writes)
    _steps(model, opt, (1, 2))
    if ck is not None:
        ck.save(2)
        ck.close()
    elif how in ("save", "pipeline"):
        checkpoint.save(path, *(([model], [opt]) if how == "pipeline" else (model, opt)), pipeline=how == "pipeline")
    else:  # torch's distributed checkpoint
        msd, osd = get_state_dict(model, opt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (no process group: DCP warns that it saves alone)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return model, opt, copy.deepcopy(_torch_state(opt))


def _load(path: str, model, opt, how: str) -> None:
    if how == "checkpointer":
        assert Checkpointer(path, every_steps=1, async_save=False).restore(model, opt) == 2
    elif how == "pipeline":  # the model's one part, as a pipelined job's rank passes its parts
        checkpoint.load(path, [model], [opt], pipeline=True)
    else:
        checkpoint.load(path, model, opt)


@pytest.mark.parametrize("saved_with,loaded_into,how", [
    ("AdamW", "Adam(decoupled)", "save"),
    ("Adam(decoupled)", "AdamW", "save"),
    ("Adam(decoupled)", "FusedAdamW", "save"),
    ("ZeRO(AdamW)", "ZeRO(Adam(decoupled))", "save"),
    ("ZeRO(Adam(decoupled))", "AdamW", "save"),
    ("AdamW", "Adam(decoupled)", "checkpointer"),
    ("Adam(decoupled)", "AdamW", "checkpointer"),
    ("Adam(decoupled)", "AdamW", "pipeline"),
    ("AdamW", "Adam(decoupled)", "dcp"),
    ("Adam(decoupled)", "AdamW", "dcp"),
])
def test_adamw_state_loads_into_adam_with_decoupled_decay_and_back(tmp_path, saved_with, loaded_into, how):
    path = str(tmp_path / "ckpt")
    saved_model, saved_opt, saved_state = _save(saved_with, path, how)
    model = _net(1)
    opt = _MAKE[loaded_into](model)
    _load(path, model, opt, how)

    reference = _net(1)
    reference.load_state_dict(saved_model.state_dict())
    torch_opt = _MAKE[_TORCH[loaded_into]](reference)
    torch_opt.load_state_dict(saved_state)
    assert torch.equal(_flat(model), _flat(reference))
    for net, optimizer in ((model, opt), (reference, torch_opt), (saved_model, saved_opt)):
        _steps(net, optimizer, (3, 4))
    torch.testing.assert_close(_flat(model), _flat(reference), atol=1e-6, rtol=0)
    # the same algorithm as the saving optimizer continued with: decoupled decay in every group
    torch.testing.assert_close(_flat(model), _flat(saved_model), atol=1e-6, rtol=0)


@pytest.mark.parametrize("saved_with,loaded_into,how,group", [
    ("Adam(L2)", "AdamW", "save", 0),
    ("Adam(L2)", "Adam(decoupled)", "save", 0),
    ("Adam(L2)", "FusedAdamW", "save", 0),
    ("Adam(L2)", "AdamW", "checkpointer", 0),
    ("Adam(L2)", "AdamW", "pipeline", 0),
    ("Adam(one of each)", "AdamW", "save", 1),
    ("Adam(one of each)", "Adam(decoupled)", "save", 1),
])
def test_adam_with_l2_decay_into_adamw_is_refused(tmp_path, saved_with, loaded_into, how, group):
    """The saved groups would switch the algorithm (torch's Adam loads ``decoupled_weight_decay=False``
    with the state; torch's AdamW reads Adam's L2 coefficient as decoupled): refused, nothing changed."""
    path = str(tmp_path / "ckpt")
    _save(saved_with, path, how)
    model = _net(1)
    opt = _MAKE[loaded_into](model)
    before = _flat(model).clone()
    with pytest.raises(CheckpointError, match=rf"holds the state of Adam \(Adam\).* in param group {group} "
                                              r"\(decoupled_weight_decay=True\).*optimizer=None"):
        _load(path, model, opt, how)
    assert torch.equal(before, _flat(model))
    assert not opt.state and [g["lr"] for g in opt.param_groups] == list(_LRS)


@pytest.mark.parametrize("saved_with,loaded_into,how", [
    ("Adam(no decay)", "AdamW", "save"),
    ("Adam(no decay)", "FusedAdamW", "save"),
    ("Adam(no decay)", "ZeRO(AdamW)", "save"),
    ("ZeRO(Adam(no decay))", "ZeRO(AdamW)", "save"),
    ("ZeRO(Adam(no decay))", "AdamW", "save"),
    ("Adam(no decay)", "AdamW", "checkpointer"),
    ("Adam(no decay)", "AdamW", "pipeline"),
    ("Adam(no decay)", "AdamW", "dcp"),
    ("Adam(no decay)", "AdamW", "older manifest"),
])
def test_adam_without_weight_decay_continues_as_adamw(tmp_path, saved_with, loaded_into, how):
    """Adam with ``weight_decay=0`` is AdamW with it: its state loads into AdamW (it was refused
    as another algorithm's) and continues as torch's AdamW given Adam's state by
    ``load_state_dict``; the loaded groups keep AdamW's decoupled decay (torch's loader takes
    Adam's setting, so an AdamW given a weight decay later ran L2 decay). "older manifest": one
    written before the groups' weight decays were recorded reads them from the saved groups."""
    path = str(tmp_path / "ckpt")
    saved_model, saved_opt, saved_state = _save(saved_with, path, "save" if how == "older manifest" else how)
    if how == "older manifest":
        _without_recorded(path, "group_weight_decay")
    model = _net(1)
    opt = _MAKE[loaded_into](model)
    _load(path, model, opt, "save" if how == "older manifest" else how)
    assert [g["decoupled_weight_decay"] for g in opt.param_groups] == [True, True]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]  # (the saved hyperparameters, as torch's)

    reference = _net(1)
    reference.load_state_dict(saved_model.state_dict())
    torch_opt = torch.optim.AdamW(_groups(reference))
    torch_opt.load_state_dict(saved_state)
    for net, optimizer in ((model, opt), (reference, torch_opt), (saved_model, saved_opt)):
        _steps(net, optimizer, (3, 4))
    torch.testing.assert_close(_flat(model), _flat(reference), atol=1e-6, rtol=0)
    torch.testing.assert_close(_flat(model), _flat(saved_model), atol=1e-6, rtol=0)


def _without_recorded(path: str, key: str) -> None:
    """The manifest as a fusedist that did not record the optimizer's ``key`` wrote it."""
    name = os.path.join(path, "manifest.json")
    with open(name) as f:
        manifest = json.load(f)
    assert manifest["optimizer"].pop(key) is not None
    with open(name, "w") as f:
        json.dump(manifest, f)


def _without_group_algorithms(path: str) -> None:
    """The manifest as a fusedist that did not record the per-group algorithms wrote it."""
    name = os.path.join(path, "manifest.json")
    with open(name) as f:
        manifest = json.load(f)
    assert manifest["optimizer"].pop("group_algorithms") is not None
    with open(name, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("saved_with,loaded_into,loads", [
    ("AdamW", "Adam(decoupled)", True),  # the class says AdamW in every group
    ("Adam(decoupled)", "Adam(decoupled)", True),  # as before: the same class
    ("Adam(L2)", "Adam(L2)", True),
    ("Adam(decoupled)", "AdamW", False),  # as before: Adam's groups were not recorded
    ("Adam(L2)", "AdamW", False),
])
def test_a_manifest_without_group_algorithms_reads_as_before(tmp_path, saved_with, loaded_into, loads):
    path = str(tmp_path / "ckpt")
    saved_model, _, saved_state = _save(saved_with, path, "save")
    _without_group_algorithms(path)
    model = _net(1)
    opt = _MAKE[loaded_into](model)
    if not loads:
        with pytest.raises(CheckpointError, match=r"holds the state of Adam \(Adam\)"):
            checkpoint.load(path, model, opt)
        return
    checkpoint.load(path, model, opt)
    reference = _net(1)
    reference.load_state_dict(saved_model.state_dict())
    torch_opt = _MAKE[loaded_into](reference)
    torch_opt.load_state_dict(saved_state)
    _steps(model, opt, (3,))
    _steps(reference, torch_opt, (3,))
    torch.testing.assert_close(_flat(model), _flat(reference), atol=1e-6, rtol=0)


def test_a_pipelined_checkpoint_regrouped_into_one_part(tmp_path):
    """Two pipeline stages, each ``Adam(decoupled_weight_decay=True)`` over one layer (one param
    group each), loaded into one part whose AdamW has both layers in two groups: the stages record
    one group, the part has two, and decoupled decay in every saved group stands for both."""
    path = str(tmp_path / "ckpt")
    model = _net(0)
    stages = [torch.optim.Adam(layer.parameters(), lr=lr, weight_decay=0.3, decoupled_weight_decay=True)
              for layer, lr in zip((model[0], model[2]), _LRS)]
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        for opt in stages:
            opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(6, 5, generator=gen)), torch.randn(6, 3, generator=gen)).backward()
        for opt in stages:
            opt.step()
    parts = [nn.Sequential(model[0]), nn.Sequential(nn.Identity(), nn.Identity(), model[2])]  # (the keys of model)
    checkpoint.save(path, parts, stages, pipeline=True)
    loaded = _net(1)
    opt = _MAKE["AdamW"](loaded)
    checkpoint.load(path, [loaded], [opt], pipeline=True)

    first, second = (s.state_dict() for s in stages)
    saved_state = {"state": {**first["state"], **{i + 2: v for i, v in second["state"].items()}},
                   "param_groups": [first["param_groups"][0], dict(second["param_groups"][0], params=[2, 3])]}
    reference = _net(1)
    reference.load_state_dict(model.state_dict())
    torch_opt = _MAKE["AdamW"](reference)
    torch_opt.load_state_dict(saved_state)
    _steps(loaded, opt, (3, 4))
    _steps(reference, torch_opt, (3, 4))
    torch.testing.assert_close(_flat(loaded), _flat(reference), atol=1e-6, rtol=0)


def _list_without_recorded_decays(path: str) -> None:
    """The manifest of a list as a fusedist that did not record the groups' weight decays wrote it."""
    name = os.path.join(path, "manifest.json")
    with open(name) as f:
        manifest = json.load(f)
    for entry in manifest["pipeline"]:
        assert entry["optimizer"].pop("group_weight_decay") is not None
    with open(name, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("older_manifest", [False, True])
def test_a_list_with_adam_without_weight_decay_loads_into_adamw(tmp_path, older_manifest):
    """A list of optimizers (Note [several optimizers over one model]): Adam without weight decay
    at a position loads into AdamW there, as a single optimizer's state does. A manifest written
    before the weight decays were recorded is read by the saved groups' weight decay (it was
    refused by class), as a single optimizer's is."""
    path = str(tmp_path / "ckpt")

    def make(model, first, decay=0.0):
        return [first(model[0].parameters(), lr=_LRS[0], weight_decay=decay),
                torch.optim.SGD(model[2].parameters(), lr=_LRS[1], momentum=0.9)]

    def steps(model, opts, seeds):
        for seed in seeds:
            gen = torch.Generator().manual_seed(seed)
            for opt in opts:
                opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(6, 5, generator=gen)), torch.randn(6, 3, generator=gen)).backward()
            for opt in opts:
                opt.step()

    saved_model = _net(0)
    saved_opts = make(saved_model, torch.optim.Adam)
    steps(saved_model, saved_opts, (1, 2))
    checkpoint.save(path, saved_model, saved_opts)
    if older_manifest:
        _list_without_recorded_decays(path)
    model = _net(1)
    opts = make(model, torch.optim.AdamW)
    checkpoint.load(path, model, opts)
    assert opts[0].param_groups[0]["decoupled_weight_decay"] is True
    reference = _net(1)
    reference.load_state_dict(saved_model.state_dict())
    torch_opts = make(reference, torch.optim.AdamW)
    for torch_opt, saved_opt in zip(torch_opts, saved_opts):
        torch_opt.load_state_dict(copy.deepcopy(saved_opt.state_dict()))
    steps(model, opts, (3, 4))
    steps(reference, torch_opts, (3, 4))
    torch.testing.assert_close(_flat(model), _flat(reference), atol=1e-6, rtol=0)


def _zero_shards_into_zero_adamw(rank: int, world: int) -> dict:
    """Each rank's ZeroRedundancyOptimizer(Adam, weight_decay=0) shard, gathered and passed to
    ``load_state_dict`` of a ZeroRedundancyOptimizer over AdamW; then two more steps. The
    reference: torch's Adam over the same steps, its state loaded into torch's AdamW. Every rank
    steps the same batches (ZeRO alone, no data parallelism), so the ranks agree."""
    import torch.distributed as dist

    from fusedist.zero.state import StateDictError

    saved_model, reference = _net(0), _net(0)
    saved = fusedist.ZeroRedundancyOptimizer(_groups(saved_model, decay=0.0), torch.optim.Adam)
    torch_adam = torch.optim.Adam(_groups(reference, decay=0.0))
    _steps(saved_model, saved, (1, 2))
    _steps(reference, torch_adam, (1, 2))
    shards = [None] * world
    dist.all_gather_object(shards, saved.state_dict())

    model = _net(1)
    model.load_state_dict(saved_model.state_dict())
    opt = fusedist.ZeroRedundancyOptimizer(_groups(model), torch.optim.AdamW)
    opt.load_state_dict(shards)
    torch_adamw = torch.optim.AdamW(_groups(reference))
    torch_adamw.load_state_dict(copy.deepcopy(torch_adam.state_dict()))
    _steps(model, opt, (3, 4))
    _steps(reference, torch_adamw, (3, 4))

    decayed = fusedist.ZeroRedundancyOptimizer(_groups(_net(0)), torch.optim.Adam)  # (Adam's L2 decay)
    l2_shards = [None] * world
    dist.all_gather_object(l2_shards, decayed.state_dict())
    refused = None
    try:
        fusedist.ZeroRedundancyOptimizer(_groups(_net(1)), torch.optim.AdamW).load_state_dict(l2_shards)
    except StateDictError as exc:
        refused = str(exc)
    return {"loaded": _flat(model), "reference": _flat(reference), "refused": refused,
            "decoupled": [g["decoupled_weight_decay"] for g in opt.param_groups],
            "decay": [g["weight_decay"] for g in opt.param_groups]}


def test_zero_load_state_dict_takes_adam_without_weight_decay_into_adamw():
    """``ZeroRedundancyOptimizer.load_state_dict`` reads a shard's groups by the checkpoint's
    rule: Adam without weight decay continues as torch's AdamW given its state (it was refused
    as another algorithm's), keeping AdamW's decoupled decay; Adam's L2 decay stays refused.
    World 2: each rank's shard holds part of the state."""
    from fusedist.testing import run_distributed

    for out in run_distributed(_zero_shards_into_zero_adamw, 2, timeout=120):
        torch.testing.assert_close(out["loaded"], out["reference"], atol=1e-6, rtol=0)
        assert out["decoupled"] == [True, True] and out["decay"] == [0.0, 0.0]
        assert out["refused"] is not None and "holds the state of Adam (Adam)" in out["refused"]


def test_a_list_with_adam_l2_decay_and_an_older_manifest_is_refused(tmp_path):
    """The other side of the older manifest's rule: a position saved with Adam's L2 decay is still
    refused for AdamW (by its saved groups), before anything changes."""
    path = str(tmp_path / "ckpt")
    saved_model = _net(0)
    saved_opts = [torch.optim.Adam(saved_model[0].parameters(), lr=_LRS[0], weight_decay=0.3),
                  torch.optim.SGD(saved_model[2].parameters(), lr=_LRS[1])]
    _steps(saved_model, saved_opts[0], (1,))
    checkpoint.save(path, saved_model, saved_opts)
    _list_without_recorded_decays(path)
    model = _net(1)
    opts = [torch.optim.AdamW(model[0].parameters(), lr=_LRS[0], weight_decay=0.3),
            torch.optim.SGD(model[2].parameters(), lr=_LRS[1])]
    before = _flat(model).clone()
    with pytest.raises(CheckpointError, match=r"holds the state of Adam \(Adam\).*AdamW"):
        checkpoint.load(path, model, opts)
    assert torch.equal(before, _flat(model)) and not opts[0].state
