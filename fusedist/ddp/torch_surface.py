"""What torch's DDP does around its reducer that scripts rely on: inputs copied to the
``device_ids`` GPU, the legacy ``to_kwargs``/``scatter``/``gather`` helpers, parameters and
buffers marked rank-local, and the private names scripts call (``_register_builtin_comm_hook``).
A mixin of :class:`~fusedist.ddp.wrapper.DistributedDataParallel`, kept apart from the gradient engine it wraps.

Note [inputs moved to the module's device]
    torch's DDP given ``device_ids=[i]`` copies the forward's tensor inputs (in args and
    kwargs, through lists, tuples, dicts and dataclasses) to ``cuda:i`` before the module
    runs, on a side stream unless PYTORCH_DDP_USE_SIDE_STREAM=0; scripts that feed it batches
    straight from a CPU DataLoader rely on that. The same helpers do it here, under the same
    condition: without ``device_ids`` (and on CPU) inputs go through as given.

Note [parameters and buffers DDP ignores]
    torch's ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module,
    names)`` marks parameters and buffers (by their names in ``module``) as rank-local state:
    DDP neither broadcasts nor compares them, and an ignored parameter's gradient is this
    rank's own, never averaged (sharded embedding tables, per-rank statistics, parameters
    another parallelism synchronizes). Code written for torch's DDP calls it before wrapping;
    the wrapper reads the same ``module._ddp_params_and_buffers_to_ignore`` and leaves those
    tensors out of the buckets, the construction broadcast and check, the buffer sync at
    forwards and the trainable-set tracking. The list itself must be the same on every rank.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.utils import _to_kwargs
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

__all__ = ["TorchDDPSurface"]


class TorchDDPSurface:
    """torch DDP's input placement and rank-local state; the wrapper sets ``module``,
    ``device`` and ``dim`` and calls :meth:`_init_surface` before using the rest."""

    def _init_surface(self, module: nn.Module, device_ids) -> None:
        # torch's attributes: device_ids only when given for a single-device accelerator module
        self.device_type = self.device.type
        self.device_ids = [self.device.index] if device_ids and self.device.type != "cpu" else None
        self.output_device = self.device_ids[0] if self.device_ids else None
        self.use_side_stream_for_tensor_copies = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()) or ())

    # ------------------------------------------------------------ Note [inputs moved to the module's device]
    def _inputs_on_device(self, args, kwargs) -> tuple:
        """``(args, kwargs)`` as the module gets them."""
        if not self.device_ids:
            return args, kwargs
        (args,), (kwargs,) = self.to_kwargs(args, kwargs, self.device_ids[0])
        return args, kwargs

    def to_kwargs(self, inputs, kwargs, device_id):
        """``inputs`` and ``kwargs`` with their tensors on ``device_id``, each wrapped in a
        1-tuple (torch's ``DistributedDataParallel.to_kwargs``)."""
        return _to_kwargs(inputs, kwargs, torch.device(self.device_type, device_id),
                          self.use_side_stream_for_tensor_copies)

    def scatter(self, inputs, kwargs, device_ids):
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs, output_device):
        return gather(outputs, output_device, dim=self.dim)

    # ------------------------------------------------------------ torch's private names
    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch's name for ``register_builtin_comm_hook`` (torch's DDP has only this private one,
        and its docs show ``ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)``)."""
        self.register_builtin_comm_hook(comm_hook_type)

    # ------------------------------------------------------------ Note [parameters and buffers DDP ignores]
    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore) -> None:
        """torch's: mark ``params_and_buffers_to_ignore`` (names in ``module``) as not
        synchronized by DDP; call before wrapping."""
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, params_and_buffers_to_ignore)

    def synced_parameters(self) -> list:
        """``(name, parameter)`` of the module's parameters DDP synchronizes."""
        return [(n, p) for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]

    def synced_buffers(self) -> list:
        """``(name, buffer)`` of the module's buffers DDP synchronizes."""
        return [(n, b) for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    def ignored_parameters(self) -> list:
        """``(name, parameter)`` of the rank-local parameters."""
        if not self.parameters_to_ignore:
            return []
        return [(n, p) for n, p in self.module.named_parameters() if n in self.parameters_to_ignore]

    def _ignored_keys(self, prefix: str) -> frozenset:
        """The attribute names under the submodule at ``prefix`` that DDP ignores."""
        if not self.parameters_to_ignore:
            return frozenset()
        head = f"{prefix}." if prefix else ""
        return frozenset(n[len(head):] for n in self.parameters_to_ignore
                         if n.startswith(head) and "." not in n[len(head):])
