"""Putting fusedist's ``fully_shard`` models next to torch's FSDP2 ones in tests: the whole state
of either, and the losses of a few plain training steps."""

from __future__ import annotations

__all__ = ["assert_grad_pieces_match", "full_state", "settled", "square_loss_steps", "unsettled"]


def full_state(model, ours: bool) -> dict:
    """``model``'s state dict with every parameter whole: ``fusedist.fsdp.full_state_dict`` for a
    fusedist model (``ours``), torch's FSDP2 state gathered entry by entry for an FSDP2 one.

    torch's ``get_model_state_dict(full_state_dict=True)`` waits only a gathered result that is an
    ``AsyncCollectiveTensor`` itself: a tensor-subclass weight whose subclass gathers its inner
    tensors (torchao's NF4) comes back holding those gathers unwaited, several gloo all-gathers in
    flight while torch starts the next entry's, a window in which gloo's worker thread has been
    seen to corrupt the heap (about once in 500 runs). Here the names are torch's own (its sharded
    ``get_model_state_dict``, which gathers nothing) and each entry is gathered, and every subclass
    weight settled, before the next starts."""
    if ours:
        from ..fsdp import full_state_dict

        return full_state_dict(model)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {name: _whole(value) for name, value in get_model_state_dict(model).items()}


def _whole(value):
    """One entry of a sharded state dict, gathered on its mesh and waited, inner tensors included."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, DTensor):
        if value.device.type != value.device_mesh.device_type:  # (host-offloaded pieces: as torch's gather)
            value = value.to(value.device_mesh.device_type)
        value = value.redistribute(value.device_mesh, [Replicate()] * len(value.placements)).to_local()
    return settled(value)


def settled(value):
    """``value`` with every pending collective under it waited: an ``AsyncCollectiveTensor`` is
    waited, a wrapper subclass is rebuilt from its settled inner tensors (recursively)."""
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(value, AsyncCollectiveTensor):
        return settled(value.wait())
    if not isinstance(value, torch.Tensor) or not hasattr(value, "__tensor_flatten__"):
        return value
    names, ctx = value.__tensor_flatten__()
    inner = {n: getattr(value, n) for n in names}
    waited = {n: settled(t) for n, t in inner.items()}
    if all(waited[n] is inner[n] for n in names):
        return value
    return type(value).__tensor_unflatten__(waited, ctx, value.size(), value.stride())


def unsettled(state: dict) -> list:
    """The names of ``state``'s entries that still hold an unwaited collective, at any depth of a
    tensor subclass: what a comparison must not hand back (see ``full_state``)."""
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def pending(t) -> bool:
        if isinstance(t, AsyncCollectiveTensor):
            return True
        if not isinstance(t, torch.Tensor) or not hasattr(t, "__tensor_flatten__"):
            return False
        return any(pending(getattr(t, n)) for n in t.__tensor_flatten__()[0])

    return [name for name, value in state.items() if pending(value)]


def square_loss_steps(model, optimizer, batches) -> list:
    """One step per input of ``batches`` (loss: the output's mean square), the losses."""
    out = []
    for x in batches:
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out


def assert_grad_pieces_match(ref, ours, what: str, **tolerances) -> None:
    """This rank's gradient pieces of ``ours`` (a fusedist ``fully_shard`` module) equal the same
    elements of FSDP2's whole gradients of ``ref`` (a collective: every rank calls it alike)."""
    import torch

    from ..fsdp.owners import owner_of

    whole = {n: p.grad.full_tensor() for n, p in ref.named_parameters()}
    for name, p in ours.named_parameters():
        assert p.grad is not None, f"{what}: {name}: no gradient"
        unit, i = owner_of(p)
        a, b = unit.element_range(i)
        expected = whole[name].reshape(-1)[a:b].view(p.shape)
        torch.testing.assert_close(p.grad, expected, **tolerances, msg=lambda m: f"{what}: {name}: {m}")
