"""``fully_shard``: ZeRO stage 3 with torch FSDP2's signature, and the methods a sharded module gains.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Callable, Literal, Optional

import torch
from torch import nn
from typing_extensions import deprecated

from ..comm import get_communicator
from . import recovery
from .state_dict_hooks import install_state_dict_hooks
from .applied_once import refuse_sharded_again
from .grads import UnitGrads
from .held_alike import share_tensor_parallel_holder
from .holder import holder_for
from .memory import memory_stats as _memory_stats
from .post_forward import resolve_reshard_after_forward
from .policy import MixedPrecisionPolicy, OffloadPolicy, as_mixed_precision_policy, as_offload_policy
from .extension import extension_specs, put_stand_ins, take_stand_ins
from .dtensor_view import record_mesh
from .mesh import groups_of, shard_mesh_of
from .owners import Held, record_owner, record_slots, register_pieces
from .sharded_class import original_class, refuse_pickling, shallow_copy, sharded_class
from .child_calls import guard_child_calls
from .members import check_params, describe, members_of, take_params
from .registrations import Registrations
from .module_apply import apply_whole
from .state import FullyShardState, state_of
from .tensor_parallel import tensor_parallel_specs
from .unit import ShardedUnit

__all__ = ["fully_shard", "FullyShardedModule", "UnshardHandle"]

def fully_shard(module: nn.Module | list, *, mesh=None, process_group=None,
                reshard_after_forward: Optional[bool | int] = None,
                shard_placement_fn: Optional[Callable] = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: Optional[OffloadPolicy] = None,
                ignored_params: Optional[set] = None, dp_mesh_dims=None) -> nn.Module:
    """Shard ``module``'s parameters across the ranks of ``mesh`` or ``process_group``
    (default: the world), as torch's ``fully_shard``; returns ``module``. A 1-D mesh shards
    over its ranks; a 2-D mesh is HSDP, (replicate, shard) as FSDP2 reads it: sharded over
    dim 1, each gradient shard all-reduced over dim 0 (Note [replicate all-reduce] in
    replicate.py; meshes refused: ``mesh.py``).
    ``module`` may be a list of modules, made one unit (Note [a list of modules as one unit] in
    members.py).

    Call it bottom-up (each block, then the root): a call takes the parameters of ``module``
    not already taken by a call on a submodule and makes them one unit -- one flat buffer,
    one all-gather before the unit's forward (prefetched while the previous unit computes),
    one reduce-scatter of its gradients when its backward is done. Afterwards
    ``module.parameters()`` are this rank's pieces (Note [sharded parameters] in unit.py),
    which any optimizer steps.

    * ``reshard_after_forward``: free the gathered parameters after forward and gather again
      in backward (True, ZeRO-3), or keep them until backward (False). None (the default,
      as torch's): True, except for the root, which keeps them. An int ``k``, a divisor of
      the shard group's size ``S`` (FSDP2's): after forward each rank keeps its ``1/k`` of
      the gathered unit, shared with a run of ``k`` consecutive ranks of the group (one
      node, say), and backward all-gathers within that run; gradients are reduce-scattered
      over the whole group as always. ``k == S`` is True, ``k == 1`` is False (with a
      warning), other values are a ``ValueError`` naming the value and ``S`` (Note
      [resharding to a smaller group after forward] in post_forward.py).
    * ``mp_policy``: :class:`MixedPrecisionPolicy` (gather/compute dtype, reduce dtype).
    * ``offload_policy``: :class:`CPUOffloadPolicy` keeps shards and gradients in host memory.
    * ``ignored_params``: parameters left as they are (not sharded, gradients not reduced).
    * ``shard_placement_fn``: ``param -> Shard(dim) | None`` as in FSDP2: each rank's piece of a
      parameter sharded on ``dim != 0`` is ``torch.chunk(param, S, dim)[rank]`` (Note
      [dim-sharded sections] in chunk_layout.py); other placements are refused, naming the
      parameter.
    * Tensor-parallel parameters (DTensors of ``parallelize_module`` on another dim of the mesh,
      FSDP2's 2-D recipe): each rank's local tensor is sharded (Note [tensor-parallel
      parameters] in tensor_parallel.py).
    * Tensor-subclass parameters with FSDP2's all-gather extension (torchao's float8 training
      weights): each gather asks them what to gather (Note [all-gather extension] in
      extension.py); frozen quantized storage (QLoRA's NF4 weights) is sharded as its own
      chunks' bytes (Note [quantized storage] in packed.py); other subclasses are refused by name.
    * ``dp_mesh_dims`` (FSDP2 over a full SPMD mesh of DTensor parameters): refused.
    """
    from ..ddp.replicate import ReplicatedModule

    modules = members_of(module)
    for m in modules:
        refuse_sharded_again(m)
        if isinstance(m, ReplicatedModule):
            raise ValueError(f"fusedist.fully_shard: {type(m).__name__} is replicated (fusedist.replicate); "
                             "shard the blocks first, or use fully_shard over a 2-D mesh (HSDP)")
    if mesh is not None and process_group is not None:
        raise ValueError("fusedist.fully_shard: pass mesh or process_group, not both")
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "fusedist.fully_shard does not support dp_mesh_dims (FSDP2 over a full SPMD mesh whose parameters are "
            "DTensors): fusedist shards plain parameters over a 1-D mesh. Pass the data-parallel mesh itself "
            "(e.g. mesh['dp']) with plain parameters, or use torch.distributed.fsdp.fully_shard.")
    ignored = {id(p) for p in (ignored_params or ())}
    dims_of: dict = {}  # id(param) -> the dim it is sharded on
    for m in modules:
        dims_of.update(check_params(m, ignored, shard_placement_fn, taken=Held()))
    offload_policy = as_offload_policy(offload_policy)
    mp_policy = as_mixed_precision_policy(mp_policy)
    groups = groups_of(mesh, process_group)
    device = groups.device
    comm = get_communicator(groups.shard, device)
    # HSDP: the replicate group's communicator (Note [replicate all-reduce] in replicate.py)
    replicate_comm = get_communicator(groups.replicate, device) if groups.replicate is not None else None
    # an int: Note [resharding to a smaller group after forward] in post_forward.py
    reshard_after_forward, post_forward = resolve_reshard_after_forward(reshard_after_forward, comm, groups.shard,
                                                                        device)

    params, regs, fqns, borrowed = take_params(module, modules, ignored)
    for owner, idx, (sub, attr), _ in borrowed:
        sub._parameters[attr] = owner.sharded[idx]
    unit = grads = None
    auto = reshard_after_forward is None
    if params:
        name = describe(modules)
        dims = [dims_of[id(p)] for p in params]
        # Note [tensor-parallel parameters] in tensor_parallel.py
        tp = tensor_parallel_specs(name, params, fqns, dims, groups, post_forward, device)
        # Note [all-gather extension] in extension.py
        locals_ = [s.local(p) if s is not None else p for p, s in zip(params, tp or [None] * len(params))]
        ext = extension_specs(name, locals_, fqns, regs, dims, post_forward, comm.world_size, comm.rank, tp)
        unit = ShardedUnit(name, params, regs, fqns, comm, device, mp_policy, offload_policy,
                           reshard_after_forward=True if auto else reshard_after_forward,
                           replicate_comm=replicate_comm, dims=dims, tp=tp, ext=ext,
                           shard_mesh=shard_mesh_of(mesh, groups) if ext is not None else None)
        unit.post_forward = post_forward
        record_mesh(unit, mesh, groups)  # Note [entries read as DTensors] in dtensor_view.py
        grads = UnitGrads(unit, mp_policy.reduce_dtype)
        for i, (p, sp) in enumerate(zip(params, unit.sharded)):
            record_owner(unit, i, p, sp)
            unit._register(i, sp)
        record_slots(unit)
        holder = holder_for(comm, replicate_comm, unit.tp_comm)
        holder.register(unit.sharded, [s is None or s.replicated for s in unit.tp] if unit.tp_comm else None)
        unit.holder = holder  # keeps the holder alive as long as the unit (ownership holds it weakly)
        by_owner: dict = {}
        for owner, idx, reg, _ in borrowed:
            by_owner.setdefault((id(owner), idx), (owner, idx, []))[2].append(reg)
        unit.borrowed = [(owner, idx, Registrations(pairs, modules)) for owner, idx, pairs in by_owner.values()]
        for owner in {id(o): o for o, _, _ in unit.borrowed}.values():
            owner.lend_to(unit)  # Note [lent parameters] in unit.py
    FullyShardState(modules, unit, grads, mp_policy, auto)
    if unit is not None:
        guard_child_calls(unit, modules)  # Note [a unit's module called on its own] in child_calls.py
    # Note [plain units beside tensor-parallel ones] in holder.py
    share_tensor_parallel_holder(modules)
    for m in modules:
        if unit is not None:
            install_state_dict_hooks(m)  # Note [pieces in torch's distributed checkpoint]
        m.__class__ = sharded_class(type(m), FullyShardedModule)
    return module


def _check_bool(name: str, value) -> bool:
    """``value`` as a bool; a numpy bool (``i == n - 1`` over a numpy range) is one too, as
    torch takes it. Others are refused, naming the type with its module ("numpy.int64")."""
    if isinstance(value, bool):
        return value
    cls = type(value)
    if cls.__module__ == "numpy" and cls.__name__ in ("bool", "bool_"):
        return bool(value)
    where = "" if cls.__module__ == "builtins" else f"{cls.__module__}."
    raise TypeError(f"{name} must be a bool, got {where}{cls.__qualname__}")


class UnshardHandle:
    """A pending :meth:`FullyShardedModule.unshard`; ``wait()`` makes the gathered parameters usable.

    As FSDP2's, ``wait()`` waits for the gather in flight, and does nothing once none is in
    flight and the unit is sharded again: a forward of the module already waited for the gather
    and resharded after it (``h = block.unshard(async_op=True); model(x); h.wait()``). It
    used to gather the unit once more there, an all-gather nobody needed, and held the unit's
    parameters gathered until the end of the next backward."""

    def __init__(self, unit=None):
        self._unit = unit  # None: a handle with nothing to wait for (FSDP2's ``UnshardHandle()``)

    def wait(self) -> None:
        unit, self._unit = self._unit, None
        if unit is not None and (unit.is_unsharded or unit.gather_in_flight):
            unit.wait_for_unshard()


class FullyShardedModule:
    """The methods a module gains from :func:`fully_shard` (torch FSDP2's names). Also
    exported as ``FSDPModule``, torch's name for it, so ``isinstance(m, FSDPModule)`` in a
    training script keeps working when its import moves to fusedist."""

    def __new__(cls, *args, **kwargs):
        """``type(sharded)(...)`` (a container's slice, ``type(model)()``) builds a module of the
        original class with its ``__init__``, as FSDP2's (Note [constructing through a sharded class]
        in sharded_class.py)."""
        return original_class(cls, FullyShardedModule)(*args, **kwargs)

    def __copy__(self):
        """``copy.copy``: the original class's object with this module's attributes (Note
        [constructing through a sharded class] in sharded_class.py)."""
        return shallow_copy(self, FullyShardedModule)

    def __reduce_ex__(self, protocol):
        refuse_pickling(self)

    def _fs_state(self) -> FullyShardState:
        return state_of(self)

    def __deepcopy__(self, memo):
        # torch's FSDP2 refuses too; without this, deepcopy failed deep inside on a weak method.
        raise TypeError(
            f"fusedist.fully_shard: a sharded module ({type(self).__name__}) cannot be deep-copied: its "
            "parameters are this rank's pieces, bound to its units and process group. Copy the model "
            "before sharding it, or take its weights with fusedist.fsdp.full_state_dict(model) (or "
            "model.state_dict(), this rank's pieces)"
        )

    def apply(self, fn):
        """``fn`` on every submodule (children first), with whole parameters: the unsharded model's
        ``apply(fn)``, each rank keeping its rows (Note [apply on a sharded model] in module_apply.py)."""
        return apply_whole(self, fn)

    def _fs_states(self, recurse: bool = True):
        mods = self.modules() if recurse else [self]
        # each state once: a group's members share one (Note [a list of modules as one unit] in members.py)
        return list(dict.fromkeys(st for st in (state_of(m) for m in mods) if st is not None))

    @torch.compiler.disable  # its all-gather, traced in a compiled step, failed on every rank (FSDP2's runs)
    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this module's unit (not recursive); with ``async_op`` return a handle to wait on
        (the next forward of the module waits for it anyway)."""
        unit = self._fs_state().unit
        if unit is None:
            return UnshardHandle(None) if async_op else None
        unit.unshard(async_op=True)
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's gathered parameters (not recursive). During the module's own
        forward (called from a hook or a submodule) it does nothing: the rest of that forward
        still reads them, and its end reshards as ``reshard_after_forward`` says. FSDP2 does
        nothing there too when the unit stays gathered after forward (the root by default);
        otherwise it reshards, and a later use in that forward fails on the sharded DTensors.
        Freeing them here failed the rest of the forward on the empty buffer, or computed
        silently with this rank's pieces (an empty output). Likewise during the unit's own
        backward (from a gradient hook), whose end reshards as ``reshard_after_backward`` says;
        there it failed on the empty buffer ("storage of size 0"), as FSDP2's does. A gather
        started by ``unshard(async_op=True)`` and not yet waited for is left in flight, as
        FSDP2's (it frees only what landed): the handle's ``wait()`` still gives the gathered
        parameters it promises, and the next forward uses them."""
        st = self._fs_state()
        if st.unit is not None and not st.in_own_forward() and not st.in_own_backward() \
                and not (st.unit.gather_in_flight and not st.unit.is_unsharded):
            st.unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates the unsharded gradients locally in ``reduce_dtype``, with no
        communication (gradient accumulation); costs one unsharded copy of every unit's
        gradients until the next synchronized backward reduces the sum."""
        for st in self._fs_states(recurse):
            st.requires_all_reduce = bool(requires_gradient_sync)
            if st.grads is not None:  # both switches, as FSDP2 (Note [replicate all-reduce] in replicate.py)
                st.grads.reduce_grads = st.grads.all_reduce_grads = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at run time; a bool only, as FSDP2's. It replaces
        an int given to ``fully_shard``: True then reshards fully after forward, False keeps
        the unit gathered (Note [resharding to a smaller group after forward])."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for st in self._fs_states(recurse):
            st.auto_reshard = False
            if st.unit is not None:
                st.unit.reshard_after_forward = reshard_after_forward
                st.unit.post_forward = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for st in self._fs_states(recurse):
            if st.unit is not None:
                st.unit.reshard_after_backward = bool(reshard_after_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is an iteration's last (torch FSDP2's micro-batching hint:
        only then does it wait for its gradient reductions). Recorded only: every fusedist
        backward finishes its reduce-scatters before it returns (the per-step cross-rank
        check reads them), so under either value the gradients are complete after each
        backward, as FSDP2's are after the last."""
        self._fs_state().is_last_backward = _check_bool("is_last_backward", is_last_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this module's unit (not its submodules') is not gathered in backward, for a
        unit whose backward reads no parameter values (an embedding: its weight gradient needs
        only the weight's shape); saves one all-gather per step. A backward that does read
        them fails on the freed buffer (torch's "out of bounds for storage of size 0") instead
        of computing with it. An activation-checkpoint recompute still gathers, and a unit
        still gathered (``reshard_after_forward=False``) stays so."""
        self._fs_state().unshard_in_backward = _check_bool("unshard_in_backward", unshard_in_backward)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP (2-D mesh): False skips the all-reduce across replicas after each reduce-scatter;
        the reduce-scattered gradients are summed aside, the pieces get no ``.grad``, and the
        next backward with True all-reduces the sum (FSDP2's micro-batching switch; Note
        [replicate all-reduce] in replicate.py). On a 1-D mesh there is no all-reduce (as in
        FSDP2): either value leaves the gradients as they are; the setting is recorded."""
        requires_all_reduce = _check_bool("requires_all_reduce", requires_all_reduce)
        for st in self._fs_states(recurse):
            st.requires_all_reduce = requires_all_reduce
            if st.grads is not None:
                st.grads.all_reduce_grads = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce this module's gradients (not its submodules', as torch) to the sum over ranks
        divided by ``factor`` instead of the world size; e.g. 1.0 when the loss is already
        normalized by the global token count. An fp16 ``reduce_dtype`` still divides by about
        sqrt(factor) before the sum (torch's power of two) and by the rest after it, so the
        fp16 sum stays that much below a plain sum, away from overflow (Note [fp16 reduction]
        in grads.py)."""
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise TypeError(f"factor must be a number, got {type(factor).__name__}")
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor must be positive and finite, got {factor}")
        st = self._fs_state()
        if st.grads is not None:
            st.grads.divide_factor = float(factor)

    @deprecated("Use `set_gradient_divide_factor` instead")
    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Use :py:meth:`set_gradient_divide_factor` instead"""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """True: this module's reduce-scatters use ``sum`` and divide afterwards, never the
        communicator's ``avg`` (FSDP2's switch for zero-copy NCCL transfers). fp16 reduces with
        ``sum`` either way; on gloo ``avg`` is that sum and division already (same result)."""
        enable = _check_bool("enable", enable)
        st = self._fs_state()
        if st.grads is not None:
            st.grads.force_sum = enable

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """Gather these modules' units right after this module's, in forward (overrides the
        recorded order for this module)."""
        self._fs_state().forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """Gather these modules' units when this module's backward begins (overrides the
        reverse forward order for this module)."""
        self._fs_state().backward_prefetch = _states_of(modules)

    # ------------------------------------------------------------ FSDP2's reduction controls
    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: torch.cuda.Stream | None = None):
        """Call ``hook(output)`` with each gradient reduce-scatter of this module's unit (not its
        submodules', as FSDP2) -- on HSDP (a 2-D mesh) after its all-reduce across replicas, as
        FSDP2, and not under ``set_requires_all_reduce(False)``, where FSDP2 skips it too (Note
        [replicate all-reduce] in replicate.py): ``output`` is this rank's result in ``reduce_dtype``, before any
        division left after the sum (fp16, or a divide factor with forced sum) and before the
        pieces' ``.grad`` are made from it, so an in-place change (an all-reduce across
        replicas, a scale) reaches the gradients -- FSDP2's hook on a 1-D mesh. It holds the
        same elements as FSDP2's output in another order: the rank's slice of the unit's flat
        buffer (Note [row-aligned flat layout] in layout.py), not per-parameter dim-0 chunks, and
        a parameter with no gradient here is a zero slot rather than absent; an elementwise
        hook gives FSDP2's gradients. It runs when the reduction has landed, at the same point
        of every rank's backward (Note [unit gradients] in grads.py), so it may issue
        collectives; on CUDA, on ``stream`` if given. ``None`` removes it."""
        if hook is not None and not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        if stream is not None and hook is None:
            raise ValueError("set_all_reduce_hook: a stream was given without a hook to run on it")
        grads = self._fs_state().grads
        if stream is not None and grads is not None and grads.replicate is not None:
            raise ValueError("set_all_reduce_hook: stream cannot be set when using native HSDP (a 2-D mesh), as "
                             "in torch's FSDP2: the hook runs after the all-reduce across replicas")
        if grads is not None:
            grads.all_reduce_hook, grads.all_reduce_hook_stream = hook, stream

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: every trainable parameter of a reduced unit gets ``.grad`` from the reduction,
        also on a rank that computed no gradient for it (its part of the sum is zeros), as
        FSDP2's -- for models whose ranks use different parameters (mixture of experts,
        conditional branches); a unit skipped in forward on every rank is reduced too (zeros),
        once it has run before (FSDP2's condition). fusedist reduce-scatters a unit's whole
        trainable section in either case, so its collectives pair up regardless (Note
        [rank-independent reductions] in grads.py); under False (the default) a parameter
        without a gradient keeps ``.grad`` as it was, and ranks that differ in which
        parameters got one are reported by the per-step check."""
        value = _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        for st in self._fs_states(recurse):
            if st.grads is not None:
                st.grads.reduce_unused = value

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """At most ``max_input_buffers`` gradient reduce-scatters (with their buffers) in flight
        under this module's root; a new one first waits for the oldest. More lets more
        communication overlap backward, at the price of more gradient buffers alive; the
        gradients are the same. Default ``grads.MAX_IN_FLIGHT`` (2; FSDP2's is 1). As in FSDP2
        the largest value set under a root applies; unlike FSDP2, which reads the values once
        at the root's first forward, a later call applies from the next reduction."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for st in self._fs_states(recurse):
            st.max_input_buffers = max_input_buffers

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The event (recorded after the optimizer step) that the next forward's all-gathers
        wait for, once; pass a new one each iteration. FSDP2 waits on it instead of the
        current stream, to drop a false dependency; fusedist's all-gathers follow the current
        stream regardless, so here the current stream waits for the event (an optimizer
        stepped on another stream is seen) and the false dependency stays. On CPU the step has
        finished before forward begins: nothing to wait for, and the event is consumed."""
        st = self._fs_state()
        if st.ctx is not None:
            st.ctx.post_optim_event = event
        else:
            st.post_optim_event = event  # taken by the context if this module becomes the root

    def reset_iter_state(self) -> None:
        """Make the next iteration start clean after an exception aborted a forward or backward
        (on every rank alike: collectives pair up by order): wait for the collectives in
        flight, reshard every unit, forget the iteration's bookkeeping. The failed iteration's
        gradients are lost -- reductions in flight or waiting their turn, no-sync accumulators,
        unsharded gradients -- while ``.grad`` that reductions finished before the exception
        stay: call ``zero_grad()`` and restart a micro-batch sequence. Call it on the root
        (FSDP2's rule). This is FSDP2's documented contract; torch 2.13's own reset keeps the
        unsharded gradients of units whose post-backward had not run (the root's, a no-sync
        accumulation) and adds them into the next reduction. Refused from a hook while the model's
        forward or backward runs (Note [reset during forward or backward] in recovery.py)."""
        st = self._fs_state()
        if st.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root fully_shard module "
                               f"(the outermost one, the first to run forward), not on {type(self).__name__}")
        if st.ctx is not None:
            recovery.refuse_reset_while_running(st.ctx, self)  # Note [reset during forward or backward]
            st.ctx.reset_iteration()

    def _set_unshard_async_op(self, async_op: bool):
        """FSDP2's switch for the forward and backward all-gathers' ``async_op``, for this module
        and its submodules (its effect there: which stream allocates the gathered memory).
        fusedist issues every gather asynchronously on its communicator and waits before the
        unit runs, so either value gives the same results and overlap; recorded, and forward
        passes it to the unit's ``unshard``."""
        value = _check_bool("async_op", async_op)
        for st in self._fs_states():
            st.unshard_async_op = value

    # -------------------------------------------- FSDP2's communication settings (performance)
    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Accepted and recorded; a performance setting only. FSDP2 then gives reduce-scatters
        a process group of their own, to overlap them with all-gathers on the wire; the
        gradients are the same. fusedist runs a unit's gathers and reductions on the one
        communicator of its mesh, which stays so: no group is created, nothing changes."""
        _record_hint(self._fs_states(recurse), "separate_reduce_scatter_group", _check_bool("enable", enable))

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted and recorded; a performance setting only. FSDP2 then allocates its staging
        buffers with the process group's allocator (NCCL zero-copy transfers); the values are
        the same. fusedist gathers straight into each unit's persistent buffer, without
        staging buffers, and takes gradient buffers from torch's allocator, which stays so."""
        _record_hint([self._fs_state()], "allocate_memory_from_process_group", _check_bool("enable", enable))

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Accepted and recorded (``backend`` "NCCL" only, as FSDP2); a performance setting
        only. FSDP2 then puts its all-gather staging buffers in NCCL symmetric memory, for
        NCCL's copy-engine and symmetric-kernel all-gathers; the values are the same (torch's
        own call fails where NCCL symmetric memory is missing, e.g. on gloo). fusedist gathers
        into each unit's own buffer through its communicator, which stays so."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm: only the 'NCCL' backend is supported, got {backend!r}")
        _record_hint([self._fs_state()], "symm_mem", backend)

    def set_custom_all_gather(self, comm) -> None:
        """Refused: FSDP2 hands a custom ``AllGather`` its own output allocation and a process
        group. A fusedist unit gathers straight into its parameters' persistent flat buffer
        through fusedist's communicator (tagged, bounded waits, the ranks' order checked),
        which may not be a torch process group at all, so a custom collective has no place to
        run and accepting it would silently ignore it."""
        raise NotImplementedError(
            "fusedist.fully_shard does not support set_custom_all_gather: a unit gathers with its own collective "
            "into its parameters' persistent buffer. To send fewer bytes, gather in a lower precision with "
            "MixedPrecisionPolicy(param_dtype=...); for a custom all-gather, use torch.distributed.fsdp.fully_shard.")

    def set_custom_reduce_scatter(self, comm) -> None:
        """Refused, for the reasons of :meth:`set_custom_all_gather`: a unit reduce-scatters its
        flat gradient buffer through fusedist's communicator."""
        raise NotImplementedError(
            "fusedist.fully_shard does not support set_custom_reduce_scatter: a unit reduces its flat gradient "
            "buffer with its own collective. To reduce in a lower precision use "
            "MixedPrecisionPolicy(reduce_dtype=...); to post-process each reduce-scatter's output (e.g. an "
            "all-reduce across replicas) use set_all_reduce_hook; for a custom reduce-scatter, use "
            "torch.distributed.fsdp.fully_shard.")

    def check_consistency(self) -> None:
        """Raise :class:`fusedist.RankMismatchError` on every rank unless all ranks have run the
        same forwards, backwards and optimizer steps on this model so far (Note [stage-3 step
        check]). A collective: call it on every rank at the same point, e.g. after the last
        step (the per-step check reports at the next training forward, which the last step
        lacks). ``fusedist.checkpoint.save`` calls it. Nothing to check before the first
        forward, or with ``FUSEDIST_CHECKS=0``."""
        st = self._fs_state()
        watch = st.ctx.watch if st.ctx is not None else None
        if watch is not None:
            st.ctx.follow_tree(full=True)  # (its messages name parameters by their current paths)
            watch.check_now()

    def memory_stats(self) -> dict:
        """Sharded, gathered and scratch bytes (``fusedist.fsdp.memory.memory_stats``)."""
        units = [st.unit for st in self._fs_states() if st.unit is not None]
        return _memory_stats(units, units[0].comm if units else None)

    def _apply(self, fn, *args, **kwargs):
        """``to()``, ``double()``, ``to_empty()``, ...: convert the pieces, then rebuild the unit's
        buffers around them (Note [units built on the meta device] in unit.py)."""
        states = self._fs_states()
        for st in states:
            if st.unit is not None:
                st.unit.reshard()
        st = self._fs_state()
        # Note [converting extension pieces] in extension.py
        stand_ins = put_stand_ins(st.unit) if st.unit is not None else []
        with _conversions_in_place():  # Note [conversions under swap_module_params_on_conversion]
            out = super()._apply(fn, *args, **kwargs)
        if st.unit is not None:
            take_stand_ins(st.unit, stand_ins)
            register_pieces(st, st.unit.repack())
        for st in states:  # after every unit below has repacked (the outermost call's pass is last)
            if st.unit is not None:
                st.unit.relink_borrowed()
        return out


# Note [conversions under swap_module_params_on_conversion]
#     With ``torch.__future__.set_swap_module_params_on_conversion(True)``, ``Module._apply``
#     (``to``, ``to_empty``, ``double``, ...) converts a parameter by ``torch.utils.swap_tensors``
#     of the old ``nn.Parameter`` with a new one: the Python object stays, its contents change.
#     A piece cannot be swapped: the registries that know it (the tied-weight table, the
#     gradient holder, the step watch, the optimizer-state notes) hold weak references to it,
#     and ``swap_tensors`` refuses a tensor with weak references ("Couldn't swap
#     Linear.weight"). What the flag promises -- the same parameter objects, with the
#     converted data, wherever the model's parameters were referenced -- is what the unit's
#     conversion gives without it: ``param.data = converted`` keeps each piece's identity, and
#     ``repack`` then rebuilds the unit's buffers around the new data (Note [units built on the
#     meta device] in unit.py; a conversion torch cannot do in place, e.g. from meta, gives
#     new ``nn.Parameter`` objects that ``repack`` adopts, as without the flag). So while a
#     sharded module converts its subtree the flag is off, and set back as it was afterwards;
#     the subtree's buffers are reassigned either way, and a parameter left out of sharding
#     (``ignored_params``) is converted in place too (a tensor subclass is still swapped, as
#     torch always does for those).
#     torch's FSDP2 works under the flag (its DTensor parameters carry no weak references).


@contextlib.contextmanager
def _conversions_in_place():
    """Turn ``swap_module_params_on_conversion`` off for the duration (Note [conversions under
    swap_module_params_on_conversion]), restoring it after."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(False)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def _record_hint(states, name: str, value) -> None:
    """Record a performance-only FSDP2 setting fusedist has no use for (readable in
    ``state.comm_hints``), so a run shows what it was asked for."""
    for st in states:
        st.comm_hints[name] = value


def _states_of(modules) -> list:
    """The states of ``modules``; anything else is a ``ValueError`` naming it, as FSDP2's (a
    string, None or a number used to fail on a weak reference instead)."""
    out = []
    for m in modules:
        st = state_of(m) if isinstance(m, nn.Module) else None
        if st is None:
            raise ValueError(f"expected modules sharded with fusedist.fully_shard, got {type(m).__name__}: {m!r:.80}")
        out.append(st)
    return out
