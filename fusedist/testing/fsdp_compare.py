"""Putting fusedist's ``fully_shard`` models next to torch's FSDP2 ones in tests: the whole state
of either, and the losses of a few plain training steps."""

from __future__ import annotations

__all__ = ["full_state", "square_loss_steps"]


def full_state(model, ours: bool) -> dict:
    """``model``'s state dict with every parameter whole: ``fusedist.fsdp.full_state_dict`` for a
    fusedist model (``ours``), torch's full ``get_model_state_dict`` for an FSDP2 one."""
    if ours:
        from ..fsdp import full_state_dict

        return full_state_dict(model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


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
