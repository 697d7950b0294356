"""fusedist.checkpoint.load(..., strict=False) against torch's load_state_dict(strict=False)
(Note [a load that is not strict] in fusedist/checkpoint/_load.py).

A checkpoint whose model since gained, lost or renamed a parameter could only be refused:
``load`` had no ``strict`` argument, so a saved backbone could not be loaded under a new head
through fusedist at all. Now ``strict=False`` loads the keys both have and leaves the rest as
they are, exactly as torch does with the saved state dict; the default still refuses, naming
the keys with their shapes and pointing to ``strict=False``; a shared key of another shape, an
optimizer over other parameters, and ranks passing different ``strict`` are refused on every
rank before anything changes.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed


class _Net(nn.Module):
    def __init__(self, head: str = "head", out: int = 3, extra_buffer: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.add_module(head, nn.Linear(8, out))
        self.head_name = head
        if extra_buffer:
            self.register_buffer("temperature", torch.full((1,), 2.0))

    def forward(self, x):
        return getattr(self, self.head_name)(self.body(x))


def _trained(rank):
    import fusedist

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(_Net())
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), fusedist.optim.FusedAdamW, stage=2, lr=1e-2)
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(4, 6) + rank).pow(2).mean().backward()
        opt.step()
    opt.wait_for_params()
    return model, opt


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _outcome(call):
    from fusedist.checkpoint import CheckpointError

    try:
        call()
        return "loaded"
    except CheckpointError as exc:
        return str(exc)


def _job(rank, world_size, root):
    import fusedist
    from fusedist import checkpoint

    model, opt = _trained(rank)
    checkpoint.save(root, model, opt)
    # what the checkpoint holds: rank 0's model (BatchNorm's running statistics are rank-local
    # between DDP's buffer broadcasts)
    shared = [_state(model.module)]
    torch.distributed.broadcast_object_list(shared, src=0)
    saved = shared[0]
    out = {}

    torch.manual_seed(1 + rank)  # a fresh initialization, different on each rank before the wrap
    new = fusedist.DistributedDataParallel(_Net(head="classifier", out=5, extra_buffer=True))
    before = _state(new.module)
    out["strict"] = _outcome(lambda: checkpoint.load(root, new))
    out["strict unchanged"] = all(torch.equal(before[k], v) for k, v in _state(new.module).items())

    # torch's non-strict load of the same saved state into the same fresh model
    reference = copy.deepcopy(new.module)
    result = reference.load_state_dict(saved, strict=False)
    out["torch keys"] = (result.missing_keys, result.unexpected_keys)
    loaded = []
    out["loose"] = _outcome(lambda: loaded.append(checkpoint.load(root, new, strict=False)))
    out["fusedist keys"] = (loaded[0].missing_keys, loaded[0].unexpected_keys, loaded[0].extra) if loaded else None
    out["like torch"] = {k: torch.equal(v, reference.state_dict()[k]) for k, v in _state(new.module).items()}

    new_opt = torch.optim.AdamW(new.parameters(), lr=1e-2)
    out["optimizer"] = _outcome(lambda: checkpoint.load(root, new, new_opt, strict=False))

    wide = fusedist.DistributedDataParallel(_Net(out=4))
    out["shape"] = _outcome(lambda: checkpoint.load(root, wide, strict=False))

    mixed = fusedist.DistributedDataParallel(_Net())
    before = _state(mixed.module)
    out["ranks differ"] = _outcome(lambda: checkpoint.load(root, mixed, strict=rank == 0))
    out["ranks differ unchanged"] = all(torch.equal(before[k], v) for k, v in _state(mixed.module).items())

    # a Checkpointer's resume of a model that gained a buffer since the save
    with checkpoint.Checkpointer(os.path.join(os.path.dirname(root), "periodic"), every_steps=1) as ckpt:
        ckpt.restore(model, opt)
        ckpt.save(1)
    for strict in (True, False):
        grown = fusedist.DistributedDataParallel(_Net(extra_buffer=True))
        grown_opt = fusedist.ZeroRedundancyOptimizer(grown.parameters(), fusedist.optim.FusedAdamW, stage=2, lr=1e-2)
        with checkpoint.Checkpointer(os.path.join(os.path.dirname(root), "periodic"), every_steps=1) as ckpt:
            out[f"restore strict={strict}"] = _outcome(lambda: ckpt.restore(grown, grown_opt, strict=strict))
            out[f"left out strict={strict}"] = None if ckpt.incompatible_keys is None else tuple(ckpt.incompatible_keys)
        out[f"restored strict={strict}"] = all(torch.equal(v, saved[k]) for k, v in _state(grown.module).items()
                                               if k in saved) and bool(grown.module.temperature.eq(2.0).all())
    return out


def test_non_strict_load_is_torchs_and_refusals_name_the_keys(tmp_path):
    results = run_distributed(_job, 2, os.path.join(str(tmp_path), "ckpt"), timeout=120)
    for out in results:
        strict = out["strict"]
        assert "missing keys (in the model, not in the checkpoint) [temperature (1,), classifier.weight (5, 8)" \
            in strict, strict
        assert "unexpected keys (in the checkpoint, not in the model) [head.weight (3, 8)" in strict, strict
        assert "load(..., strict=False) loads the keys both have" in strict, strict
        assert out["strict unchanged"]

        assert out["torch keys"] == (["temperature", "classifier.weight", "classifier.bias"],
                                     ["head.weight", "head.bias"])
        assert out["loose"] == "loaded"
        # the keys it left out, as torch's load_state_dict names them (it returned extra alone)
        assert out["fusedist keys"] == (*out["torch keys"], None), out["fusedist keys"]
        assert all(out["like torch"].values()), out["like torch"]

        assert "the optimizer's parameters do not match" in out["optimizer"], out["optimizer"]
        assert "'head.weight' has shape (3, 8)" in out["shape"] and "(4, 8)" in out["shape"], out["shape"]
        differ = out["ranks differ"]
        assert "strict is True on ranks [0]; False on ranks [1]" in differ, differ
        assert out["ranks differ unchanged"]

        refused = out["restore strict=True"]
        assert "is refused" in refused and "missing keys (in the model, not in the checkpoint) [temperature" \
            in refused, refused
        assert out["restore strict=False"] == "loaded" and out["restored strict=False"]
        assert out["left out strict=False"] == (["temperature"], []) and out["left out strict=True"] is None


@pytest.mark.parametrize("strict", [True, False])
def test_single_process_load_matches_torch(tmp_path, strict):
    """Without a process group: the same model loads either way, bitwise as torch's."""
    from fusedist import checkpoint

    torch.manual_seed(0)
    model = _Net()
    model(torch.randn(4, 6)).sum().backward()
    checkpoint.save(str(tmp_path), model)
    torch.manual_seed(3)
    fresh = _Net()
    checkpoint.load(str(tmp_path), fresh, strict=strict)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("how", ["plain", "pipeline"])
def test_a_load_that_is_not_strict_returns_torchs_keys_and_the_extra(tmp_path, how):
    """``strict=False`` returns torch's ``_IncompatibleKeys`` (a subclass of it, with the
    checkpoint's ``extra`` as ``.extra``): the same keys in the same order as torch's
    ``load_state_dict(strict=False)`` of the saved state dict; the default still returns ``extra``."""
    from torch.nn.modules.module import _IncompatibleKeys

    from fusedist import checkpoint

    torch.manual_seed(0)
    model = _Net()
    model(torch.randn(4, 6)).sum().backward()
    checkpoint.save(str(tmp_path), model, extra={"step": 7})
    torch.manual_seed(3)
    fresh = _Net(head="classifier", out=5, extra_buffer=True)
    reference = copy.deepcopy(fresh)
    expected = reference.load_state_dict(model.state_dict(), strict=False)
    args = ([fresh], None) if how == "pipeline" else (fresh, None)
    result = checkpoint.load(str(tmp_path), *args, strict=False, pipeline=how == "pipeline")
    assert isinstance(result, _IncompatibleKeys) and isinstance(result, checkpoint.LoadResult)
    assert (result.missing_keys, result.unexpected_keys) == (expected.missing_keys, expected.unexpected_keys)
    missing, unexpected = result  # (a named tuple, as torch's)
    assert missing == ["temperature", "classifier.weight", "classifier.bias"] and result.extra == {"step": 7}
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in fresh.state_dict().items())
    same = _Net()
    assert checkpoint.load(str(tmp_path), same) == {"step": 7}  # (strict: extra, as documented)
    everything = checkpoint.load(str(tmp_path), same, strict=False)
    assert tuple(everything) == ([], []) and repr(everything) == repr(same.load_state_dict(model.state_dict()))
