"""Checkpointer.restore refusals and partial restores against the documented behaviour, on gloo:

* a ``fully_shard`` model whose sharded parameters have other shapes than the checkpoint's, and
  the parts of a pipelined Checkpointer of other shapes, are refused at once naming the key and
  both shapes, with nothing loaded and no older checkpoint tried (they were refused by the load,
  each older checkpoint tried in turn: Note [a model that does not match] in
  fusedist/checkpoint/_restore.py); an optimizer over other parameters is refused naming them;
* ranks whose ResumableDistributedSamplers sit in different epochs are refused at the save, and
  a checkpoint written so before is skipped for the previous one (each rank resumed in its own
  epoch: Note [one epoch for the job] in fusedist/checkpoint/_snapshot.py);
* CUDA generator states of more or fewer devices than the machine has restore the devices both
  have, with a warning (Note [CUDA generator states of another number of devices]), simulated
  on the CPU.
"""

from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch
from torch import nn

import models
from phased_launches import launch_phase
from shared_rank_launch import results_of

ENV = {"FUSEDIST_TIMEOUT_S": "30"}


def _step(model, opt, rank: int, step: int, width: int = 8) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    opt.zero_grad()
    model(torch.randn(5, width, generator=g)).square().mean().backward()
    opt.step()


def _params(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def _restore(ckpt, *args, **kwargs) -> tuple:
    """``(the step or the error's text, the warnings' texts)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = ckpt.restore(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            out = f"{type(exc).__name__}: {exc}"
    return out, [str(w.message) for w in caught]


def _sharded(seed: int, hidden: int = 8):
    import fusedist

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fusedist.fully_shard(layer)
    return fusedist.fully_shard(model) or model


def _ddp(seed: int):
    import fusedist

    torch.manual_seed(seed)
    return fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)))


def _other_objects_worker(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer

    out = {}
    for name, build in (("sharded", _sharded), ("ddp", _ddp)):
        model = build(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ckpt = Checkpointer(os.path.join(root, name), every_steps=1, async_save=False)
        ckpt.restore(model, opt)
        for step in range(2):
            _step(model, opt, rank, step)
            ckpt.save(step + 1)
        ckpt.close()
    # another width of a sharded layer (the model alone: an optimizer was refused by its shapes)
    model = _sharded(5, hidden=6)
    before = _params(model)
    ckpt = Checkpointer(os.path.join(root, "sharded"), every_steps=1, async_save=False)
    out["sharded"] = _restore(ckpt, model) + (all(map(torch.equal, before, _params(model))),)
    ckpt.close()
    # the same model, its optimizer over other parameters (one frozen since, the others reversed)
    model = _ddp(5)
    opt = torch.optim.AdamW(list(model.parameters())[:0:-1], lr=1e-2)
    ckpt = Checkpointer(os.path.join(root, "ddp"), every_steps=1, async_save=False)
    out["optimizer"] = _restore(ckpt, model, opt)
    ckpt.close()
    return out


def test_a_sharded_model_or_optimizer_of_other_parameters_is_refused_at_once(launched):
    results = results_of(launched, "other objects")
    for rank, out in enumerate(results):
        error, said, unchanged = out["sharded"]
        assert "is refused on rank 0" in error and "no older checkpoint is tried" in error, (rank, error)
        assert "'2.weight' has shape (8, 8) in" in error and "the model's is (6, 8)" in error, (rank, error)
        assert "step-00000002" in error and "step-00000001" not in error, (rank, error)
        assert unchanged and not any("trying the previous one" in s for s in said), (rank, said)
        error, _ = out["optimizer"]
        assert "is refused on" in error and "the checkpoint's optimizer also holds ['0.weight']" in error, error


_Layers = functools.partial(models.WholeModelLayers, count=4)


def _pipelined_worker(rank, world_size, root):
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.checkpoint import Checkpointer

    group = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"]
    ids = [[0, 1], [2, 3]][rank]
    part = _Layers(ids, 0, width=4)
    opt = torch.optim.AdamW(part.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, process_group=group, pipeline=True, async_save=False)
    ckpt.restore(part, opt)
    for step in range(2):
        _step(part, opt, rank, step, width=4)
        ckpt.save(step + 1)
    ckpt.close()
    wider = _Layers(ids, 5, width=6)
    before = _params(wider)
    ckpt = Checkpointer(root, process_group=group, pipeline=True, async_save=False)
    out = _restore(ckpt, wider, torch.optim.AdamW(wider.parameters(), lr=1e-2))
    ckpt.close()
    return out + (all(map(torch.equal, before, _params(wider))),)


def test_pipelined_parts_of_other_shapes_are_refused_at_once(launched):
    results = results_of(launched, "pipelined")
    for rank, (error, said, unchanged) in enumerate(results):
        assert "is refused on rank 0" in error and "no older checkpoint is tried" in error, (rank, error)
        assert "'layers.0.weight' has shape (4, 4) in" in error and "the model's is (6, 6)" in error, (rank, error)
        assert "'layers.2.weight' has shape (4, 4) in" in error, (rank, error)  # (rank 1's part)
        assert unchanged and not any("trying the previous one" in s for s in said), (rank, said)


def _epochs_worker(rank, world_size, root):
    import fusedist.checkpoint._snapshot as snapshot
    from fusedist.checkpoint import Checkpointer
    from fusedist.checkpoint.resume import ResumableDistributedSampler

    def sampler_in(epoch: int):
        sampler = ResumableDistributedSampler(list(range(20)), num_replicas=world_size, rank=rank, seed=3)
        sampler.set_epoch(epoch)
        next(iter(sampler))
        sampler.advance(1)
        return sampler

    model = _ddp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = sampler_in(2)
    ckpt = Checkpointer(root, async_save=False)
    ckpt.restore(model, opt, sampler=sampler)
    ckpt.save(1)
    saved = _params(model)
    _step(model, opt, rank, 1)
    sampler.set_epoch(3 + rank)  # a set_epoch that differs by rank
    next(iter(sampler))
    sampler.advance(1)
    out = {"refused": ""}
    try:
        ckpt.save(2)
    except Exception as exc:  # noqa: BLE001
        out["refused"] = str(exc)
    out["written"] = os.path.exists(os.path.join(root, "step-00000002"))
    differ = getattr(snapshot, "epochs_differ", None)
    snapshot.epochs_differ = lambda epochs: None  # as an older fusedist saved it
    if not out["written"]:
        ckpt.save(2)
    snapshot.epochs_differ = differ
    ckpt.close()
    fresh, restored = _ddp(5), ResumableDistributedSampler(list(range(20)), num_replicas=world_size, rank=rank, seed=3)
    ckpt = Checkpointer(root, async_save=False)
    out["restored"] = _restore(ckpt, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), sampler=restored)
    out["epoch"] = restored.epoch
    out["params"] = all(map(torch.equal, saved, _params(fresh)))
    ckpt.close()
    return out


def test_ranks_in_different_epochs_are_refused_at_the_save_and_skipped_at_the_restore(launched):
    results = results_of(launched, "epochs")
    for rank, out in enumerate(results):
        assert "the sampler's epoch is 3 on ranks [0], 4 on ranks [1]" in out["refused"], (rank, out)
        assert "Nothing was written for step 2" in out["refused"] and not out["written"], (rank, out)
        step, said = out["restored"]
        assert step == 1 and out["epoch"] == 2 and out["params"], (rank, out)
        if rank == 0:
            assert any("could not be loaded (its ranks saved different data positions (the sampler's epoch is 3 "
                       "on ranks [0], 4 on ranks [1])" in s for s in said), said


def _cuda_states_worker(rank, world_size, root, saved_devices, devices):
    import fusedist.checkpoint.resume as resume
    from fusedist.checkpoint import Checkpointer

    captured = resume.capture_rng_state
    states = [torch.Generator().manual_seed(i).get_state() for i in range(saved_devices)]
    resume.capture_rng_state = lambda: dict(captured(), cuda=states)  # what a GPU job saves
    model = _ddp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, async_save=False)
    ckpt.restore(model, opt)
    ckpt.save(1)
    ckpt.close()
    resume.capture_rng_state = captured
    set_states = []

    def set_rng_state_all(given):  # torch's, on a machine with `devices` devices
        if len(given) > devices:
            raise RuntimeError("CUDA error: invalid device ordinal")
        set_states.append([torch.equal(s, states[i]) for i, s in enumerate(given)])

    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: devices)
    torch.cuda.set_rng_state_all = set_rng_state_all
    fresh = _ddp(5)
    ckpt = Checkpointer(root, async_save=False)
    step, said = _restore(ckpt, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    ckpt.close()
    with warnings.catch_warnings(record=True) as caught:  # the lower-level API alike
        warnings.simplefilter("always")
        resume.restore_rng_state(dict(captured(), cuda=states))
    return step, set_states, [s for s in said if "CUDA" in s], [str(w.message) for w in caught]


def _torch_cuda_kept(rank, world_size, *args):
    """:func:`_cuda_states_worker`, then torch.cuda's functions it replaced put back: the next
    scenario of the launch sees the machine as it is."""
    import fusedist.checkpoint.resume as resume

    names = ("is_available", "device_count", "set_rng_state_all")
    kept, captured = {name: getattr(torch.cuda, name) for name in names}, resume.capture_rng_state
    try:
        return _cuda_states_worker(rank, world_size, *args)
    finally:
        for name, fn in kept.items():
            setattr(torch.cuda, name, fn)
        resume.capture_rng_state = captured


_CUDA_CASES = [(2, 1), (1, 2)]  # (saved devices, devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="simulates CUDA devices on the CPU")
@pytest.mark.parametrize("saved_devices,devices", _CUDA_CASES)
def test_cuda_generator_states_of_another_number_of_devices(launched, saved_devices, devices):
    [(step, set_states, said, low)] = results_of(launched, f"CUDA states of {saved_devices} devices on {devices}")
    both = min(saved_devices, devices)
    assert step == 1 and set_states == [[True] * both] * 2, (step, set_states)
    assert len(said) == 1 and f"holds the CUDA generator states of {saved_devices} device(s), this machine has " \
        f"{devices}" in said[0], said
    assert ("left out" if saved_devices > devices else "devices 1..1 keep their own") in said[0], said
    assert len(low) == (1 if saved_devices > devices else 0), low


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The scenarios at world size 2 in one launch, the CUDA cases at world size 1 in another."""
    root = lambda: str(tmp_path_factory.mktemp("ckpt"))  # noqa: E731
    out = launch_phase(request, {
        "test_a_sharded_model_or_optimizer_of_other_parameters_is_refused_at_once": {
            "other objects": (_other_objects_worker, (root(),))},
        "test_pipelined_parts_of_other_shapes_are_refused_at_once": {"pipelined": (_pipelined_worker, (root(),))},
        "test_ranks_in_different_epochs_are_refused_at_the_save_and_skipped_at_the_restore": {
            "epochs": (_epochs_worker, (root(),))},
    }, 2, timeout=120, env=ENV)
    out.update(launch_phase(request, {"test_cuda_generator_states_of_another_number_of_devices": {
        f"CUDA states of {saved} devices on {devices}": (_torch_cuda_kept, (root(), saved, devices))
        for saved, devices in _CUDA_CASES}}, 1, timeout=120, env=ENV))
    return out
