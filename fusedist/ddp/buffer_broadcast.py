"""Broadcasting a DDP model's parameters and buffers from one rank: at construction, at forwards
(torch's ``broadcast_buffers``) and when a join context ends."""

from __future__ import annotations

from collections import OrderedDict

import torch

from .._wrapper import plain_parts


class BufferBroadcast:
    """The wrapper's broadcasts of module state. Expects ``module``, ``config``, ``comm``,
    ``world_size``, ``_buffers_due``, ``_buffer_dicts`` and torch's ``synced_parameters`` /
    ``synced_buffers`` / ``_ignored_keys`` (:class:`~fusedist.ddp.torch_surface.TorchDDPSurface`)."""

    # Note [when buffers are broadcast]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # As torch's DDP (its ``require_forward_param_sync``): a forward broadcasts rank 0's buffers
    # when the forward before it (or none: the first) ran with gradients enabled outside
    # ``no_sync``, whatever this forward's mode. So the evaluation that follows training --
    # ``model.eval()`` and a ``torch.no_grad()`` forward -- runs on every rank with rank 0's
    # BatchNorm statistics, not with the ones each rank's last training batch left behind
    # (which made the ranks evaluate different models), and the forwards of a ``no_sync``
    # accumulation leave each rank's statistics as torch leaves them. Every rank must
    # therefore run such a forward, as with torch: evaluate on one rank through
    # ``model.module``. (Under ``join()`` the join exchange decides instead.)

    @property
    def forward_sync_buffers(self) -> bool:
        """Whether buffers are broadcast from rank 0 at forwards (torch's attribute; settable)."""
        return self.config.broadcast_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        self.config.broadcast_buffers = bool(value)

    broadcast_buffers = forward_sync_buffers  # torch's deprecated name for the same setting

    @property
    def require_forward_param_sync(self) -> bool:
        """torch's flag: whether the next forward broadcasts the buffers (True after a synchronized
        training forward, Note [when buffers are broadcast]); code written for torch's DDP sets it
        (a forward run outside the wrapper's own that should leave the next one unsynchronized)."""
        return self._buffers_due

    @require_forward_param_sync.setter
    def require_forward_param_sync(self, value: bool) -> None:
        self._buffers_due = bool(value)

    def will_sync_module_buffers(self) -> bool:
        """torch's: whether the next forward may broadcast buffers (it does after a
        synchronized training forward, Note [when buffers are broadcast])."""
        return bool(self._buffers_due and self.config.broadcast_buffers and self._module_buffers())

    def _module_buffers(self) -> list:
        """``list(self.module.buffers())`` without walking the module tree each forward (with
        many small modules the walk cost more than the buffers' broadcast): the ``_buffers``
        dicts of the submodules present when the model was wrapped are kept and read, so a
        buffer registered, reassigned or moved (``.to()``) since is seen. A submodule added or
        replaced since (noted by the registration hook, Note [parameters replaced after
        wrapping] in trainable.py) has the dicts found again, so its buffers are broadcast as
        torch's DDP, which walks the module at every broadcast, broadcasts them (one with
        parameters is refused at the next training forward)."""
        if self._buffer_dicts is None:
            self._buffer_dicts = self._find_buffer_dicts()
        unique = {}
        for buffers, ignored in self._buffer_dicts:
            if buffers:
                for key, b in buffers.items():
                    if b is not None and key not in ignored:
                        unique[id(b)] = b
        return list(unique.values())

    def _find_buffer_dicts(self) -> list:
        return [(m._buffers, self._ignored_keys(m)) for m in self.module.modules()]

    def submodules_changed(self) -> None:
        """A submodule was registered into the wrapped module: find its buffers at the next broadcast."""
        self._buffer_dicts = None

    def _broadcast_state(self, src: int = 0, tag: str = "ddp initial state", buffers: bool = True) -> None:
        """Every parameter (and buffer, unless ``buffers`` is False) from rank ``src`` (at
        construction, and when a join context ends: Note [joined ranks] in join.py)."""
        # (a tensor-subclass parameter -- float8 weights, frozen NF4 weights -- through its plain inner tensors)
        tensors = [part for _, p in self.synced_parameters() for part in plain_parts(p.detach())]
        if buffers:
            tensors += [b for _, b in self.synced_buffers()]
        self._broadcast_coalesced(tensors, tag=tag, src=src)

    def _broadcast_coalesced(self, tensors, tag: str, src: int = 0) -> None:
        if self.world_size == 1:
            return
        by_dtype: "OrderedDict[torch.dtype, list]" = OrderedDict()
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype, group in by_dtype.items():
            flat = torch.cat([t.reshape(-1) for t in group]) if len(group) > 1 else group[0].reshape(-1).clone()
            self.comm.broadcast(flat, src=src, tag=f"{tag} {dtype}")
            offset = 0
            with torch.no_grad():
                for t in group:
                    # Through .data: no version bump. A BatchNorm's running statistics are saved
                    # by its forward for backward, so a second training forward before one
                    # backward (its broadcast between them) would fail that backward with
                    # "modified by an inplace operation"; torch DDP's broadcast bumps nothing.
                    t.data.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
