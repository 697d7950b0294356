"""Probe of fusedist.checkpoint (second round): defects found and fixed.

- Ranks whose models have different state-dict keys or shapes (a buffer registered on one
  rank only) saved rank 0's model silently, losing the other ranks' entries; now every rank
  raises before anything is written (Note [one model per save] in ``_checks.py``).
- A module's ``get_extra_state()`` entry: a non-tensor one made every load fail
  (``AttributeError: 'dict' object has no attribute 'shape'``), and a tensor one of a
  ``fully_shard`` model was copied into the tensor ``get_extra_state`` returned and lost;
  torch's ``load_state_dict`` hands both to ``set_extra_state``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fusedist.testing import run_distributed


def _keys_differ_worker(rank, world, root):
    return [_save_with_keys_differing(rank, os.path.join(root, kind), kind, which)
            for kind, which in (("plain", "save"), ("fsdp", "checkpointer"))]


def _save_with_keys_differing(rank, root, kind, which):
    import fusedist
    from fusedist.checkpoint import CheckpointError, Checkpointer

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    if kind == "fsdp":
        fusedist.fully_shard(m[0])
        fusedist.fully_shard(m)
    if rank == 1:  # registered after wrapping, on one rank only
        m[1].register_buffer("extra_buf", torch.ones(3))
    elif kind == "plain":
        m[1].register_buffer("extra_buf", torch.ones(torch.randint(4, 9, ()).item()))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    try:
        if which == "save":
            fusedist.checkpoint.save(os.path.join(root, "plain"), m, opt)
        else:
            ck = Checkpointer(os.path.join(root, "ck"), run_id="keys")
            ck.restore(m, opt)
            try:
                ck.save(1)
            finally:
                ck.close()
        return "saved"
    except CheckpointError as exc:
        return str(exc)


def test_ranks_with_different_model_keys_are_refused_at_save(tmp_path):
    results = run_distributed(_keys_differ_worker, 2, str(tmp_path), timeout=90)
    for kind, out in zip(("plain", "fsdp"), zip(*results)):
        root = str(tmp_path / kind)
        for text in out:
            assert "the ranks' models have different state-dict keys" in text, out
            assert "Nothing was written" in text
        if kind == "plain":  # a shape that differs is named with both shapes
            assert "'1.extra_buf' is (" in out[0] and "on rank 0, (3,) on rank 1" in out[0], out
            assert not os.path.exists(os.path.join(root, "plain", "manifest.json"))
        else:
            assert "rank 1 has ['1.extra_buf'], which rank 0 has not" in out[0], out
            ck = os.path.join(root, "ck")
            assert not os.path.isdir(ck) or not any(n.startswith("step-") for n in os.listdir(ck))


class _Tagged(nn.Linear):
    """A layer with extra state: a dict, or a tensor (``get_extra_state`` returns a copy)."""

    def __init__(self, tensor_tag: bool):
        super().__init__(4, 4)
        self.tag = torch.zeros(2) if tensor_tag else {"v": 0}

    def get_extra_state(self):
        return self.tag.clone() if isinstance(self.tag, torch.Tensor) else dict(self.tag)

    def set_extra_state(self, state):
        self.tag = state


def test_plain_extra_state_loads_like_torch(tmp_path):
    import fusedist

    src = nn.Sequential(_Tagged(False), nn.Linear(4, 2))
    src[0].tag = {"v": int(torch.randint(1, 100, ()))}
    fusedist.checkpoint.save(str(tmp_path), src)
    ours, ref = nn.Sequential(_Tagged(False), nn.Linear(4, 2)), nn.Sequential(_Tagged(False), nn.Linear(4, 2))
    fusedist.checkpoint.load(str(tmp_path), ours)
    ref.load_state_dict(src.state_dict())
    assert ours[0].tag == ref[0].tag == src[0].tag
    for a, b in zip(ours.state_dict().values(), ref.state_dict().values()):
        assert a == b if isinstance(a, dict) else torch.equal(a, b)


def _tagged_sharded(tensor_tag: bool) -> nn.Module:
    import fusedist

    torch.manual_seed(0)
    m = nn.Sequential(_Tagged(tensor_tag), nn.Linear(4, 2))
    fusedist.fully_shard(m[0])
    fusedist.fully_shard(m)
    return m


def _fsdp_extra_state_worker(rank, world, root, tensor_tag, tag):
    import fusedist

    m = _tagged_sharded(tensor_tag)
    m[0].tag = torch.tensor(tag) if tensor_tag else {"v": tag[0]}
    fusedist.checkpoint.save(root, m)
    other = _tagged_sharded(tensor_tag)
    fusedist.checkpoint.load(root, other)
    ref = nn.Sequential(_Tagged(tensor_tag), nn.Linear(4, 2))
    ref.load_state_dict({"0._extra_state": m[0].get_extra_state()}, strict=False)  # torch's load of the entry
    got, want = other[0].tag, ref[0].tag
    return torch.equal(got, want) if tensor_tag else got == want


def test_fully_shard_extra_state_loads_like_torch(tmp_path):
    tag = torch.rand(2).add(1).tolist()
    for tensor_tag in (True, False):
        root = str(tmp_path / str(tensor_tag))
        assert run_distributed(_fsdp_extra_state_worker, 2, root, tensor_tag, tag, timeout=90) == [True, True]


def _full_state_dict_extra_worker(rank, world, tensor_tag, tag):
    import fusedist

    m = _tagged_sharded(tensor_tag)
    m[0].tag = torch.tensor(tag) if tensor_tag else {"v": tag[0]}
    whole = fusedist.fsdp.full_state_dict(m)
    other = _tagged_sharded(tensor_tag)
    fusedist.fsdp.load_full_state_dict(other, whole)
    ref = nn.Sequential(_Tagged(tensor_tag), nn.Linear(4, 2))
    ref.load_state_dict(whole)  # torch's load of the same whole dict
    got, want = other[0].tag, ref[0].tag
    same_weights = all(torch.equal(a, b) for a, b in zip(fusedist.fsdp.full_state_dict(other).values(),
                                                         ref.state_dict().values()) if isinstance(a, torch.Tensor))
    return same_weights and (torch.equal(got, want) if tensor_tag else got == want == {"v": tag[0]})


def test_full_state_dict_functions_carry_extra_state_as_torch():
    """fusedist.fsdp.full_state_dict / load_full_state_dict themselves (not only the checkpoint
    functions): the extra state travels as torch's state_dict / load_state_dict carry it."""
    tag = torch.rand(2).add(1).tolist()
    for tensor_tag in (True, False):
        assert run_distributed(_full_state_dict_extra_worker, 2, tensor_tag, tag, timeout=90) == [True, True]
