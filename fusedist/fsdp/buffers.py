"""The storage of a unit's flat buffers: the shard, the gathered buffer, their dtypes and sizes.

A ``ShardedUnit`` (``unit.py``) decides when to gather and reshard and swaps the parameters its
modules hold; this mixin owns the tensors behind them (Note [sharded parameters] in ``unit.py``):
it allocates the shard (one flat tensor, or one per section of a mixed-dtype unit: Note [dtype
sections] in layout.py), builds the gathered buffer and points the unsharded parameters at it,
resizes that buffer's storage as the unit gathers and reshards, starts the all-gathers between
the two, and copies dim-sharded parameters out of their gathered chunks (Note [dim-sharded
sections] in chunk_layout.py). Kept apart so the unit's schedule reads without the layout
arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn

from .._dtypes import real_pairs
from .layout import alias


class BufferMixin:
    """The shard and gathered-buffer storage of ``ShardedUnit`` (its layout, shards, fulls)."""

    def gather_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The gathered (compute) dtype of parameters of ``dtype``: ``mp_policy.param_dtype`` for
        floating ones when set (FSDP2 casts every floating parameter), else their own."""
        return self.mp_param_dtype if self.mp_param_dtype is not None and dtype.is_floating_point else dtype

    def section_dtype(self, k: int) -> torch.dtype:
        """The dtype of section ``k``'s shard (its parameters' dtype)."""
        return self.shards[k].dtype

    def section_param_dtype(self, k: int) -> torch.dtype:
        """The dtype section ``k`` is gathered in."""
        return self.gather_dtype(self.shards[k].dtype) if self.layout.mixed else self.param_dtype

    def section_index(self, index: int) -> int:
        """The section holding parameter ``index``."""
        return self.layout._where[index][0]

    def _new_shard(self, dtypes: list, device: torch.device) -> None:
        """Zeroed shard storage: one tensor ``shard`` whose sections ``shards`` are slices, or in a
        mixed-dtype unit one tensor per section of its dtype (``shard`` None; Note [dtype
        sections])."""
        pin = self.pin and device.type == "cpu"
        make = torch.empty if device.type == "meta" else torch.zeros
        secs = self.layout.sections
        kw = {} if device.type == "meta" else {"pin_memory": pin}
        if not self.layout.mixed:
            self.shard = make(self.layout.shard_numel, dtype=dtypes[0], device=device, **kw)
            self.shards = [self.shard[a:b] for a, b in (sec.shard_range for sec in secs)]
        else:
            self.shard = None
            self.shards = [make(sec.layout.shard_numel, dtype=dt, device=device, **kw) for sec, dt in zip(secs, dtypes)]

    def _new_full(self) -> None:
        """The gathered buffer (one tensor, or one per section of a mixed-dtype unit), built
        allocated then freed; the unsharded parameters' data set (or made) on it."""
        secs, layout = self.layout.sections, self.layout
        if not layout.mixed:
            self.full = torch.empty(layout.total_numel, dtype=self.param_dtype, device=self.device)
            self.fulls = [self.full[a:b] for a, b in (sec.full_range for sec in secs)]
        else:
            self.full = None
            # (an extension section's: the bytes its gather brings, sized at the gather; Note
            # [all-gather extension] in extension.py)
            self.fulls = [torch.empty(0, dtype=torch.uint8, device=self.device) if sec.extension else
                          torch.empty(sec.layout.total_numel, dtype=self.section_param_dtype(k), device=self.device)
                          for k, sec in enumerate(secs)]
        # Note [dim-sharded sections]: a dim-sharded section's whole parameters are copied out of
        # its gathered chunks into a buffer of their own (None for a row-aligned section)
        self.outs = [torch.empty(sec.layout.whole_numel, dtype=self.section_param_dtype(k), device=self.device)
                     if sec.chunked else None for k, sec in enumerate(secs)]
        for i in range(len(layout.slots)):
            k = self.section_index(i)
            sec, slot = secs[k], layout.slots[i]
            if sec.chunked:
                view = alias(self.outs[k], sec.layout.whole_offsets[layout.section_of(i)[1]], slot.shape)
            else:
                view = alias(self.fulls[k], slot.offset - sec.full_base, slot.shape)
            if self.unsharded[i] is None:
                self.unsharded[i] = view
            elif self.ext[i] is not None:
                # until its first gather, a placeholder of the parameter's shape, never allocated
                self.ext_gathers.forget(i)
                self.unsharded[i] = self.visible[i] = nn.Parameter(view, requires_grad=self.unsharded[i].requires_grad)
                self._make_visible(i)
            else:
                self.unsharded[i].data = view
                if self.tp[i] is not None:  # a DTensor over the new storage (and dtype, device)
                    self._make_visible(i)
        fulls = [self.full] if self.full is not None else self.fulls
        self._full_nbytes = sum(f.untyped_storage().nbytes() for f in fulls)
        self._full_nbytes += sum(o.untyped_storage().nbytes() for o, sec in zip(self.outs, secs)
                                 if o is not None and not sec.extension)
        self._resize_full(False)

    def _gather_source(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if src.device != self.device:
            src = src.to(self.device, non_blocking=True)
        if src.dtype != dtype:
            src = src.to(dtype)
        return src

    def _resize_full(self, allocate: bool) -> None:
        """Allocate (or free) the gathered buffer's storage (one, or one per section), and the
        copy-out buffers of dim-sharded sections (Note [dim-sharded sections])."""
        secs = self.layout.sections
        for o, sec in zip(self.outs, secs):
            if o is not None and not (allocate and sec.extension):
                o.untyped_storage().resize_(o.numel() * o.element_size() if allocate else 0)
        if self.full is not None:
            self.full.untyped_storage().resize_(self._full_nbytes if allocate else 0)
            return
        for f, sec in zip(self.fulls, secs):
            if not sec.extension:
                f.untyped_storage().resize_(f.numel() * f.element_size() if allocate else 0)
        if not allocate:  # an extension section's bytes and outputs (allocated by its gather)
            for f, sec in zip(self.fulls, secs):
                if sec.extension:
                    f.untyped_storage().resize_(0)
            self.ext_gathers.free()

    @torch.no_grad()
    def _copy_out(self) -> None:
        """The whole dim-sharded parameters from their gathered chunks (Note [dim-sharded
        sections] in chunk_layout.py); nothing for row-aligned sections, whose parameters are
        views of the gathered buffer."""
        for k, sec in enumerate(self.layout.sections):
            if sec.extension:
                self.ext_gathers.finish(k)
            elif sec.chunked:
                for j, i in enumerate(sec.indices):
                    sec.layout.copy_out(self.fulls[k], j, self.unsharded[i].data)

    def gather_into(self, full, shard, tag: str) -> list:
        """Start the all-gathers of ``shard`` (laid out like the unit's shard) into ``full``
        (like its gathered buffer): one per section (Note [trainable section]); the handles.
        Either may instead be a list of one tensor per section (Note [dtype sections])."""
        handles = []
        for k, sec in enumerate(self.layout.sections):
            (a, b), (c, d) = sec.full_range, sec.shard_range
            out = full[k] if isinstance(full, (list, tuple)) else full[a:b]
            src = shard[k] if isinstance(shard, (list, tuple)) else shard[c:d]
            if src is None:
                continue  # (an extension section's gather: ExtensionGathers.start)
            handles.append(self.comm.all_gather(real_pairs(out), real_pairs(src), async_op=True, tag=tag))
        return handles

    @property
    def is_meta(self) -> bool:
        """Whether the shard is on the meta device (Note [units built on the meta device])."""
        return self.shards[0].is_meta

    @property
    def sharded_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in ([self.shard] if self.shard is not None else self.shards))

    @property
    def unsharded_bytes(self) -> int:
        """The gathered unit's bytes; an extension parameter's (its outputs) once it has been
        gathered (Note [all-gather extension] in extension.py)."""
        return self._full_nbytes + self.ext_gathers.output_bytes
