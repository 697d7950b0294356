"""``fully_shard`` under recipes that go off the straight path, against torch's FSDP2 where
FSDP2 runs them: a forward that raises inside a unit, explicit prefetch lists that omit
units or name them out of order, a unit that runs on some ranks only, FSDP2's newer
``fully_shard`` arguments, and activation-checkpoint names in state dicts.

Inputs are fresh random draws: each test picks a new seed (shown in every failure message).
Tolerances: fp32 throughout; both implementations run the same ops on the same values and
reduce with one sum of two terms (commutative, one rounding) and one division by the world
size, so gradients and parameters are compared bit for bit (as in
test_fully_shard_api_parity.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed
from test_fully_shard_api_parity import EXACT, _check_grads, _check_params, _ids, _loss, _mesh, _pair, _seed
from test_fully_shard_gaps import _drop_unsharded_grads


def _adamw(*models) -> list:
    return [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]


def _step(ref, ours, opts, batch, what: str) -> None:
    """One training step of both models on ``batch``, gradients then parameters compared."""
    for model in (ref, ours):
        _loss(model, *batch).backward()
    _check_grads(ref, ours, EXACT, what)
    for opt in opts:
        opt.step()
        opt.zero_grad()
    _check_params(ref, ours, f"{what}, after the step")


def _position(model) -> dict:
    return model._fs_state().ctx.watch.position()


def _aborted_warnings(caught) -> list:
    return [str(w.message) for w in caught if "did not finish" in str(w.message)]


# ------------------------------------------------------------- a forward that raises
class UserError(Exception):
    pass


def _arm_forward(model, armed: dict) -> None:
    """``armed['on']``: blocks[1]'s fc2 raises in its pre-hook -- inside the unit's forward,
    after its parameters were gathered and the next unit's prefetched."""
    def pre(_module, _args):
        if armed.get("on"):
            raise UserError("user code raised in forward")

    model.blocks[1].fc2.register_forward_pre_hook(pre)


def _score(self, ids):
    """A method registered as a forward method that calls the model itself: a root forward
    inside the root's own (not an aborted one)."""
    return self(ids).logsumexp(-1)


def _aborted_forward(rank, ws, seed):
    import fusedist
    from torch.distributed.fsdp import register_fsdp_forward_method

    mesh = _mesh(ws)
    for reset in (False, True):
        what = f"seed {seed}, reset_iter_state {'called' if reset else 'not called'}"
        ref, ours = _pair(mesh, wrap_embed=True)
        for model, register in ((ref, register_fsdp_forward_method), (ours, fusedist.register_fsdp_forward_method)):
            model.score = _score.__get__(model)
            register(model, "score")
        armed: dict = {}
        for model in (ref, ours):
            _arm_forward(model, armed)
        opts = _adamw(ref, ours)
        _step(ref, ours, opts, _ids(seed, rank, 0), what + ", first step")
        # a micro-batch accumulated without sync, then a forward that raises, then the
        # synchronized micro-batch: the accumulation survives the failed forward
        for model in (ref, ours):
            model.set_requires_gradient_sync(False)
            _loss(model, *_ids(seed, rank, 1)).backward()
            model.set_requires_gradient_sync(True)
        armed["on"] = True
        for model in (ref, ours):
            with pytest.raises(UserError):
                _loss(model, *_ids(seed, rank, 2))
            if reset:
                model.reset_iter_state()
        armed["on"] = False
        if reset:  # reset_iter_state drops the accumulation: FSDP2's contract, which torch 2.13's
            _drop_unsharded_grads(ref)  # own reset keeps (test_fully_shard_gaps.py)
            for opt in opts:
                opt.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(ref, ours, opts, _ids(seed, rank, 3), what + ", the step after")
            # a forward method calling forward inside: nested, not aborted (a training forward)
            ids = _ids(seed, rank, 4)[0]
            torch.testing.assert_close(ours.score(ids), ref.score(ids), **EXACT,
                                       msg=lambda m: f"{what}: score: {m}")
            _step(ref, ours, opts, _ids(seed, rank, 5), what + ", the second step after")
        # every training forward that began is counted, the aborted one too (as after
        # reset_iter_state); the ranks agree
        position = _position(ours)
        assert position["fully_shard_forwards"] == 6 and position["fully_shard_backward"] == 4, f"{what}: {position}"
        assert ours.memory_stats()["gathered_bytes"] == 0, f"{what}: {ours.memory_stats()}"
        assert len(_aborted_warnings(caught)) == (0 if reset else 1), f"{what}: {_aborted_warnings(caught)}"
        ours.check_consistency()
    return True


def test_step_after_forward_that_raised_matches_fsdp2():
    """An exception inside a unit's forward (after its gather and the next unit's prefetch),
    between a no-sync micro-batch and the synchronized one: with or without reset_iter_state,
    the following steps give FSDP2's gradients and parameters, the step watch counts every
    forward that began (the next one is not taken for a continuation of the aborted one), no
    unit stays gathered, and a registered forward method that calls forward inside is not
    taken for an aborted forward."""
    seed = _seed()
    assert run_distributed(_aborted_forward, 2, seed) == [True, True], f"seed {seed}"


# ------------------------------------------- checkpoint-wrapper names in state dicts
class NamedBlock(nn.Module):
    """A block with a submodule whose name contains the checkpoint wrapper's attribute name
    (``_checkpoint_wrapped_module``) without being one."""

    def __init__(self, d: int = 6):
        super().__init__()
        self.pre_checkpoint_wrapped_module = nn.Linear(d, 2 * d)
        self.fc = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc(torch.tanh(self.pre_checkpoint_wrapped_module(x)))


class WrappedNet(nn.Module):
    def __init__(self, n: int = 2, d: int = 6):
        super().__init__()
        self.blocks = nn.ModuleList(NamedBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _wrapped_pair(mesh, seed: int, shard_blocks: bool):
    """WrappedNet with every block in torch's checkpoint_wrapper, sharded by FSDP2 (ref) and
    fusedist (ours) from the same values: the wrappers as units of their own, or inside the
    root's unit."""
    import copy

    import fusedist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(seed)
    ref = WrappedNet()
    for i, b in enumerate(ref.blocks):
        ref.blocks[i] = checkpoint_wrapper(b)
    ours = copy.deepcopy(ref)
    for shard, model in ((torch_fully_shard, ref), (fusedist.fully_shard, ours)):
        if shard_blocks:
            for b in model.blocks:
                shard(b, mesh=mesh)
        shard(model, mesh=mesh)
    return ref, ours


def _wrapper_names(rank, ws, seed, where):
    import torch.distributed.checkpoint as dcp

    import fusedist
    from fusedist.fsdp.dcp import ShardedPiece

    mesh = _mesh(ws)
    for shard_blocks in (True, False):
        what = f"seed {seed}, blocks sharded {'alone' if shard_blocks else 'in the root'}"
        ref, ours = _wrapped_pair(mesh, seed, shard_blocks)
        ref_sd, our_sd = ref.state_dict(), ours.state_dict()
        assert list(our_sd) == list(ref_sd), f"{what}: keys {list(our_sd)}, FSDP2 {list(ref_sd)}"
        plain = [k for k, v in our_sd.items() if not isinstance(v, ShardedPiece)]
        assert plain == [], f"{what}: entries left as this rank's plain piece: {plain}"
        # our pieces saved with DCP load into FSDP2's model: whole parameters, rows of every rank
        path = f"{where}/{int(shard_blocks)}"
        dcp.save(our_sd, checkpoint_id=path)
        other, _ = _wrapped_pair(mesh, seed + 1, shard_blocks)
        target = other.state_dict()
        dcp.load(target, checkpoint_id=path)
        other.load_state_dict(target)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(other.state_dict()[k].full_tensor(), v.full_tensor(), **EXACT,
                                       msg=lambda m: f"{what}: {k} through DCP: {m}")
        # and FSDP2's whole parameters load into ours, each rank cutting its piece (with
        # load_state_dict: torch 2.13's set_model_state_dict cannot walk this model, as its
        # _get_fqns drops the wrapper's name by a string replace too)
        _, fresh = _wrapped_pair(mesh, seed + 1, shard_blocks)
        full = {k: v.full_tensor() for k, v in ref.state_dict().items()}
        fresh.load_state_dict(full)
        got = fusedist.fsdp.full_state_dict(fresh)
        for k, v in full.items():
            torch.testing.assert_close(got[k], v, **EXACT, msg=lambda m: f"{what}: {k} loaded whole: {m}")
    return True


def test_state_dict_keys_under_checkpoint_wrapper_match_fsdp2(tmp_path):
    """Blocks in torch's checkpoint_wrapper with a submodule named ``pre_checkpoint_wrapped_module``
    (the wrapper's attribute name inside another name): the state dict has FSDP2's keys, every
    sharded entry is a piece (not one rank's rows passed off as the whole parameter), DCP
    carries our pieces into FSDP2's model, and FSDP2's whole parameters load into ours."""
    seed = _seed()
    assert run_distributed(_wrapper_names, 2, seed, str(tmp_path)) == [True, True], f"seed {seed}"
