"""Checkpointer.restore against the documented behaviour, 2 gloo ranks, DDP + torch's AdamW:

* a ResumableDistributedSampler restored at another world size takes the saved epoch from the
  manifest, not from the saving world's rank-0 file (a ZeRO shard with it): a corrupt old
  rank-0 file, which the load at another world size does not need, no longer fails the
  restore; a checkpoint written before the manifest held the epoch still gives it
  (Note [a per-rank position at another world size] in fusedist/checkpoint/_restore.py);
* a model of another architecture is refused at once, naming the key and both shapes, with
  nothing loaded and no older checkpoint tried, and so are a GradScaler the checkpoint holds no
  state for, an optimizer of another algorithm and one over other parameters; a corrupt
  checkpoint still falls back to the previous one (Note [a model that does not match]);
* a checkpoint holding CUDA generator states restores where CUDA is not available: the model
  and the other generators are restored, the CUDA states left out with a warning (Note [CUDA
  generator states without CUDA]); ``resume.restore_rng_state`` refuses them before setting
  any generator.
"""

from __future__ import annotations

import json
import os
import random
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler

from phased_launches import launch_phase, on_rank_0
from shared_rank_launch import results_of

ENV = {"FUSEDIST_TIMEOUT_S": "30"}


def _model_and_opt(seed: int, width: int = 8):
    import fusedist

    torch.manual_seed(seed)
    model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    opt.zero_grad()
    nn.functional.mse_loss(model(torch.randn(5, 6, generator=g)), torch.randn(5, 3, generator=g)).backward()
    opt.step()


def _params(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _manifest(step_dir: str) -> dict:
    with open(os.path.join(step_dir, "manifest.json")) as f:
        return json.load(f)


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Every test's saves, changes to their files and restores at world size 2 in one launch, then
    the restores at world size 1 in another."""
    epoch4, epoch2, three, cuda = (str(tmp_path_factory.mktemp(name) / "ckpt")
                                   for name in ("epoch4", "epoch2", "three", "cuda"))
    out = launch_phase(request, {
        "test_the_epoch_at_another_world_size_comes_from_the_manifest": {
            "save at epoch 4": (_save_mid_epoch, (epoch4, 4)),
            "corrupt rank 0's file": (on_rank_0, (_corrupt_rank_0_file, epoch4))},
        "test_an_older_checkpoint_without_the_epoch_in_its_manifest_still_gives_it": {
            "save at epoch 2": (_save_mid_epoch, (epoch2, 2)),
            "drop the epoch from the manifest": (on_rank_0, (_drop_the_epoch, epoch2))},
        "test_a_model_of_another_architecture_is_refused_at_once": {
            "save three": (_save_three, (three,)),
            "restore other models": (_restore_other_models, (three,)),
            "corrupt the newest common file": (on_rank_0, (_corrupt_the_newest_common_file, three)),
            "restore over a corrupt newest": (_restore_over_a_corrupt_newest, (three,))},
        "test_cuda_generator_states_are_left_out_where_cuda_is_missing": {
            "save with CUDA generator states": (_save_with_cuda_generators, (cuda,)),
            "restore without CUDA": (_restore_without_cuda, (cuda,))},
    }, 2, timeout=120, env=ENV)
    out.update(launch_phase(request, {
        "test_the_epoch_at_another_world_size_comes_from_the_manifest": {
            "restore at world size 1 over a corrupt rank-0 file": (_restore_elsewhere, (epoch4,))},
        "test_an_older_checkpoint_without_the_epoch_in_its_manifest_still_gives_it": {
            "restore at world size 1 without the epoch": (_restore_elsewhere, (epoch2,))},
    }, 1, timeout=120, env=ENV))
    return out


def _save_mid_epoch(rank, world_size, root, epoch):
    from fusedist.checkpoint import Checkpointer
    from fusedist.checkpoint.resume import ResumableDistributedSampler

    model, opt = _model_and_opt(0)
    sampler = ResumableDistributedSampler(list(range(30)), num_replicas=world_size, rank=rank, seed=11)
    sampler.set_epoch(epoch)
    next(iter(sampler))
    sampler.advance(3)
    ck = Checkpointer(root, every_steps=1, async_save=False)
    ck.restore(model, opt, sampler=sampler)
    _train(model, opt, rank, 0)
    ck.save(1)
    ck.close()
    return _params(model)


def _restore_elsewhere(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer
    from fusedist.checkpoint.resume import ResumableDistributedSampler

    model, opt = _model_and_opt(5)
    sampler = ResumableDistributedSampler(list(range(30)), num_replicas=world_size, rank=rank, seed=11)
    ck = Checkpointer(root, every_steps=1, async_save=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the data position stays behind: warned, tested elsewhere)
        step = ck.restore(model, opt, sampler=sampler)
    ck.close()
    return step, list(sampler), _params(model)


def _corrupt_rank_0_file(root):
    """The old rank 0's file holds only its per-rank state, which a restore at world size 1 does not use."""
    path = _step_dir(root, 1)
    rank0 = os.path.join(path, _manifest(path)["files"]["rank-00000.pt"].get("file", "rank-00000.pt"))
    with open(rank0, "r+b") as f:
        f.seek(os.path.getsize(rank0) // 2)
        f.write(b"\x00corrupt\x00")


def _drop_the_epoch(root):
    """The manifest as written before it held the epoch; the epoch it held."""
    path = _step_dir(root, 1)
    manifest = _manifest(path)
    epoch = manifest["checkpointer"].pop("epoch", None)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return epoch


def test_the_epoch_at_another_world_size_comes_from_the_manifest(launched):
    saved = results_of(launched, "save at epoch 4")[0]
    results_of(launched, "corrupt rank 0's file")
    torch_sampler = DistributedSampler(list(range(30)), num_replicas=1, rank=0, seed=11)
    torch_sampler.set_epoch(4)
    [(step, order, params)] = results_of(launched, "restore at world size 1 over a corrupt rank-0 file")
    assert step == 1 and order == list(torch_sampler) and _same(params, saved), (step, order)


def test_an_older_checkpoint_without_the_epoch_in_its_manifest_still_gives_it(launched):
    results_of(launched, "save at epoch 2")
    epoch = results_of(launched, "drop the epoch from the manifest")[0]
    assert epoch == 2, epoch  # (the manifest held it)
    torch_sampler = DistributedSampler(list(range(30)), num_replicas=1, rank=0, seed=11)
    torch_sampler.set_epoch(2)
    [(step, order, _)] = results_of(launched, "restore at world size 1 without the epoch")
    assert step == 1 and order == list(torch_sampler), order


def _save_three(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer

    model, opt = _model_and_opt(0)
    ck = Checkpointer(root, every_steps=1, keep=None, async_save=False)
    ck.restore(model, opt)
    out = []
    for step in (1, 2, 3):
        _train(model, opt, rank, step)
        ck.save(step)
        out.append(_params(model))
    ck.close()
    return out


def _restore_other_models(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer, CheckpointError

    out = []
    for width, strict in ((9, True), (9, False)):  # a widened layer: strict=False refuses a shape too
        model, opt = _model_and_opt(1, width)
        before = _params(model)
        ck = Checkpointer(root, every_steps=1, keep=None, async_save=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(CheckpointError) as info:
                ck.restore(model, opt, strict=strict)
        ck.close()
        out.append((str(info.value), [str(w.message) for w in caught], _same(before, _params(model))))
    torch.manual_seed(1)  # a renamed layer: its keys are missing and unexpected
    import fusedist
    model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Identity(),
                                                           nn.Linear(8, 3)))
    ck = Checkpointer(root, every_steps=1, keep=None, async_save=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError) as info:
            ck.restore(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ck.close()
    out.append((str(info.value), [str(w.message) for w in caught], True))
    # Other objects than the saved ones: the same for every checkpoint of the job, refused at once too.
    for kind in ("scaler", "sgd", "fewer parameters"):
        model, opt = _model_and_opt(1)
        before = _params(model)
        scaler = torch.amp.GradScaler("cpu") if kind == "scaler" else None
        if kind == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        elif kind == "fewer parameters":
            opt = torch.optim.AdamW(list(model.parameters())[:2], lr=0.1)
        ck = Checkpointer(root, every_steps=1, keep=None, async_save=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(CheckpointError) as info:
                ck.restore(model, opt, scaler)
        ck.close()
        out.append((str(info.value), [str(w.message) for w in caught], _same(before, _params(model))))
    return out


def _restore_over_a_corrupt_newest(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer

    model, opt = _model_and_opt(1)
    ck = Checkpointer(root, every_steps=1, keep=None, async_save=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = ck.restore(model, opt)
    ck.close()
    return step, _params(model), [str(w.message) for w in caught if "trying the previous one" in str(w.message)]


def _corrupt_the_newest_common_file(root):
    path = _step_dir(root, 3)
    common = os.path.join(path, _manifest(path)["files"]["common.pt"].get("file", "common.pt"))
    with open(common, "r+b") as f:
        f.seek(os.path.getsize(common) - 40)
        f.write(b"\xff" * 8)


def test_a_model_of_another_architecture_is_refused_at_once(launched):
    saved = results_of(launched, "save three")[0]
    for rank_out in results_of(launched, "restore other models"):
        for error, said, unchanged in rank_out[:2]:
            assert "'0.weight' has shape (8, 6)" in error and "the model's is (9, 6)" in error, error
            assert "step-00000003" in error and "step-00000002" not in error, error
            assert "Nothing was loaded" in error and unchanged, error
            assert not [w for w in said if "trying the previous one" in w], said
        error, said, _ = rank_out[2]
        assert "missing keys" in error and "3.weight" in error and "step-00000002" not in error, error
        assert not [w for w in said if "trying the previous one" in w], said
        for (error, said, unchanged), expected in zip(rank_out[3:], ("holds no GradScaler state", "runs SGD",
                                                                     "4 parameters saved, 2 here")):
            assert expected in error and "step-00000003" in error and "step-00000002" not in error, error
            assert unchanged and not [w for w in said if "trying the previous one" in w], said
    # A corrupt file is not the user's: the previous checkpoint is restored, as documented.
    results_of(launched, "corrupt the newest common file")
    restored = results_of(launched, "restore over a corrupt newest")
    for step, params, _ in restored:
        assert step == 2 and _same(params, saved[1]), step
    said = restored[0][2]  # (rank 0 warns)
    assert len(said) == 1 and "step 3" in said[0], said


def _save_with_cuda_generators(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer, resume

    captured = resume.capture_rng_state

    def as_on_a_gpu():  # what a GPU job saves: every device's CUDA generator state beside the others
        state = captured()
        state["cuda"] = [torch.get_rng_state(), torch.get_rng_state()]
        return state

    resume.capture_rng_state = as_on_a_gpu
    try:
        model, opt = _model_and_opt(0)
        ck = Checkpointer(root, every_steps=1, async_save=False)
        ck.restore(model, opt)
        _train(model, opt, rank, 0)
        torch.manual_seed(40 + rank)
        random.seed(50 + rank)
        ck.save(1)
        ck.close()
    finally:
        resume.capture_rng_state = captured  # (the next scenarios of the launch save as without a GPU)
    return _params(model), torch.rand(4), random.random()


def _restore_without_cuda(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer, resume

    model, opt = _model_and_opt(3)
    ck = Checkpointer(root, every_steps=1, async_save=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = ck.restore(model, opt)
    draws = torch.rand(4), random.random()
    ck.close()
    # The lower-level resume API refuses them before any generator is set.
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    state = dict(resume.capture_rng_state(), cuda=[torch.get_rng_state()])
    torch.manual_seed(1234)
    state["torch"] = torch.get_rng_state()
    torch.manual_seed(7)
    with pytest.raises(RuntimeError, match="no generator was set"):
        resume.restore_rng_state(state)
    kept = torch.equal(torch.rand(3), expected)
    return step, _params(model), draws, [str(w.message) for w in caught if "CUDA" in str(w.message)], kept


@pytest.mark.skipif(torch.cuda.is_available(), reason="restores CUDA generator states where CUDA is missing")
def test_cuda_generator_states_are_left_out_where_cuda_is_missing(launched):
    saved = results_of(launched, "save with CUDA generator states")
    restored = results_of(launched, "restore without CUDA")
    for rank, ((params, rand, py), (step, got, (rand2, py2), said, kept)) in enumerate(zip(saved, restored)):
        assert step == 1 and _same(params, got), rank
        assert torch.equal(rand, rand2) and py == py2, rank  # the CPU and Python generators continue
        assert (len(said) == 1 and "not restored" in said[0]) if rank == 0 else said == [], said
        assert kept, rank


@pytest.mark.skipif(torch.cuda.is_available(), reason="restores CUDA generator states where CUDA is missing")
def test_resume_restore_refuses_cuda_states_before_changing_the_sampler():
    from fusedist.checkpoint.resume import ResumableDistributedSampler, restore, resume_state

    saved = ResumableDistributedSampler(list(range(20)), num_replicas=2, rank=1, seed=3)
    saved.set_epoch(5)
    next(iter(saved))
    saved.advance(4)
    state = resume_state(saved)
    state["rng"]["cuda"] = [torch.get_rng_state()]
    sampler = ResumableDistributedSampler(list(range(20)), num_replicas=2, rank=1, seed=3)
    torch.manual_seed(9)
    with pytest.raises(RuntimeError, match="no generator was set"):
        restore(state, sampler)
    torch_sampler = DistributedSampler(list(range(20)), num_replicas=2, rank=1, seed=3)
    assert list(sampler) == list(torch_sampler) and sampler.epoch == 0  # untouched: epoch 0 from its start
    torch.manual_seed(9)
    expected = torch.rand(3)
    torch.manual_seed(9)
    with pytest.raises(RuntimeError):
        restore(state, sampler)
    assert torch.equal(torch.rand(3), expected)
