"""One sharded unit: the parameters of one ``fully_shard`` call in one flat buffer.

The unit owns three things and nothing else: the rank's shard of the flat buffer (with the
sharded parameters the optimizer steps, Note [sharded parameters]), the unsharded buffer
(with the full parameters forward and backward use), and the swap between the two on the
modules that hold them. When to gather and reshard is the module state's decision
(``state.py``); the gradient side is ``grads.py``.

Note [sharded parameters]
    At rest every parameter of a unit is replaced on its module by an ``nn.Parameter`` that
    *is* this rank's piece of it: a tensor on the storage of the unit's flat shard (not a
    view: a leaf of its own), shaped ``(rows, *shape[1:])`` (Note [row-aligned flat
    layout]). Why plain tensors, not DTensors as torch's FSDP2: any optimizer -- torch's,
    fusedist's fused and C++ CPU ones, ``master_weights``, LR schedulers -- steps them with
    no per-op dispatch, and its in-place update lands directly in the buffer the next
    all-gather sends. The cost is that a piece does not know it is a piece:
    ``torch.nn.utils.clip_grad_norm_`` over pieces measures this rank's share only, so the
    global norm comes from ``fusedist.clip_grad_norm_`` (through the gradient holder,
    ``holder.py``), and ``p.shape`` at rest is the piece's (README, known differences).

    While a unit is unsharded its modules hold the *unsharded* parameters instead: one
    persistent ``nn.Parameter`` per parameter on the storage of the unit's gathered buffer.
    Persistent, so autograd's saved references and the gradient hooks stay valid across
    reshard/unshard; on a storage of their own version counter, so the all-gather writing
    the buffer is not an in-place change of a saved tensor. Resharding resizes that storage
    to zero bytes; unsharding resizes it back and gathers into it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .layout import SplitLayout, alias
from .memory import COUNTERS
from . import stale
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy


class ShardedUnit:
    """The flat buffers and parameter swap of one ``fully_shard`` call (Note [sharded
    parameters]). ``params[i]`` is held by the modules ``registrations[i]`` as ``(module,
    attribute)`` pairs (several for a parameter shared inside the unit)."""

    def __init__(self, name: str, params: list, registrations: list, fqns: list, comm, device: torch.device,
                 mp_policy: MixedPrecisionPolicy, offload_policy, reshard_after_forward: bool):
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            desc = ", ".join(f"{n}: {p.dtype}" for n, p in zip(fqns, params))
            raise TypeError(f"fusedist.fully_shard({name or 'root'}): the parameters of one unit share one flat "
                            f"buffer and must have one dtype; got {desc}. Shard the differing modules separately.")
        self.name, self.fqns, self.registrations = name, fqns, registrations
        self.comm, self.device = comm, device
        self.rank, self.world_size = comm.rank, comm.world_size
        self.dtype = params[0].dtype
        self.param_dtype = mp_policy.param_dtype if mp_policy.param_dtype is not None and self.dtype.is_floating_point else self.dtype
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.shard_device = torch.device("cpu") if self.offload else device
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        # Note [trainable section]: trainable and frozen parameters in sections of their own
        self.layout = SplitLayout([tuple(p.shape) for p in params], [p.requires_grad for p in params],
                                  self.world_size)
        self._build(params, offload_policy)
        #: owner units of parameters shared with another unit: (owner, owner index, registrations)
        self.borrowed: list[tuple["ShardedUnit", int, list]] = []
        self.is_unsharded = False
        self.gathered_once = False  # FSDP2's condition for reducing an unused unit (grads.py)
        self._gather = None  # (handles, input kept alive) of the all-gathers in flight
        self.holder = None  # the gradient holder (holder.py), kept alive by the units using it
        self._gathered_bytes = 0
        #: called with the parameter index when an unsharded parameter's gradient is accumulated
        self.on_grad: Optional[Callable[[int], None]] = None
        #: whether the unit's forward or backward is running (set by its module's state)
        self.busy: Callable[[], bool] = lambda: False
        stale.install()  # Note [gathered copies and the optimizer step]
        from .optim_state import note_unit

        note_unit(self)  # Note [optimizer state of pieces] in optim_state.py
        for i, u in enumerate(self.unsharded):
            # (hooks register only on tensors requiring grad; a frozen one may be unfrozen later)
            frozen = not u.requires_grad
            u.requires_grad_(True)
            u.register_post_accumulate_grad_hook(lambda _p, i=i: self.on_grad(i) if self.on_grad else None)
            u.requires_grad_(not frozen)

    @torch.no_grad()
    def _build(self, params: list, offload_policy) -> None:
        layout, rank = self.layout, self.rank
        pin = self.offload and offload_policy.pin_memory and self.device.type != "cpu"
        self.shard = torch.zeros(layout.shard_numel, dtype=self.dtype, device=self.shard_device, pin_memory=pin)
        self.sharded: list[nn.Parameter] = []
        for i, p in enumerate(params):
            piece = layout.piece(i, rank)
            if piece.numel:
                start = layout.element_range(i, rank)[0]
                self.shard[piece.shard_offset:piece.shard_offset + piece.numel].copy_(
                    p.detach().reshape(-1)[start:start + piece.numel])
            sp = nn.Parameter(alias(self.shard, piece.shard_offset, piece.shape), requires_grad=p.requires_grad)
            self.sharded.append(sp)
        # The gathered buffer: built allocated (parameters are made on a live storage), then freed.
        self.full = torch.empty(layout.total_numel, dtype=self.param_dtype, device=self.device)
        self.unsharded = [nn.Parameter(alias(self.full, s.offset, s.shape), requires_grad=p.requires_grad)
                          for s, p in zip(layout.slots, params)]
        self._full_nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ unshard / reshard
    def unshard(self, async_op: bool = True) -> None:
        """Start the all-gather of the shard into the unsharded buffer (and of the units
        owning parameters this one borrows); without ``async_op``, wait for it."""
        for owner, _, _ in self.borrowed:
            owner.unshard(async_op=True)
        if not self.is_unsharded and self._gather is None:
            storage = self.full.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(self._full_nbytes)
                COUNTERS.add_gathered(self._full_nbytes)
                self._gathered_bytes = self._full_nbytes
            src = self.shard
            if src.device != self.device:
                src = src.to(self.device, non_blocking=True)
            if src.dtype != self.param_dtype:
                src = src.to(self.param_dtype)
            handles = self.gather_into(self.full, src, f"fully_shard gather {self.name or 'root'}")
            self._gather = (handles, src)
            stale.note_gathered(self)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Block until the gathers have landed; the modules then hold the unsharded parameters."""
        if not self.is_unsharded:
            if self._gather is None:
                self.unshard(async_op=True)
            handles, _src = self._gather
            for handle in handles:
                handle.wait()
            self._gather = None
            for i, u in enumerate(self.unsharded):
                u.requires_grad_(self.sharded[i].requires_grad)  # a freeze after wrapping is seen here
                self._register(i, u)
            self.is_unsharded = self.gathered_once = True
        for owner, index, regs in self.borrowed:
            owner.wait_for_unshard()
            for module, attr in regs:
                module._parameters[attr] = owner.unsharded[index]

    def reshard(self) -> None:
        """Free the unsharded buffer; the modules hold the sharded parameters again. A gather
        still in flight is waited for first (its buffer cannot be freed under it)."""
        if self._gather is not None:
            for handle in self._gather[0]:
                handle.wait()
            self._gather = None
            self.is_unsharded = True  # landed; swapped back below
        for owner, index, regs in self.borrowed:
            for module, attr in regs:
                module._parameters[attr] = owner.sharded[index]
        if not self.is_unsharded:
            return
        for i, sp in enumerate(self.sharded):
            self._register(i, sp)
        self.full.untyped_storage().resize_(0)
        COUNTERS.add_gathered(-self._gathered_bytes)
        self._gathered_bytes = 0
        self.is_unsharded = False
        stale.note_resharded(self)

    def gather_into(self, full: torch.Tensor, shard: torch.Tensor, tag: str) -> list:
        """Start the all-gathers of ``shard`` (laid out like the unit's shard) into ``full``
        (like its gathered buffer): one per section (Note [trainable section]); the handles."""
        handles = []
        for sec in self.layout.sections:
            (a, b), (c, d) = sec.full_range, sec.shard_range
            handles.append(self.comm.all_gather(full[a:b], shard[c:d], async_op=True, tag=tag))
        return handles

    @property
    def gather_in_flight(self) -> bool:
        return self._gather is not None

    def _register(self, index: int, tensor: nn.Parameter) -> None:
        for module, attr in self.registrations[index]:
            module._parameters[attr] = tensor

    # ------------------------------------------------------------------ conversions
    @torch.no_grad()
    def repack(self) -> None:
        """After ``module.to()``/``.double()`` replaced the sharded parameters' data: rebuild the
        shard (and the unsharded buffer) from them, so pieces and buffers alias again."""
        self.reshard()
        first = self.sharded[0]
        if all(sp.untyped_storage().data_ptr() == self.shard.untyped_storage().data_ptr() for sp in self.sharded) \
                and first.dtype == self.dtype:
            return
        shard = torch.zeros(self.layout.shard_numel, dtype=first.dtype, device=first.device)
        for i, sp in enumerate(self.sharded):
            piece = self.layout.piece(i, self.rank)
            shard[piece.shard_offset:piece.shard_offset + piece.numel].copy_(sp.reshape(-1))
            sp.data = alias(shard, piece.shard_offset, piece.shape)
        param_dtype = first.dtype if self.param_dtype == self.dtype else self.param_dtype
        self.shard, self.dtype, self.param_dtype, self.shard_device = shard, first.dtype, param_dtype, first.device
        if not self.offload:
            self.device = first.device
        self.full = torch.empty(self.layout.total_numel, dtype=self.param_dtype, device=self.device)
        for s, u in zip(self.layout.slots, self.unsharded):
            u.data = alias(self.full, s.offset, s.shape)
        self._full_nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ sizes
    @property
    def sharded_bytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()

    @property
    def unsharded_bytes(self) -> int:
        return self._full_nbytes

    def element_range(self, index: int, rank: Optional[int] = None) -> tuple[int, int]:
        """The elements ``[start, end)`` of parameter ``index`` (flattened) that ``rank``'s
        piece holds."""
        return self.layout.element_range(index, self.rank if rank is None else rank)
