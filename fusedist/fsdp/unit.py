"""One sharded unit: the parameters of one ``fully_shard`` call in one flat buffer.

The unit owns three things and nothing else: the rank's shard of the flat buffer (with the
sharded parameters the optimizer steps, Note [sharded parameters]), the unsharded buffer
(with the full parameters forward and backward use), and the swap between the two on the
modules that hold them. When to gather and reshard is the module state's decision
(``state.py``); the gradient side is ``grads.py``; where each piece lies in the shard, and
putting pieces back after a conversion, ``pieces.py``; allocating, resizing and gathering the
buffers themselves, ``buffers.py``.

Note [sharded parameters]
    At rest every parameter of a unit is replaced on its module by an ``nn.Parameter`` that
    *is* this rank's piece of it: a tensor on the storage of the unit's flat shard (not a
    view: a leaf of its own), shaped ``(rows, *shape[1:])`` (Note [row-aligned flat
    layout]), or for a parameter a ``shard_placement_fn`` shards on another dim its chunk on
    that dim (Note [dim-sharded sections] in chunk_layout.py). Why plain tensors, not DTensors
    as torch's FSDP2: any optimizer -- torch's,
    fusedist's fused and C++ CPU ones, ``master_weights``, LR schedulers -- steps them with
    no per-op dispatch, and its in-place update lands directly in the buffer the next
    all-gather sends. The cost is that a piece does not know it is a piece: a norm over
    pieces is this rank's share only, so the global norm goes through the gradient holder
    (``holder.py``) -- ``fusedist.clip_grad_norm_``, and torch's ``clip_grad_norm_`` /
    ``get_total_norm``, which fusedist makes global on pieces (Note [torch's clip on sharded
    gradients], ``optim/torch_clip.py``) -- and ``p.shape`` at rest is the piece's (README,
    known differences).

    While a unit is unsharded its modules hold the *unsharded* parameters instead: one
    persistent ``nn.Parameter`` per parameter on the storage of the unit's gathered buffer
    (of a dim-sharded section's copy-out buffer, filled from the gathered chunks).
    Persistent, so autograd's saved references and the gradient hooks stay valid across
    reshard/unshard; on a storage of their own version counter, so the all-gather writing
    the buffer is not an in-place change of a saved tensor. Resharding resizes that storage
    to zero bytes; unsharding resizes it back and gathers into it.

Note [lent parameters]
    A weight tied across units (an output layer sharing the embedding's weight) belongs to
    the unit that took it first, the owner; a later unit holding it borrows it: gathering the
    borrower gathers the owner, and the borrower's modules hold the owner's unsharded
    parameter while the borrower is gathered. The owner's own schedule may reshard it in the
    meantime -- the embedding's unit after its forward, while the root, which holds the
    output layer, runs the blocks and then the output layer. So an owner reshards only when
    none of its borrowers is gathered; otherwise the reshard is deferred, and the borrower
    carries it out when it reshards itself.

Note [units built on the meta device]
    Models too big for one device are built under ``torch.device("meta")``, sharded, then
    materialized with ``model.to_empty(device=...)`` and initialized
    (``fusedist.fsdp.init_parameters``, Note [initializing like the unsharded model] in
    ``param_init.py``). A unit whose parameters are all on meta builds its shard -- and so its
    pieces -- on meta: shapes, no data. Its gathered buffer is built on the compute device
    as always (allocated, then freed before anything touches it), so gathering never
    allocates anything but that buffer. A unit on meta refuses to gather, naming itself.

    ``to_empty`` (any ``_apply``) replaces a meta piece by a *new* ``nn.Parameter``: torch
    cannot change a tensor's data from meta to a real device in place, and a piece cannot be
    swapped in place either (registries hold weak references to it). So ``repack`` adopts the
    tensor it finds on the module as the piece, puts it back on every module holding the
    parameter (``to_empty`` on a plain model unties a weight shared by two modules; a unit
    keeps it tied), and the owner of the registries (``api.py``) registers the new pieces.
    Parameters a unit borrows from another unit are put back last (``relink_borrowed``),
    once every unit under the converted module has its new shard.

    One unit is on meta or not as a whole: its parameters share one flat shard. A unit with
    some parameters on meta and others not is refused: ``to_empty`` would discard the real
    ones anyway, so nothing is lost by building the whole module on meta.

Note [a submodule converted on its own]
    ``block.fc.double()`` after ``fully_shard(block)``: ``fc`` is a plain module holding pieces
    of ``block``'s unit, so the sharded module's ``_apply`` never runs. torch's ``Module._apply``
    gives each piece new data (``piece.data = converted``), off the unit's shard: the next
    gather sent the old shard in the old dtype, the conversion was ignored in forward, and an
    optimizer then stepped pieces no gather read any more -- training silently stopped for
    them. FSDP2 applies such a conversion made before the first forward (its lazy init reads
    the parameters' dtype) and refuses one that leaves a unit's parameters in several dtypes.
    A unit records where each piece's data lies (pointer, dtype, device) whenever it places
    them; before each gather it compares (a few tensor attribute reads per parameter), and on
    a change rebuilds its shard from the pieces as a conversion of the sharded module does
    (``repack``; a converted piece keeps its identity, so optimizers keep it), at any point
    between steps. Pieces left in several dtypes or devices where the unit holds them in one
    flat shard are refused, naming them (a unit built from parameters of several dtypes keeps
    a section per dtype: Note [dtype sections] in layout.py). A dtype change is the same on
    every rank, so every rank rebuilds alike and the gathers stay paired.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
from torch import nn

from .extension import ExtensionGathers
from .._dtypes import real_pairs
from .layout import SplitLayout
from .memory import COUNTERS
from .buffers import BufferMixin
from .pieces import PieceMixin
from .registrations import Registrations
from . import stale
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy
from .param_view import ShardParam, as_piece
from .tree_names import param_path, unit_owner


class ShardedUnit(BufferMixin, PieceMixin):
    """The flat buffers and parameter swap of one ``fully_shard`` call (Note [sharded
    parameters]). ``params[i]`` is held by the modules ``registrations[i]`` as ``(module,
    attribute)`` pairs (several for a parameter shared inside the unit)."""

    def __init__(self, name: str, params: list, registrations: list, fqns: list, comm, device: torch.device,
                 mp_policy: MixedPrecisionPolicy, offload_policy, reshard_after_forward: bool,
                 replicate_comm=None, dims: Optional[list] = None, tp: Optional[list] = None,
                 ext: Optional[list] = None, shard_mesh=None):
        self.name, self.fqns, self.registrations = name, fqns, registrations
        #: each parameter's name in the unit as the module's tree is now, for messages (``fqns``: as
        #: at wrapping); renamed when the root sees its tree changed (Note [unit paths follow the
        #: module] in tree_names.py)
        self.names = list(fqns)
        #: each parameter's TensorParallelSpec, None for a plain one (Note [tensor-parallel
        #: parameters] in tensor_parallel.py): the unit holds the local tensors
        self.tp = list(tp) if tp is not None else [None] * len(params)
        self.tp_comm = next((s.comm for s in self.tp if s is not None), None)
        params = [nn.Parameter(s.local(p).detach(), requires_grad=p.requires_grad) if s is not None else p
                  for p, s in zip(params, self.tp)]
        #: each parameter's ExtensionSpec, None for a plain one (Note [all-gather extension] in
        #: extension.py): the unit holds the high-precision tensors the subclasses wrap
        self.ext = list(ext) if ext is not None else [None] * len(params)
        params = [nn.Parameter(e.inner(p).detach(), requires_grad=p.requires_grad) if e is not None else p
                  for p, e in zip(params, self.ext)]
        #: the gathers of the extension sections (Note [all-gather extension] in extension.py)
        self.ext_gathers = ExtensionGathers(self, shard_mesh, mp_policy)
        self.path: Optional[str] = None  # the module's path under its root, known at the root's first forward
        self.member_paths: Optional[list] = None  # a group unit's: each member's path (as ``path``)
        self.comm, self.device = comm, device
        #: HSDP: the replicate group's communicator (Note [replicate all-reduce] in replicate.py), else None
        self.replicate_comm = replicate_comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.dtype = params[0].dtype
        self.mp_param_dtype = mp_policy.param_dtype
        self.param_dtype = self.gather_dtype(self.dtype)
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.shard_device = torch.device("cpu") if self.offload else device
        #: events of gradient copies to host memory in flight (Note [offloaded gradients land
        #: before backward returns] in grads.py)
        self.host_copies: list = []
        self.reshard_after_forward = reshard_after_forward
        #: reshard_after_forward as an int: the smaller group the unit reshards to after forward
        #: (post_forward.py, Note [resharding to a smaller group after forward]), else None
        self.post_forward = None
        self._post_forward_parts: Optional[list] = None  # this rank's part of each gathered section
        self._post_forward_source = None  # the PostForwardGroup those parts are over
        self._post_forward_bytes = 0  # their bytes, counted in the gathered figure until gathered from
        self.reshard_after_backward = True
        # Note [trainable section]: trainable and frozen parameters in sections of their own,
        # Note [dtype sections]: and parameters of each dtype
        # Note [dim-sharded sections] (chunk_layout.py): parameters sharded on another dim than 0
        self.layout = SplitLayout([tuple(p.shape) for p in params], [p.requires_grad for p in params],
                                  self.world_size, [p.dtype for p in params], dims,
                                  [e is not None for e in self.ext])
        if self.layout.mixed:
            self.dtype = self.param_dtype = None  # per section: section_dtype(k), section_param_dtype(k)
        self._build(params, offload_policy)
        #: owner units of parameters shared with another unit: (owner, owner index, registrations)
        self.borrowed: list[tuple["ShardedUnit", int, Registrations]] = []
        # units borrowing parameters of this one (weakly: a borrower holds this unit in ``borrowed``, Note
        # [a dropped model freed at once] in state.py), and whether a reshard waits for them
        self._lent_to: list[weakref.ref] = []
        self.reshard_deferred = False
        self.is_unsharded = False
        self.gathered_once = False  # FSDP2's condition for reducing an unused unit (grads.py)
        self._gather = None  # (handles, input kept alive) of the all-gathers in flight
        self.holder = None  # the gradient holder (holder.py), kept alive by the units using it
        self._gathered_bytes = 0
        #: called with the parameter index when an unsharded parameter's gradient is accumulated
        self.on_grad: Optional[Callable[[int], None]] = None
        #: called with ``repack``'s adopted pieces when the unit adopts a submodule's conversion
        #: (its module's state registers them: Note [a submodule converted on its own])
        self.on_adopted: Optional[Callable[[list], None]] = None
        #: whether the unit's forward or backward is running (set by its module's state)
        self.busy: Callable[[], bool] = lambda: False
        stale.install()  # Note [gathered copies and the optimizer step]
        from .optim_state import note_unit

        note_unit(self)  # Note [optimizer state of pieces] in optim_state.py
        #: what the modules hold while gathered: the unsharded parameters, or DTensor parameters
        #: over them (Note [tensor-parallel parameters])
        self.visible = list(self.unsharded)
        for i in range(len(self.unsharded)):
            self._make_visible(i)

    def lend_to(self, borrower: "ShardedUnit") -> None:
        self._lent_to.append(weakref.ref(borrower))

    @property
    def lent_to(self) -> list:
        """The units borrowing parameters of this one, those alive (Note [lent parameters])."""
        return [b for b in (r() for r in self._lent_to) if b is not None]

    def _borrower_gathered(self) -> bool:
        """Whether a unit borrowing parameters of this one is gathered (its reshard waits for them)."""
        return bool(self._lent_to) and any(b.is_unsharded for b in self.lent_to)

    def _make_visible(self, i: int) -> None:
        """Parameter ``i`` as the modules hold it gathered, with the hook that tells the unit its
        gradient has been accumulated."""
        u, spec = self.unsharded[i], self.tp[i]
        if self.ext[i] is not None and self.ext[i].packed:
            return  # frozen quantized storage: no gradient to hear of (Note [quantized storage] in packed.py)
        if not (u.is_floating_point() or u.is_complex()):
            return  # a frozen integer/bool parameter (as FSDP2 takes it) can never have a gradient
        if spec is not None:
            u = self.visible[i] = spec.wrap(u, u.requires_grad)
        # (hooks register only on tensors requiring grad; a frozen one may be unfrozen later)
        frozen = not u.requires_grad
        u.requires_grad_(True)
        u.register_post_accumulate_grad_hook(_grad_hook(weakref.ref(self), i, spec is not None))
        u.requires_grad_(not frozen)

    def _local_grad(self, index: int, visible: nn.Parameter) -> None:
        """A DTensor parameter's gradient, as its local tensor, onto the unsharded parameter
        the reduction reads (Note [tensor-parallel parameters])."""
        grad, visible.grad = visible.grad, None
        local, u = self.tp[index].local_grad(grad), self.unsharded[index]
        if local is not None:  # (None: its spec keeps it, Note [tensor-parallel gradients across micro-batches])
            u.grad = local if u.grad is None else u.grad + local
        if self.on_grad:
            self.on_grad(index)

    @torch.no_grad()
    def _build(self, params: list, offload_policy) -> None:
        layout, rank = self.layout, self.rank
        self.pin = self.offload and offload_policy.pin_memory and self.device.type != "cpu"
        on_meta = _on_meta(self.name, params, self.fqns)  # Note [units built on the meta device]
        device = torch.device("meta") if on_meta else self.shard_device
        self._new_shard([sec.dtype or self.dtype for sec in layout.sections], device)
        self.sharded: list[nn.Parameter] = []
        for i, p in enumerate(params):
            piece = layout.piece(i, rank)
            if piece.numel and not on_meta:
                self.piece_view(i).copy_(self.piece_of_whole(i, p.detach()))
            view = self.piece_view(i) if self.ext[i] is None else self.ext[i].wrap(self.piece_view(i))
            self.sharded.append(as_piece(ShardParam(view, requires_grad=p.requires_grad)))  # (param_view.py)
        self.unsharded = [None] * len(params)
        self._new_full()
        self.unsharded = [nn.Parameter(u, requires_grad=p.requires_grad) for u, p in zip(self.unsharded, params)]
        self.mark_pieces()

    # ------------------------------------------------------------------ unshard / reshard
    def unshard(self, async_op: bool = True) -> None:
        """Start the all-gather of the shard into the unsharded buffer (and of the units
        owning parameters this one borrows); without ``async_op``, wait for it."""
        for owner, _, _ in self.borrowed:
            owner.unshard(async_op=True)
        self.adopt_conversions()
        self.check_materialized()
        if not self.is_unsharded and self._gather is None:
            if (self.full if self.full is not None else self.fulls[0]).untyped_storage().nbytes() == 0:
                self._resize_full(True)
                COUNTERS.add_gathered(self._full_nbytes, self)
                self._gathered_bytes = self._full_nbytes
            if self._post_forward_parts is not None:
                # Note [resharding to a smaller group after forward]: gather the parts within the run
                src, group = self._post_forward_parts, self._post_forward_source
                self._post_forward_parts = self._post_forward_source = None  # (kept alive by _gather)
                tag = f"fully_shard gather {self.label} (post-forward group of {group.size})"
                handles = [group.comm.all_gather(real_pairs(out), real_pairs(part), async_op=True, tag=tag)
                           for out, part in zip(self.fulls, src)]
            else:
                if self.shard is not None:
                    src, full = self._gather_source(self.shard, self.param_dtype), self.full
                else:  # Note [dtype sections]: each section from its own shard, in its gathered dtype
                    src = [None if sec.extension else self._gather_source(s, self.section_param_dtype(k))
                           for k, (s, sec) in enumerate(zip(self.shards, self.layout.sections))]
                    full = self.fulls
                tag = f"fully_shard gather {self.label}"
                handles = self.gather_into(full, src, tag)
                for k, sec in enumerate(self.layout.sections):
                    if sec.extension:
                        src[k], handle = self.ext_gathers.start(k, tag)
                        handles.append(handle)
            self._gather = (handles, src)
            stale.note_gathered(self)
        if not async_op:
            self.wait_for_unshard()

    def adopt_conversions(self) -> None:
        """Take up a submodule's own conversion made since the unit last placed its pieces (Note
        [a submodule converted on its own]), before anything reads the shard: a gather for
        forward, or the whole parameters of a state dict (which FSDP2 reports in the converted
        dtype at once)."""
        if self.is_unsharded and self._gather is None:
            self._adopt_gathered_conversion()
        if not self.is_unsharded and self._gather is None and self.converted_on_its_own():
            self.adopt_conversion()

    def adopt_conversion(self) -> None:
        """Rebuild the shard around pieces a submodule's own conversion changed (Note [a submodule
        converted on its own]), as a conversion of the sharded module does."""
        adopted = self.repack()
        if self.on_adopted is not None:
            self.on_adopted(adopted)
        for borrower in self.lent_to:
            borrower.relink_borrowed()

    @torch.no_grad()
    def _adopt_gathered_conversion(self) -> None:
        """A submodule converted on its own while the unit was gathered converted the unsharded
        parameters, not the pieces (Note [a submodule converted on its own]): give the pieces
        the converted parameters' dtype and device, reshard, and place the unsharded
        parameters on the unit's buffer again, so the next gather reads the pieces."""
        changed = [i for i, u in enumerate(self.unsharded) if self.ext[i] is None and self.tp[i] is None
                   and (u.dtype != self.section_param_dtype(self.section_index(i)) or u.device != self.device)]
        if not changed or self._borrower_gathered():
            return
        for i in changed:
            u, data = self.unsharded[i], self.piece_data(i)
            self._point_piece(i, data.to(dtype=u.dtype, device=data.device if self.offload else u.device))
        self.reshard()
        self._new_full()

    def wait_for_unshard(self) -> None:
        """Block until the gathers have landed; the modules then hold the unsharded parameters."""
        if not self.is_unsharded:
            if self._gather is None:
                self.unshard(async_op=True)
            handles, _src = self._gather
            for handle in handles:
                handle.wait()
            self._gather = None
            self._release_post_forward_bytes()
            self._copy_out()
            for i, u in enumerate(self.unsharded):
                u.requires_grad_(self.sharded[i].requires_grad)  # a freeze after wrapping is seen here
                self.visible[i].requires_grad_(u.requires_grad)
                self._register(i, self.visible[i])
            self.is_unsharded = self.gathered_once = True
        for owner, index, regs in self.borrowed:
            owner.wait_for_unshard()
            for module, attr in regs:
                module._parameters[attr] = owner.visible[index]

    def reshard(self) -> None:
        """Free the unsharded buffer; the modules hold the sharded parameters again. A gather
        still in flight is waited for first (its buffer cannot be freed under it). While a
        unit borrowing one of this unit's parameters is gathered, the free is deferred until
        that unit reshards (Note [lent parameters])."""
        landed = False
        if self._gather is not None:
            for handle in self._gather[0]:
                handle.wait()
            self._gather = None
            self._release_post_forward_bytes()
            self.is_unsharded = landed = True  # landed; swapped back below
        if self.is_unsharded and self._borrower_gathered():
            if landed:
                self._copy_out()
                for i, u in enumerate(self.unsharded):
                    self._register(i, u)
            self.reshard_deferred = True
            return
        self._hold_borrowed_pieces()
        if self.is_unsharded:
            self._free_full()
            stale.note_resharded(self)
        if self._post_forward_parts is not None:
            self._post_forward_parts = self._post_forward_source = None
            self._release_post_forward_bytes()
            stale.note_resharded(self)
        self._reshard_owners()

    def reshard_post_forward(self) -> None:
        """The reshard after forward: to this rank's part over the post-forward group when
        ``reshard_after_forward`` was an int (Note [resharding to a smaller group after
        forward]), else :meth:`reshard`. A unit not gathered, or whose reshard a gathered
        borrower defers (Note [lent parameters]), reshards fully."""
        group = self.post_forward
        if group is None or self._gather is not None or not self.is_unsharded \
                or self._borrower_gathered():
            self.reshard()
            return
        with torch.no_grad():
            parts = []
            for full in self.fulls:
                n = full.numel() // group.size
                parts.append(full.narrow(0, n * group.rank, n).clone())
        self._hold_borrowed_pieces()
        self._free_full()
        self._post_forward_parts, self._post_forward_source = parts, group
        self._post_forward_bytes = sum(p.numel() * p.element_size() for p in parts)
        COUNTERS.add_gathered(self._post_forward_bytes, self)
        # (still noted as gathered: an optimizer step over the pieces drops the stale parts, stale.py)
        self._reshard_owners()

    def _hold_borrowed_pieces(self) -> None:
        """The modules holding parameters this unit borrows hold the lenders' pieces again."""
        for owner, index, regs in self.borrowed:
            for module, attr in regs:
                module._parameters[attr] = owner.sharded[index]

    def _free_full(self) -> None:
        """The modules hold the pieces again; the gathered buffer is freed."""
        for i, sp in enumerate(self.sharded):
            self._register(i, sp)
        self._resize_full(False)
        COUNTERS.add_gathered(-self._gathered_bytes, self)
        self._gathered_bytes = 0
        self.is_unsharded = False

    def _reshard_owners(self) -> None:
        self.reshard_deferred = False
        for owner, _, _ in self.borrowed:
            if owner.reshard_deferred:
                owner.reshard()

    def _release_post_forward_bytes(self) -> None:
        COUNTERS.add_gathered(-self._post_forward_bytes, self)
        self._post_forward_bytes = 0

    @property
    def post_forward_bytes(self) -> int:
        """Bytes of the post-forward parts this rank holds now (0 unless resharded to a smaller
        group after forward and not gathered since)."""
        return self._post_forward_bytes if self._post_forward_parts is not None else 0

    def check_materialized(self) -> None:
        """Raise unless the unit's shard holds data: a unit built on meta is gathered only
        after ``to_empty``."""
        if self.is_meta:
            names = [param_path(self, i) for i in range(len(self.names))]
            raise RuntimeError(
                f"fusedist.fully_shard: the parameters ({_first_names(names)}) of {unit_owner(self)} are still on "
                "the meta device. Call model.to_empty(device=...) on the model, then initialize it "
                "(fusedist.fsdp.init_parameters(model), or load a checkpoint), before running it.")

    @property
    def label(self) -> str:
        """The unit in collective tags, hence in timeouts and stall reports: its module's path
        under the root (which of several alike blocks) and class, the root's own unit as "the
        root module (Net)" (as messages name it: Note [unit paths follow the module] in tree_names.py)."""
        if self.path is None:
            return self.name
        return f"{self.path} ({self.name})" if self.path else f"the root module ({self.name})"

    @property
    def gather_in_flight(self) -> bool:
        return self._gather is not None


def _on_meta(name: str, params: list, fqns: list) -> bool:
    """Whether the unit is built on meta: all its parameters are (Note [units built on the meta
    device]); some but not all is refused."""
    meta = [p.is_meta for p in params]
    if all(meta) or not any(meta):
        return meta[0]
    on = [f for f, m in zip(fqns, meta) if m]
    off = [f"{f} ({p.device})" for f, p, m in zip(fqns, params, meta) if not m]
    raise ValueError(
        f"fusedist.fully_shard({name or 'root'}): some parameters of this unit are on the meta device "
        f"({_first_names(on)}) and some are not ({_first_names(off)}). A unit's parameters share one flat "
        "shard, which is built on meta or with data, not both; build the whole module under "
        "torch.device('meta') (to_empty would discard the real values anyway) or materialize it first.")


def _first_names(names: list, limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _grad_hook(unit_ref: "weakref.ref[ShardedUnit]", index: int, local: bool) -> Callable:
    """The gradient hook of a unit's unsharded parameter ``index``. It holds the unit weakly:
    autograd keeps a tensor's hooks where the garbage collector cannot see them, so a hook
    holding the unit that holds the tensor kept the whole model alive after it was dropped."""

    def hook(p) -> None:
        unit = unit_ref()
        if unit is None:
            return
        if local:
            unit._local_grad(index, p)
        elif unit.on_grad:
            unit.on_grad(index)

    return torch.compiler.disable(hook)  # Note [hooks outside compiled graphs] in state.py
