"""FSDP2 module methods called from hooks while the model's forward or backward runs, against
torch's FSDP2 on 2 gloo ranks: ``reset_iter_state()`` from a forward pre-hook and from a
gradient hook, and training after it; a unit's ``reshard()`` from inside its own backward; a
method registered with ``register_fsdp_forward_method`` that calls the module itself.

Inputs are fresh random draws: each test picks a new seed (shown in every failure message).
Both implementations run the same fp32 ops and sum the two ranks' gradients once (a + b, one
rounding, commutative) before the same division, so gradients are compared bit for bit.
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch

import models
from fusedist.testing import run_distributed
from fusedist.testing.fsdp_compare import assert_grad_pieces_match

EXACT = dict(rtol=0, atol=0)


def _seed() -> int:
    return random.SystemRandom().randrange(2 ** 31)


def _pair(seed, mesh):
    """The same fresh BlockStack sharded by torch's FSDP2 (ref) and by fusedist (ours)."""
    import fusedist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(seed)
    ref = models.BlockStack(blocks=3)
    ours = copy.deepcopy(ref)
    for shard, model in ((torch_fully_shard, ref), (fusedist.fully_shard, ours)):
        for block in model.blocks:
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
    return ref, ours


def _batch(seed, rank, step):
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(seed * 31 + rank * 7 + step))


def _check_grads(ref, ours, what: str) -> None:
    """This rank's gradient pieces equal the same elements of FSDP2's whole gradients."""
    assert_grad_pieces_match(ref, ours, what, **EXACT)


def _in_head_pre_hook(model, call):
    """Run ``call()`` as the root's head (the forward's last layer) begins."""
    return model.head.register_forward_pre_hook(lambda mod, args: call() and None)


def _from_gradient_hook(module, call):
    """Run ``call()`` from a gradient hook on ``module``'s output, once backward reaches it."""
    def on_output(mod, args, out):
        out.register_hook(lambda grad: call() and None)
    return module.register_forward_hook(on_output)


def _in_backward_hook(model, call):
    """Run ``call()`` in backward as block 1's output gradient arrives: blocks 1 and 0 still to go."""
    return _from_gradient_hook(model.blocks[1], call)


def _reset_during_passes(rank, ws, seed):
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")  # the next forward's note that the last one did not finish
    mesh = init_device_mesh("cpu", (ws,))
    for when, arm in (("forward", _in_head_pre_hook), ("backward", _in_backward_hook)):
        what = f"seed {seed}: reset_iter_state() during the {when}"
        ref, ours = _pair(seed, mesh)
        for model in (ref, ours):
            handle = arm(model, model.reset_iter_state)
            try:
                # FSDP2 fails on its freed or sharded parameters; fusedist computed the forward's
                # head with this rank's rows, silently (a (4, 0) or (4, 3) output, a loss, a backward)
                with pytest.raises(RuntimeError) as caught:
                    model(_batch(seed, rank, 0)).square().sum().backward()
            finally:
                handle.remove()
            if model is ours:
                assert f"reset_iter_state() was called during the model's {when}" in str(caught.value), \
                    f"{what}: {caught.value}"
        # The documented recovery: reset on the root, zero_grad, then train as an FSDP2 model
        # that saw no abort (no step ran: the weights are the same). Not as `ref`: torch 2.13's
        # reset keeps the aborted backward's unsharded root gradients and adds them to the next
        # reduction (Note in FullyShardedModule.reset_iter_state).
        ours.reset_iter_state()
        ours.zero_grad()
        fresh = _pair(seed, mesh)[0]
        for step in (1, 2):
            for model in (fresh, ours):
                model(_batch(seed, rank, step)).square().sum().backward()
            _check_grads(fresh, ours, f"{what}, {step} backwards after it")


def _reshard_during_own_backward(rank, ws, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from fusedist.fsdp.state import state_of

    mesh = init_device_mesh("cpu", (ws,))
    ref, ours = _pair(seed, mesh)
    # inside block 1's backward, its fc1 still to go
    handle = _from_gradient_hook(ref.blocks[1].fc2, ref.blocks[1].reshard)
    with pytest.raises(RuntimeError, match="storage of size 0"):  # FSDP2: the rest reads freed memory
        ref(_batch(seed, rank, 0)).square().sum().backward()
    handle.remove()
    ref.reset_iter_state()
    ref, _ = _pair(seed, mesh)
    handle = _from_gradient_hook(ours.blocks[1].fc2, ours.blocks[1].reshard)
    for step in (0, 1):  # the call waits for the unit's backward to end, as in forward
        what = f"seed {seed}: blocks[1].reshard() in its own backward, step {step}"
        for model in (ref, ours):
            model.zero_grad()
            model(_batch(seed, rank, step)).square().sum().backward()
        _check_grads(ref, ours, what)
        assert not state_of(ours.blocks[1]).unit.is_unsharded, f"{what}: still gathered after backward"
    handle.remove()


def _calls_during_passes(rank, ws, seed):
    _reset_during_passes(rank, ws, seed)
    _reshard_during_own_backward(rank, ws, seed)
    return True


def test_reset_and_reshard_during_forward_or_backward():
    """reset_iter_state() from a hook while the model's forward runs is refused, naming it, as
    FSDP2 fails there (fusedist resharded the running forward's units and computed the rest
    with this rank's pieces, silently); from a gradient hook while backward runs likewise (it
    freed what the rest of the backward reads); after either, reset_iter_state() between
    steps recovers and the steps give FSDP2's gradients. A unit's reshard() from a gradient
    hook inside its own backward waits for that backward's end (as in its own forward): the
    gradients are FSDP2's without the call (FSDP2 fails on the freed memory), and the unit is
    resharded after."""
    seed = _seed()
    assert run_distributed(_calls_during_passes, 2, seed) == [True, True], f"seed {seed}"


# ------------------------------------------------------------- a unit called inside its own call
def _twice(self, h):
    """A block method that runs the block twice (as generation code runs a model per token)."""
    return self(self(h))


def _twice_then_read(self, h):
    """The same, then reads a weight of the block, as generation reads the head's."""
    return self(self(h)) + self.fc1.weight.sum()


def _forward_then_read(self, x):
    return self(x).sum() + self.head.weight.sum()


def _methods_calling_the_module(rank, ws, seed):
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    mesh = init_device_mesh("cpu", (ws,))
    ref, ours = _pair(seed, mesh)
    torch.manual_seed(seed)
    plain = models.BlockStack(blocks=3)  # _pair's weights, unsharded
    for model, register in ((ref, torch_register), (ours, fusedist.register_fsdp_forward_method)):
        for name, fn in (("twice", _twice), ("twice_then_read", _twice_then_read)):
            setattr(type(model.blocks[0]), name, fn)
            register(model.blocks[0], name)
        type(model).forward_then_read = _forward_then_read
        register(model, "forward_then_read")
        model.set_reshard_after_forward(True, recurse=False)  # the root too reshards after forward
        model(_batch(seed, rank, 0)).sum().backward()  # the root runs first
        model.zero_grad()
    h = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + rank))
    for model in (ref, ours):  # where FSDP2 runs it: the same gradients
        model.blocks[0].twice(h).square().sum().backward()
    _check_grads(ref.blocks[0], ours.blocks[0], f"seed {seed}: a block method calling the block twice")
    # Reading a weight after the inner calls: resharded by then in FSDP2, whose block method
    # fails on the DTensor (its root's returns a DTensor); fusedist read this rank's piece of it
    # and returned a wrong value, silently. Same ops on the same weights as the unsharded
    # model: bit for bit.
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        ref.blocks[0].twice_then_read(h)
    x = _batch(seed, rank, 1)
    for what, got, expected in (
            ("block", ours.blocks[0].twice_then_read(h), _twice_then_read(plain.blocks[0], h)),
            ("root", ours.forward_then_read(x), _forward_then_read(plain, x))):
        torch.testing.assert_close(got, expected, **EXACT,
                                   msg=lambda m: f"seed {seed}: {what} method reading a weight after its calls: {m}")
    return True


def test_registered_method_calling_the_module_keeps_it_gathered():
    """A method registered with register_fsdp_forward_method that calls the module itself (a
    block run twice; the root's forward, the root set to reshard after forward) keeps the unit
    gathered until the method returns: the block's gradients are FSDP2's, and a weight read
    after the inner calls is the whole weight (FSDP2 fails there; fusedist read this rank's
    piece and returned a wrong value)."""
    seed = _seed()
    assert run_distributed(_methods_calling_the_module, 2, seed) == [True, True], f"seed {seed}"
