"""FSDP2 module methods called at awkward moments, against torch's FSDP2 on 2 gloo ranks:
``reshard()`` during the module's own forward (from a hook), prefetch lists holding things
that are not sharded modules, and numpy bools given to the bool switches.

Inputs are fresh random draws: each test picks a new seed (shown in every failure message).
Both implementations run the same fp32 ops and sum the two ranks' gradients once, so outputs
and gradients are compared bit for bit.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

import models
from fusedist.testing import run_distributed
from fusedist.testing.fsdp_compare import assert_grad_pieces_match

EXACT = dict(rtol=0, atol=0)


def _seed() -> int:
    return random.SystemRandom().randrange(2 ** 31)


def _mesh(ws):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ws,))


def _pair(seed, mesh, groups=None, **kw):
    """The same fresh BlockStack sharded by torch's FSDP2 (ref) and by fusedist (ours): each
    block, then the root; ``groups`` (a function of the model) adds list units first."""
    import fusedist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(seed)
    ref = models.BlockStack()
    ours = copy.deepcopy(ref)
    for shard, model in ((torch_fully_shard, ref), (fusedist.fully_shard, ours)):
        if groups is not None:
            shard(groups(model), mesh=mesh)
        for block in model.blocks:
            shard(block, mesh=mesh, **kw)
        shard(model, mesh=mesh)
    return ref, ours


def _check_step(ref, ours, x, what: str) -> None:
    """One forward and backward of each: the same output, and this rank's gradient pieces
    equal the same elements of FSDP2's whole gradients."""
    y_ref, y_ours = ref(x), ours(x)
    torch.testing.assert_close(y_ours, y_ref, **EXACT, msg=lambda m: f"{what}: output: {m}")
    y_ref.square().sum().backward()
    y_ours.square().sum().backward()
    assert_grad_pieces_match(ref, ours, what, **EXACT)


def _reshard_in_forward(rank, ws, seed):
    mesh = _mesh(ws)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed + rank))

    # the root, kept gathered after forward by default, resharded from a block's pre-hook while its
    # forward still needs the head: FSDP2 leaves it gathered
    ref, ours = _pair(seed, mesh)
    for model in (ref, ours):
        model.blocks[1].register_forward_pre_hook(lambda mod, args, model=model: model.reshard())
    _check_step(ref, ours, x, f"seed {seed}: root.reshard() in its forward")

    # a block with reshard_after_forward=False resharded from inside its own forward
    ref, ours = _pair(seed, mesh, reshard_after_forward=False)
    for model in (ref, ours):
        block = model.blocks[0]
        block.fc2.register_forward_pre_hook(lambda mod, args, block=block: block.reshard())
    _check_step(ref, ours, x, f"seed {seed}: block.reshard() in its forward")

    # a list unit [inp, head]: its first member resharded before the last one runs. FSDP2 reshards
    # and its head then fails on the DTensors; fusedist's head computed with this rank's pieces
    # (an empty output on one rank). It waits for the call's end: the hook-free FSDP2 result.
    ref, ours = _pair(seed, mesh, groups=lambda m: [m.inp, m.head])
    ours.head.register_forward_pre_hook(lambda mod, args: ours.inp.reshard())
    _check_step(ref, ours, x, f"seed {seed}: list unit resharded mid-call")

    # a forward an exception ended is over: reshard() frees the block it left gathered, as FSDP2's
    from fusedist.fsdp.state import state_of

    _, ours = _pair(seed, mesh)
    block = ours.blocks[1]
    hook = block.register_forward_pre_hook(lambda mod, args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ours(x)
    hook.remove()
    block.reshard()
    assert not state_of(block).unit.is_unsharded, f"seed {seed}: reshard() after an aborted forward kept the block"


def test_reshard_during_forward_matches_fsdp2():
    """``reshard()`` called during the module's own forward leaves the parameters that forward
    still reads, as FSDP2's does for a unit kept gathered after forward; the unit still
    reshards at the forward's end, and outputs and gradients match FSDP2's bit for bit."""
    seed = _seed()
    run_distributed(_reshard_in_forward, 2, seed)


def _argument_checks(rank, ws, seed):
    import numpy as np

    mesh = _mesh(ws)
    _, ours = _pair(seed, mesh)
    for bad in (["block"], [None], [3], "ab"):
        for setter in (ours.set_modules_to_forward_prefetch, ours.set_modules_to_backward_prefetch):
            with pytest.raises(ValueError, match="expected modules sharded with fusedist.fully_shard"):
                setter(bad)
    with pytest.raises(ValueError, match="got Linear"):
        ours.set_modules_to_forward_prefetch([ours.head])

    # numpy bools (``i == n - 1`` over a numpy range), taken by torch's setters, are bools here too
    ref, ours = _pair(seed, mesh)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed + rank))
    for model in (ref, ours):
        model.set_is_last_backward(np.bool_(False))
        model.set_requires_all_reduce(np.bool_(True))
        model.blocks[0].set_unshard_in_backward(np.bool_(True))
    _check_step(ref, ours, x, f"seed {seed}: numpy bool settings")
    from fusedist.fsdp.state import state_of

    assert type(state_of(ours).requires_all_reduce) is bool
    with pytest.raises(TypeError, match="must be a bool, got numpy.int64"):
        ours.set_is_last_backward(np.int64(1))


def test_setter_arguments_match_fsdp2():
    """Prefetch lists with a string, None or a number are a ``ValueError`` naming it, as FSDP2's
    (they failed on a weak reference); numpy bools are accepted by the bool switches, as
    torch's accept them (they were refused as "must be a bool, got bool")."""
    seed = _seed()
    run_distributed(_argument_checks, 2, seed)
