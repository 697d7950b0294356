"""The identity autograd function a unit with frozen parameters routes its calls' inputs through,
and the token of a call whose inputs' gradients are still to come (Note [frozen parameters in
backward] in state.py): its backward is the last read of the unit's frozen parameters."""

from __future__ import annotations

import torch

from .containers import map_tensors as _map_tensors

__all__ = ["InputsBackward", "OpenCall", "replace_tensors"]


class InputsBackward(torch.autograd.Function):
    """Identity on a unit call's inputs; its backward tells the state that the gradients of
    the inputs are done."""

    @staticmethod
    def forward(ctx, state, call, *tensors):
        ctx.state, ctx.call = state, call
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.state._on_inputs_grad(ctx.call)
        return (None, None, *grads)


class OpenCall:
    """A unit call whose inputs' gradients are still to come; alive while its autograd node is
    (the state holds it weakly)."""

    __slots__ = ("__weakref__",)


def replace_tensors(obj, new: dict):
    """``obj`` with each tensor whose id is in ``new`` replaced by ``new[id]``."""
    return _map_tensors(lambda t: new.get(id(t), t), obj)
