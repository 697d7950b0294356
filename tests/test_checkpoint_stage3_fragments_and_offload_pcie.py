"""Stage-3 checkpoint loading names the parameter (key and shape) of fragments that do not tile it or
hold the wrong number of values; the planner's zero3_offload PCIe bytes are what fully_shard with
CPUOffloadPolicy copies."""

import json
import os
import random
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedist
from fusedist.testing import run_distributed


def _net(seed, width):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))


def _save_stage3(rank, world, directory, seed, width):
    model = _net(seed, width)
    fusedist.fully_shard(model)
    fusedist.checkpoint.save(directory, model)


def _tamper_fragment(directory, rank, truncate=False):
    """Drop one of ``rank``'s model fragments (or one value off its end), the manifest updated to
    match (a tampered save); its index, key and whole shape."""
    from fusedist.checkpoint import _files

    manifest_path = os.path.join(directory, _files.MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    for name, info in manifest["files"].items():
        path = os.path.join(directory, info.get("file", name))
        if "model_shard" not in info.get("sections", []):
            continue
        obj = torch.load(path, weights_only=False)
        section = obj["model_shard"]
        if section["rank"] != rank:
            continue
        k = random.choice(sorted(section["fragments"]))
        if truncate:
            section["fragments"][k][0]["master"] = section["fragments"][k][0]["master"][:-1].clone()
        else:
            del section["fragments"][k]
        torch.save(obj, path)
        info.update(_files.file_info(path))
        with open(manifest_path, "w") as f:
            json.dump(manifest, f)
        return k, section["keys"][k], tuple(section["param_meta"][k]["shape"])
    raise AssertionError(f"no model shard of rank {rank}")


def test_stage3_fragments_that_do_not_tile_name_the_key_and_shape(tmp_path):
    """A stage-3 checkpoint missing a fragment named the parameter by its position in the
    saved key list ("parameter 1"), not by its state-dict key."""
    seed, width = random.randint(0, 10**6), random.randint(5, 9)
    directory = str(tmp_path / "ckpt")
    run_distributed(_save_stage3, 2, directory, seed, width, timeout=120)
    k, key, shape = _tamper_fragment(directory, 1)
    with pytest.raises(fusedist.checkpoint.CheckpointError) as info:
        fusedist.checkpoint.load(directory, _net(seed, width))
    message = str(info.value)
    assert f"'{key}'" in message and str(shape) in message and f"parameter {k} " not in message, message


def test_stage3_fragment_values_of_the_wrong_size_are_named(tmp_path):
    """A stage-3 model fragment holding fewer values than its range failed with torch's "shape
    '[6]' is invalid for input of size 5", naming no parameter (or, offset by another fragment's
    surplus, would load values shifted into the wrong elements)."""
    seed, width = random.randint(0, 10**6), random.randint(5, 9)
    directory = str(tmp_path / "ckpt")
    run_distributed(_save_stage3, 2, directory, seed, width, timeout=120)
    k, key, shape = _tamper_fragment(directory, random.choice([0, 1]), truncate=True)
    with pytest.raises(fusedist.checkpoint.CheckpointError, match=f"'{key}' \\(shape {re.escape(str(shape))}\\)"):
        fusedist.checkpoint.load(directory, _net(seed, width))


def _stepped(seed):
    """A model of three parameters' optimizer positions after one AdamW step: (model, optimizer, params)."""
    model = _net(seed, 6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt, [p for g in opt.param_groups for p in g["params"]]


def test_optimizer_state_loaded_into_pieces_names_the_parameter_by_its_path():
    """Optimizer state loaded into the pieces of a fully_shard model (here with no unit: each parameter is
    its own whole) that does not fit a parameter named it by its position in the optimizer's list only, both
    from torch's format and from ZeRO's fragments; it names its path in the model too."""
    from fusedist.checkpoint import _load_plan, stage3
    from fusedist.zero import state as zstate

    model, opt, params = _stepped(random.randint(0, 10**6))
    index = random.randrange(len(params))
    path = next(n for n, q in model.named_parameters() if q is params[index])
    named = f"parameter {index} ('{path}', shape {tuple(params[index].shape)})"
    full = opt.state_dict()
    full["state"][index] = dict(full["state"][index], exp_avg=full["state"][index]["exp_avg"].reshape(-1)[:-1])
    with pytest.raises(zstate.StateDictError, match=re.escape(f"state 'exp_avg' of {named} has")):
        _load_plan._prepare_full(full, "ckpt", model, (True, {}), opt, params, "optimizer state in ckpt")
    frags = zstate.fragments_from_full(opt.state_dict(), params)
    frags[index][0]["range"] = (0, params[index].numel() - 1)
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(zstate.StateDictError, match=re.escape(f"the fragments of {named} end at element")):
        stage3.optimizer_for_pieces(model, opt, params, frags, opt.state_dict()["param_groups"], None, "ckpt",
                                    names=names)


def test_a_stage3_save_of_state_not_elementwise_names_the_parameter():
    """Saving optimizer state that is not elementwise (a per-row factor) over fully_shard's pieces named every
    parameter "parameter 0" (each was cut as a one-parameter state dict), with no name."""
    from fusedist.checkpoint import stage3
    from fusedist.zero import state as zstate

    model, opt, params = _stepped(random.randint(0, 10**6))
    index = random.choice([i for i, p in enumerate(params) if p.dim() == 2])
    opt.state[params[index]]["row_factor"] = torch.zeros(params[index].shape[0])
    path = next(n for n, q in model.named_parameters() if q is params[index])
    named = f"parameter {index} ('{path}', shape {tuple(params[index].shape)})"
    with pytest.raises(zstate.StateDictError, match=re.escape(f"state 'row_factor' of {named} has")):
        stage3.optimizer_shard(model, opt, params, 0, 1)


_SPEC_ARGS = dict(arch="gpt", layers=2, hidden=32, heads=4, seq=16, vocab=64)


def _offload_copies(rank, world, accum, seed):
    """Bytes a fully_shard CPUOffloadPolicy rank copies host -> GPU (each gather's source shard)
    and GPU -> host (each reduce-scatter's output) in one step of ``accum`` micro-batches. On
    the CPU the copies are no-ops, so they are counted where a GPU run makes them."""
    from fusedist.fsdp import grads, unit as unit_mod
    from fusedist.plan import ModelSpec
    from fusedist.plan.torch_model import Transformer

    spec = ModelSpec(**_SPEC_ARGS)
    torch.manual_seed(seed)
    model = Transformer(spec)
    policy = fusedist.CPUOffloadPolicy()  # the planner's zero3_offload (Note [measuring ZeRO-3 offload])
    for block in model.blocks:
        fusedist.fully_shard(block, reshard_after_forward=True, offload_policy=policy)
    fusedist.fully_shard(model, reshard_after_forward=True, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counted = {"bytes": 0, "active": False}
    gather_source, finish = unit_mod.ShardedUnit._gather_source, grads.finish

    def counting_gather_source(self, src, dtype):
        if self.offload and counted["active"]:
            counted["bytes"] += src.numel() * src.element_size()
        return gather_source(self, src, dtype)

    def counting_finish(p):
        out = p.output
        if p.grads.unit.offload and counted["active"] and out is not None:
            counted["bytes"] += out.numel() * out.element_size()
        return finish(p)

    unit_mod.ShardedUnit._gather_source = counting_gather_source
    grads.finish = counting_finish
    try:
        for step in range(2):
            counted["active"] = step == 1
            for _ in range(accum):
                x = torch.randint(0, spec.vocab, (2, spec.seq))
                F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
    finally:
        unit_mod.ShardedUnit._gather_source, grads.finish = gather_source, finish
    return counted["bytes"]


def test_zero3_offload_pcie_bytes_are_what_fully_shard_copies():
    """The planner counted zero3_offload's PCIe bytes as one parameter shard up and one
    gradient shard down a step; CPUOffloadPolicy copies the shard up for every gather (forward
    and backward) and the gradient shard down after every micro-batch's reduce-scatter."""
    from fusedist.plan import ModelSpec
    from fusedist.plan.hardware import PRESETS
    from fusedist.plan.plan import Job, build_plan

    accum, world = random.choice([1, 2, 3]), 2
    copied = run_distributed(_offload_copies, world, accum, random.randint(0, 10**6), timeout=120)
    plan = build_plan(ModelSpec(**_SPEC_ARGS), Job(gpus=world, micro_batch=2, seq=16, global_batch=2 * world * accum,
                                                   precision="fp32"), PRESETS["h100"])
    assert plan["suggestion"]["grad_accum_steps"] == accum
    for c in copied:  # (fully_shard's padding: well under 1% here)
        assert plan["comm"]["zero3_offload"]["pcie_bytes_per_step"] == pytest.approx(c, rel=0.01)


def test_an_incomplete_shard_set_names_the_ranks_and_the_world_size():
    """The world size was printed as a list ("of a world of [3]")."""
    from fusedist.checkpoint import stage3
    from fusedist.zero.state import StateDictError

    with pytest.raises(StateDictError, match=r"model shards of ranks \[0, 2\] of a world of 3; a rank's file"):
        stage3.check_shard_set([{"rank": 0, "world_size": 3}, {"rank": 2, "world_size": 3}], "model", "ckpt")
    with pytest.raises(StateDictError, match=r"of ranks \[0, 1\] of worlds of sizes \[2, 3\]"):
        stage3.check_shard_set([{"rank": 0, "world_size": 2}, {"rank": 1, "world_size": 3}], "model", "ckpt")
