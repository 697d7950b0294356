"""Initializing a sharded model as the unsharded model would be: ``init_parameters``.

Note [initializing like the unsharded model]
    After ``to_empty`` a piece is a plain tensor of this rank's rows (Note [sharded
    parameters] in unit.py), so ``reset_parameters()`` on it fills a tensor of the piece's
    shape: every rank draws the same numbers for different rows, and fan-in-scaled inits
    use the piece's shape. ``init_parameters`` gives instead exactly the values
    ``model.apply(init_fn)`` gives the unsharded model from the same RNG state:

    * submodules are visited in ``nn.Module.apply``'s order (children first, then the
      module), and ``init_fn`` is called once on each, so the RNG is consumed in the same
      order and amounts; ``order="modules"`` visits them in ``module.modules()``'s order
      instead (each module before its children), the order in which Lightning materializes
      a meta-device model (``reset_parameters()`` per submodule), so a parent's init that
      re-initializes its children is overwritten by theirs there as it is in Lightning;
    * when ``init_fn(sub)`` first reads or writes a parameter (Note [whole only when read]),
      the units holding ``sub``'s parameters are made *whole*: a
      temporary flat buffer in the shard's dtype on the compute device, laid out as the
      gathered buffer, with this rank's shard copied into its place, and whole parameters on
      it held by the modules. No communication: every rank computes the same whole values
      from the same RNG state, and keeps its own rows;
    * a unit stays whole while the next submodules need it; when a submodule needs another
      unit, this rank's part of the buffer is copied back into the shard (the exact inverse
      of the copy in) and the buffer is freed. So at most one unit is whole at a time (two
      for a submodule holding a weight tied to another unit's), and a unit may be made
      whole more than once (the root's unit, for the layers before and after the blocks).

    A unit's parameters sharded on another dim than 0 (Note [dim-sharded sections] in
    chunk_layout.py) are not views of the gathered layout: their section's buffer holds the
    whole parameters end to end instead, this rank's chunk copied into its place on the way
    in and out.

    A tensor-parallel parameter (Note [tensor-parallel parameters] in tensor_parallel.py) is
    made whole as the *global* parameter, as the unsharded model holds it: a temporary
    tensor of the global shape with this rank's local tensor in its place, which ``init_fn``
    fills as it fills the unsharded model's (the same RNG draws, fan-in from the global
    shape); this rank's local tensor is cut from it on the way out. Every tensor-parallel
    rank draws the whole parameter and keeps its part, as every data-parallel rank keeps its
    rows.

    Which units a submodule needs: those holding its own parameters (``recurse=False``; a
    weight it borrows from another unit counts for that unit); a submodule without
    parameters needs the unit of the innermost ``fully_shard`` module containing it (itself
    included), so an ``init_fn`` that initializes a block's children from the block itself
    (torchtitan's block ``init_weights``) finds them whole. One that reaches into another
    ``fully_shard`` module's parameters (a root ``init_weights`` initializing the whole
    model) finds pieces there: split it so that each module initializes its own unit's
    part (the blocks' from the blocks). Parameters outside every unit
    (``ignored_params``, modules not sharded) and buffers are not sharded: ``init_fn``
    initializes them as they are (a non-persistent buffer such as a rotary table, BatchNorm
    statistics).

    What ``init_fn`` may do: what it does to an unsharded model -- write in place, assign a
    parameter's ``.data``, or replace the parameter with a tensor of the whole shape (its
    values are kept, the piece stays the parameter). Reading values: those written since
    the unit was made whole are whole; those a unit kept from an earlier time it was whole
    are there in this rank's rows only (other rows zero), since reading them whole would
    need a gather.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Optional

import torch
from torch import nn

from .layout import alias
from .memory import COUNTERS
from .params_on_read import modules_holding, unwatch_params, watch_params
from .state import state_of

__all__ = ["init_parameters"]


@torch.no_grad()
def init_parameters(module: nn.Module, init_fn: Optional[Callable[[nn.Module], None]] = None, *,
                    order: str = "apply") -> nn.Module:
    """Initialize a ``fully_shard`` model (after ``to_empty``) to exactly what
    ``module.apply(init_fn)`` gives the unsharded model from the same RNG state, each rank
    keeping its rows (Note [initializing like the unsharded model]). ``init_fn(submodule)``
    defaults to ``submodule.reset_parameters()`` for the submodules that define it.
    ``order="modules"`` calls it in ``module.modules()``'s order instead (parents first), as
    ``for m in module.modules(): init_fn(m)`` would. Buffers are initialized by ``init_fn``
    too (they are not sharded). Needs no communication, but call it on every rank with the
    same RNG state. Returns ``module``.

    With the default ``init_fn``, the parameters and buffers of submodules that define no
    ``reset_parameters()`` (``nn.MultiheadAttention``'s projections, a model's own
    ``nn.Parameter``) keep what they held -- after ``to_empty``, uninitialized memory: a
    ``UserWarning`` names them, as Lightning's meta-device materialization does."""
    if order not in _ORDERS:
        raise ValueError(f"fusedist.fsdp.init_parameters: order must be one of {sorted(_ORDERS)}, got {order!r}")
    default = init_fn is None
    init_fn = _reset_parameters if default else init_fn
    units = _units_under(module)
    for unit in units:
        unit.check_materialized()
    wholes = _WholeOnRead(units, _plan(module, units))
    try:
        for sub in _ORDERS[order](module):
            wholes.visiting(sub)
            init_fn(sub)
    except BaseException:
        wholes.finish(quiet=True)  # (the exception that stopped it is the one to see)
        raise
    wholes.finish()
    if default:
        _warn_uninitialized(module)
    return module


def _warn_uninitialized(module: nn.Module) -> None:
    """Warn, naming them, of the tensors no ``reset_parameters()`` reached (see ``init_parameters``)."""
    left = []
    for prefix, sub in module.named_modules():
        if callable(getattr(sub, "reset_parameters", None)):
            continue
        owned = [n for n, t in (*sub._parameters.items(), *sub._buffers.items()) if t is not None]
        left.extend(f"{prefix}.{n}" if prefix else n for n in owned)
    if left:
        warnings.warn(
            f"fusedist.fsdp.init_parameters: {', '.join(left)} belong to modules without a reset_parameters() "
            "method, so they keep what they held (after to_empty, uninitialized memory) unless another module's "
            "reset_parameters() wrote them. Pass an init_fn that initializes them, or give those modules "
            "reset_parameters().", UserWarning, stacklevel=2)


# Note [whole only when read]
#     A unit is made whole when ``init_fn`` first reads or writes a parameter while visiting a
#     submodule that needs it, not before every visit: ``model.apply(fn)`` with an ``fn`` that
#     touches no parameter (setting a flag on each module, every step) used to reshard every unit
#     -- a unit kept gathered (``reshard_after_forward=False``, the root) was all-gathered again
#     by the next forward -- and to copy every unit into a whole buffer and back, for nothing.
#     torch's FSDP2 does neither there (its ``apply`` only calls ``fn``). While ``init_fn`` runs,
#     the modules holding the units' parameters have a ``ParamsOnRead`` table (params_on_read.py):
#     the first read or write of a value (``module.weight``, ``parameters()``, ``state_dict()``,
#     assigning a parameter) reshards every unit once, then makes the visited submodule's units
#     whole as Note [initializing like the unsharded model] says, and the read sees them; later
#     reads while they stay whole cost a check. What ``init_fn`` computes is unchanged.


class _WholeOnRead:
    """The units whole now, made so on the first parameter read of the submodule visited
    (Note [whole only when read])."""

    def __init__(self, units: list, plan: "_Plan"):
        self.units, self.plan = units, plan
        self.whole: dict = {}  # unit -> _WholeUnit
        self.needed = ()
        self.resharded = False
        self.busy = False  # making units whole or releasing them: their own reads of the tables
        self.watched = watch_params(modules_holding(units), self.on_read)

    def visiting(self, sub: nn.Module) -> None:
        self.needed = self.plan.needs.get(id(sub), ())

    def on_read(self) -> None:
        if self.busy or (self.resharded and all(u in self.whole for u in self.needed)):
            return
        self.busy = True
        try:
            if not self.resharded:
                for unit in self.units:
                    unit.reshard()
                self.resharded = True
            if any(u not in self.whole for u in self.needed):
                _release_all(self.whole)
                for u in self.needed:
                    self.whole[u] = _WholeUnit(u, self.plan.borrowers.get(u, {}))
        finally:
            self.busy = False

    def finish(self, quiet: bool = False) -> None:
        """Release the units whole, give the modules their own tables back."""
        self.busy = True
        try:
            _release_all(self.whole, quiet)
        finally:
            unwatch_params(self.watched)


def _release_all(whole: dict, quiet: bool = False) -> None:
    """Release every unit of ``whole`` (emptied), each completely even where another's
    ``init_fn`` result was refused -- the pieces back in every module and the buffers freed,
    so the model stays usable after the error -- then raise the first refusal unless
    ``quiet``."""
    error = None
    while whole:
        try:
            whole.popitem()[1].release()
        except ValueError as e:
            error = error or e
    if error is not None and not quiet:
        raise error


def _reset_parameters(sub: nn.Module) -> None:
    reset = getattr(sub, "reset_parameters", None)
    if callable(reset):
        reset()


def _apply_order(module: nn.Module):
    """The modules in ``nn.Module.apply``'s order: children (recursively) first, then the module."""
    for child in module.children():
        yield from _apply_order(child)
    yield module


_ORDERS = {"apply": _apply_order, "modules": lambda module: module.modules()}


def _units_under(module: nn.Module) -> list:
    units = []
    for m in module.modules():
        st = state_of(m)
        if st is not None and st.unit is not None and st.unit not in units:
            units.append(st.unit)
    return units


@dataclasses.dataclass
class _Plan:
    """Which units each submodule needs whole, and where other units hold a unit's parameters."""

    needs: dict = dataclasses.field(default_factory=dict)  # id(submodule) -> [unit]
    borrowers: dict = dataclasses.field(default_factory=dict)  # unit -> {index: [(module, attr)]}

    def add(self, module: nn.Module, unit) -> None:
        needed = self.needs.setdefault(id(module), [])
        if unit not in needed:
            needed.append(unit)


def _plan(module: nn.Module, units: list) -> _Plan:
    plan = _Plan()
    for unit in units:
        for regs in unit.registrations:
            for m, _ in regs:
                plan.add(m, unit)
        for owner, index, regs in unit.borrowed:
            plan.borrowers.setdefault(owner, {}).setdefault(index, []).extend(regs)
            for m, _ in regs:
                plan.add(m, owner)
    # modules without parameters in a unit: the innermost fully_shard module's unit
    stack = [(module, None)]
    while stack:
        m, inner = stack.pop()
        st = state_of(m)
        if st is not None:
            inner = st.unit
        if id(m) not in plan.needs and inner is not None and not _has_own_params(m):
            plan.needs[id(m)] = [inner]
        stack.extend((c, inner) for c in m.children())
    return plan


def _has_own_params(m: nn.Module) -> bool:
    return any(p is not None for p in m._parameters.values())


class _WholeUnit:
    """One unit made whole for initialization: a temporary buffer in the shard's dtype, laid
    out as the gathered buffer, this rank's shard copied in; whole parameters on it held by
    the unit's modules (and by the modules of other units borrowing its parameters)."""

    def __init__(self, unit, borrowers: dict):
        self.unit, self.borrowers = unit, borrowers
        # one buffer per section, in its shard's dtype (Note [dtype sections] in layout.py); a
        # dim-sharded section's holds its whole parameters end to end
        self.buffers = [torch.zeros(sec.layout.whole_numel if sec.chunked else sec.layout.total_numel, dtype=s.dtype,
                                    device=unit.device)
                        for sec, s in zip(unit.layout.sections, unit.shards)]
        for own, mine in self._own_parts():
            own.copy_(mine)
        for i in self._dim_sharded():
            unit.piece_of_whole(i, self._view(i)).copy_(unit.sharded[i])
        # (kept apart from the parameters: init_fn may give a parameter other ``.data``)
        self.wholes = [self._whole(i) for i in range(len(unit.sharded))]
        self.params = [nn.Parameter(w, requires_grad=sp.requires_grad) for w, sp in zip(self.wholes, unit.sharded)]
        self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers) + sum(
            w.numel() * w.element_size() for i, w in enumerate(self.wholes) if unit.tp[i] is not None)
        COUNTERS.add_scratch(self.nbytes)
        for i, p in enumerate(self.params):
            for m, attr in self._slots(i):
                m._parameters[attr] = p

    def _whole(self, index: int) -> torch.Tensor:
        """Parameter ``index`` whole: its view of the buffer, or for a tensor-parallel one the
        global parameter with this rank's local tensor in its place."""
        view, spec = self._view(index), self.unit.tp[index]
        if spec is None:
            return view
        whole = torch.zeros(spec.global_shape, dtype=view.dtype, device=view.device)
        spec.local_of_global(whole).copy_(view)
        return whole

    def _own_parts(self):
        """(this rank's part of the buffer, the shard's part) per row-aligned section."""
        unit = self.unit
        for buffer, sec, shard in zip(self.buffers, unit.layout.sections, unit.shards):
            if sec.chunked:
                continue
            n = sec.layout.shard_numel
            yield buffer[unit.rank * n:(unit.rank + 1) * n], shard

    def _dim_sharded(self) -> list:
        """The indices of the unit's parameters sharded on another dim than 0."""
        return [i for sec in self.unit.layout.sections if sec.chunked for i in sec.indices]

    def _view(self, index: int) -> torch.Tensor:
        """Parameter ``index`` whole on its section's buffer."""
        k = self.unit.section_index(index)
        slot = self.unit.layout.slots[index]
        sec, j = self.unit.layout.section_of(index)
        if sec.chunked:
            return alias(self.buffers[k], sec.layout.whole_offsets[j], slot.shape)
        return alias(self.buffers[k], slot.offset - self.unit.layout.sections[k].full_base, slot.shape)

    def _slots(self, index: int) -> list:
        return list(self.unit.registrations[index]) + self.borrowers.get(index, [])

    def release(self) -> None:
        """Keep this rank's rows of what ``init_fn`` wrote (also through a replaced parameter or
        ``.data``), put the pieces back, free the buffer."""
        unit = self.unit
        error = None  # a refused shape: raised once every piece is back and the buffers are freed
        for i, (whole, spec) in enumerate(zip(self.wholes, unit.tp)):
            for m, attr in self._slots(i):
                held = m._parameters.get(attr)
                if held is not None and not _same_data(held, whole):
                    refused = _shape_error(unit, i, m, attr, held, tuple(whole.shape))
                    if refused is None:
                        whole.copy_(held)
                    error = error or refused
                m._parameters[attr] = unit.sharded[i]
            if spec is not None:
                self._view(i).copy_(spec.local_of_global(whole))
        for own, mine in self._own_parts():
            mine.copy_(own)
        for i in self._dim_sharded():
            unit.sharded[i].copy_(unit.piece_of_whole(i, self._view(i)))
        self.buffers, self.wholes, self.params = None, None, None
        COUNTERS.add_scratch(-self.nbytes)
        if error is not None:
            raise error


def _same_data(t: torch.Tensor, view: torch.Tensor) -> bool:
    return t.device == view.device and t.data_ptr() == view.data_ptr() and t.shape == view.shape


def _shape_error(unit, index: int, module: nn.Module, attr: str, held: torch.Tensor,
                 shape: tuple) -> Optional[ValueError]:
    """The error for a parameter ``init_fn`` replaced with one of another shape, or None."""
    from .tree_names import unit_named

    if tuple(held.shape) != shape:
        return ValueError(
            f"fusedist.fsdp.init_parameters: after init_fn, {type(module).__name__}.{attr} "
            f"('{unit.names[index]}' of {unit_named(unit)}) has shape {tuple(held.shape)}; "
            f"expected the whole parameter's {shape}")
    return None
