"""``fusedist.DistributedDataParallel``: a drop-in for ``torch.nn.parallel.DistributedDataParallel``."""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable
from torch.utils.hooks import RemovableHandle

from ..ownership import data_parallel_owner, register_data_parallel, register_step_watch, register_wrapped_module
from .._timeline import Timeline
from ..comm import get_communicator
from . import dcp_names
from . import join as _join
from .agreement import LayoutAgreementCheck, check_layout_agrees, check_model_agrees, check_reduction_agrees
from .arguments import (buffer_sync_settings, check_device_ids, group_of, module_device,
                        reduce_dtype_from_mixed_precision, refuse_dtensors, refuse_mixed_precision_casts)
from .buffer_broadcast import BufferBroadcast
from .buffer_hook import BufferCommHooks
from .comm_hook import register_builtin_comm_hook, register_comm_hook
from .compiled_autograd import refuse_compiled_autograd_at_forward
from .config import DDPConfig, first_bucket_cap
from .copied_last import copy_parameters_last
from .copies import construction_checks, copy_wrapper, pickled_wrapper, refuse_shallow_copy
from .destroyed_group import refuse_forward_on_destroyed_group
from .grad_hook import still_in_order
from .logging_data import bucket_sizes
from .module_swap import swap_module
from .prepared import arm_again_through
from .reducer import Reducer
from .sparse import SparseGradients, sparse_parameter_ids
from .static_graph import ArrivalCounts
from . import succession
from . import torch_wrap
from .torch_surface import TorchDDPSurface
from .trainable import TrainableTracker
from ..reliability import checks_enabled
from ..reliability import optimizer_guard
from ..reliability import engine_watch  # (the module: it imports ddp.events, see the test of import orders)

# Note [a module wrapped again]
#     A parameter has one data-parallel owner: the newest wrapper built over it. Wrapping a
#     module again (after assigning new Parameters into it, Note [parameters replaced after
#     wrapping] in trainable.py, or by accident) would otherwise leave the older wrapper's
#     gradient hooks in place until garbage collection: both would reduce the same gradients
#     and each would miss the parameters only the other holds. So the newer wrapper retires
#     the older ones over any of its parameters: their hooks are removed, and a forward
#     through one of them raises, saying which wrapper took over.
#
#     Except a wrapper nested inside the newer one's module (``DDP(nn.Sequential(DDP(a), b))``,
#     ``DDP(DDP(m))``) over the same process group: torch's DDP trains it, each wrapper
#     averaging the gradients once more, which leaves the average unchanged. Here the inner
#     one becomes a plain pass-through to its module (``_nested``): the outer reduces every
#     gradient once, with the same result. Over another group the averages would differ, and
#     that stays refused.
#
#     A sharded optimizer built over the older wrapper follows the newer one when it can (Note
#     [an optimizer over a module wrapped again] in succession.py).

# Note [a dropped wrapper goes at once]
#     Programs drop wrappers: ``opt = AdamW(DistributedDataParallel(net).parameters())``, a model
#     wrapped again after its first wrapper was dropped. torch's DDP then trains the plain module
#     (or the newer wrapper) as if the dropped one had never been. Here the parameters' owner
#     (fusedist/ownership.py, held weakly) is the wrapper while it lives, and what the optimizer's
#     step guard and a newer wrapper find depends on it. A wrapper reaching itself (its engine's
#     layout listener was a bound method of it) lived on until a garbage collection, which runs
#     at different times on different ranks: one rank found the dropped wrapper and refused the
#     step ("not synchronized") while another trained plainly. So nothing the wrapper holds
#     refers back to it: dropping the last reference frees it at once, on every rank at the same
#     point of the program, and its engine's gradient hooks come off with it (the engine lets go
#     of its observers, so it is freed too unless an observer's pending check still refers to it:
#     that goes at a collection, with nothing left on the parameters).


def _supersede_owners(params, newer) -> list:
    """Retire the older wrappers over ``params`` (Note [a module wrapped again]); returns them,
    nested ones included, for :func:`succession.take_over` once ``newer``'s reducer exists."""
    older = {id(o): o for o in map(data_parallel_owner, params) if o is not None and o is not newer}
    inside = {id(m) for m in newer.module.modules()}
    for wrapper in older.values():
        if id(wrapper) in inside and wrapper.process_group is newer.process_group:
            wrapper.reducer.remove_hooks()
            wrapper._nested = True
            continue
        wrapper._retire(
            f"fusedist.DistributedDataParallel (rank {wrapper.rank}): this wrapper no longer reduces "
            f"gradients: its module's parameters were wrapped again by a newer DistributedDataParallel "
            f"(of a module of type {type(newer.module).__name__}), which now owns them. Use the newer "
            "wrapper (a wrapper nested inside another one must use the same process group)"
        )
    return list(older.values())


_BOOKKEEPING_RUNS_EAGERLY = (
    "fusedist.DistributedDataParallel's forward runs its bookkeeping (step checks, buffer broadcast, join) "
    "eagerly, one graph break before the module, so torch.compile(ddp_model, fullgraph=True) cannot capture it "
    "whole; compile the module inside the wrapper instead: "
    "fusedist.DistributedDataParallel(torch.compile(model, fullgraph=True)) (or drop fullgraph=True)")


class DistributedDataParallel(TorchDDPSurface, BufferBroadcast, BufferCommHooks, nn.Module, Joinable):
    """Data parallelism with bucketed gradient all-reduce overlapped with backward.

    Same use as torch's: wrap the model, call it, ``loss.backward()`` returns averaged
    gradients. Differences that users see:

    * construction verifies that every rank holds the same parameters (names, shapes, dtypes)
      and raises on *every* rank, naming the first differing parameter and the ranks;
    * gradients live in flat per-dtype buffers (``param.grad`` are views, no copies);
    * ``reduce_dtype`` reduces in a narrower dtype (e.g. bf16) to halve the bytes on the wire;
    * ``FUSEDIST_TIMELINE=<path>`` writes a per-rank Chrome trace of bucket events.

    Args:
        module: the model (on one device).
        device_ids, output_device, dim: as torch's for a single-device module. On CUDA,
            ``device_ids`` must name the module's device, and then the forward's inputs are
            copied to it as torch's DDP copies them; on CPU it must be None.
        process_group: the data-parallel group (default: the world).
        device_mesh: as torch's: a 1-D ``DeviceMesh`` whose group is the data-parallel group
            (instead of ``process_group``). DTensor parameters (tensor parallelism) are refused:
            ``fully_shard`` composes with it (Note [DDP over a tensor-parallel model]).
        bucket_cap_mb, first_bucket_cap_mb, bucket_cap_mb_list, find_unused_parameters,
            gradient_as_bucket_view, reduce_dtype, static_graph: see
            :class:`~fusedist.ddp.config.DDPConfig`.
        forward_sync_buffers, broadcast_buffers, init_sync: as torch's (``_buffer_sync_settings``):
            buffers broadcast from rank 0 at forwards unless ``forward_sync_buffers=False``
            (or the deprecated ``broadcast_buffers=False``, which also skips them at
            construction); ``init_sync=False`` skips the construction broadcast, the ranks
            are then trusted to hold the same values (their names and shapes are still compared).
        check_reduction, batched_grad_copy, ...: torch options that change only how
            torch schedules its own reduction, accepted for compatibility (the bucket layout is
            always rebuilt once from the observed order; the division is folded into the
            gradient copies already).
        mixed_precision: torch's experimental ``_MixedPrecision``; its ``reduce_dtype`` is
            ``reduce_dtype``; ``param_dtype``/``buffer_dtype`` only as the tensors' own dtype
            (a cast that changes nothing).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids=None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: Optional[bool] = None,
        init_sync: bool = True,
        process_group=None,
        bucket_cap_mb: Optional[float] = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Optional[list] = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: Optional[bool] = None,
        *,
        first_bucket_cap_mb: Optional[float] = None,
        reduce_dtype: Optional[torch.dtype] = None,
        **torch_options,
    ):
        # (every torch parameter, in torch's order, so that torch's positional calls bind alike;
        # check_reduction, delay_all_reduce_named_params, param_to_hook_all_reduce,
        # skip_all_reduce_unused_params and batched_grad_copy are TORCH_ONLY_OPTIONS: ignored)
        super().__init__()
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError("fusedist.DistributedDataParallel: delay_all_reduce_named_params and "
                             "param_to_hook_all_reduce need to be set at the same time (as torch's DDP "
                             "requires; fusedist reduces those parameters with the others either way)")
        forward_sync, init_sync_buffers = buffer_sync_settings(broadcast_buffers, forward_sync_buffers)
        reduce_dtype = reduce_dtype_from_mixed_precision(mixed_precision, reduce_dtype)
        unknown = set(torch_options)
        if unknown:
            raise TypeError(f"fusedist.DistributedDataParallel got unexpected keyword argument(s) {sorted(unknown)}")
        if not dist.is_initialized():
            raise RuntimeError(
                "fusedist.DistributedDataParallel: torch.distributed is not initialized; call "
                "fusedist.init_distributed() (under torchrun) before wrapping the model"
            )
        process_group = group_of(process_group, device_mesh)
        dcp_names.install()  # Note [checkpoint names through the DDP wrapper]
        self.device_mesh = device_mesh
        self.module = module
        self.config = DDPConfig(
            bucket_cap_mb=25.0 if bucket_cap_mb is None else bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap(bucket_cap_mb, first_bucket_cap_mb),
            bucket_cap_mb_list=bucket_cap_mb_list,
            broadcast_buffers=forward_sync,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            reduce_dtype=reduce_dtype,
            static_graph=bool(static_graph),
        )
        # torch's DDP holds the default group itself, not None: ``model.process_group`` is a
        # group to pass on (to ZeroRedundancyOptimizer, to collectives). Held weakly: Note [the
        # process group, held weakly] in torch_surface.py.
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.dim = dim
        self.device = module_device(module)
        check_device_ids(self.device, device_ids, output_device)
        self._init_surface(module, device_ids, output_device)  # torch's placement attributes, the ignored names
        self._init_torch_settings(bucket_cap_mb, bucket_cap_mb_list, mixed_precision,
                                  skip_all_reduce_unused_params, batched_grad_copy)
        refuse_dtensors(self.synced_parameters(), self.synced_buffers())  # Note [DDP over a tensor-parallel model]
        refuse_mixed_precision_casts(mixed_precision, self.synced_parameters(), self.synced_buffers())
        self.comm = get_communicator(process_group, self.device)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size

        named = [(n, p) for n, p in self.synced_parameters() if p.requires_grad]
        for name, p in named:
            if not (p.dtype.is_floating_point or p.dtype.is_complex):
                raise TypeError(
                    f"fusedist.DistributedDataParallel (rank {dist.get_rank()}): parameter '{name}' has "
                    f"dtype {p.dtype}; only floating-point and complex parameters can be trained; set "
                    "requires_grad=False to keep it as broadcast state"
                )
        # Note [sparse gradients] in sparse.py: averaged by the wrapper, outside the buckets;
        # frozen ones too, which may be unfrozen later (Note [sparse weights frozen at wrapping])
        sparse = sparse_parameter_ids(module)
        every_sparse = [(n, p) for n, p in self.synced_parameters() if id(p) in sparse]
        self._sparse = SparseGradients([p for _, p in every_sparse], [n for n, _ in every_sparse], self.comm)
        named = [(n, p) for n, p in named if id(p) not in sparse]
        checks = construction_checks()  # Note [copies of the wrapper] in copies.py
        if checks:
            check_model_agrees(self)
        # checked once more at the first synchronized forward (Note [reduction settings across
        # ranks] in agreement.py)
        self._reduction_check_due = checks and self.world_size > 1
        if init_sync:
            self._broadcast_state(buffers=init_sync_buffers)

        self._buffer_dicts = self._find_buffer_dicts()
        self.timeline = Timeline.from_env(self.rank)
        self._superseded_by: Optional[str] = None
        self._nested = False  # inside a newer wrapper that reduces for it (Note [a module wrapped again])
        older = _supersede_owners([p for _, p in named], self)  # Note [a module wrapped again]
        torch_wrap.quiet_torch_wrappers_inside(module, self.process_group, self.rank)  # (Note in torch_wrap.py)
        self.reducer = Reducer(
            [p for _, p in named], [n for n, _ in named], self.comm, self.config, self.device, self.timeline
        )
        if not named:
            self._sparse.reducer = self.reducer  # Note [sparse gradients] in sparse.py
        self._bucket_sizes_at_construction = bucket_sizes(self.reducer.layout.buckets)  # (logging_data.py)
        # ZeroRedundancyOptimizer and the optimizer step guard find the wrapper of their params.
        register_data_parallel([p for _, p in named], self)
        register_wrapped_module([p for _, p in self.synced_parameters()], self)  # frozen ones too
        # [reliability] the engine's observer: step counters, the per-step cross-rank check
        # and the stall-report context (fusedist/reliability/engine_watch.py).
        self.watch = engine_watch.StepWatch(self.reducer)
        self.reducer.observers.append(self.watch)
        # Note [a dropped wrapper goes at once]: its engine goes with it
        weakref.finalize(self, succession.release_engine, weakref.ref(self.reducer)).atexit = False
        # an optimizer holding the ignored (rank-local) parameters steps them under this watch,
        # not as parameters no model synchronizes (Note [parameters and buffers DDP ignores])
        register_step_watch([p for _, p in self.ignored_parameters()] + self._sparse.params, self.watch)
        # Note [trainable set changes]: requires_grad toggled after wrapping is followed.
        self.reducer.tracker = TrainableTracker(module, self)
        self._no_sync_depth = 0  # 0: backwards reduce (require_backward_grad_sync)
        self._buffers_due = True  # the first forward broadcasts (Note [when buffers are broadcast])
        self._comm_hook: Optional[str] = None  # the torch hook registered, by name (register_comm_hook)
        self._param_waiters: list = []  # Note [hooks inside compiled modules]
        self._join_config = _join.DISABLED  # set by a join context (Note [joined ranks] in join.py)
        self._join_state = None
        succession.take_over(older, self)  # Note [an optimizer over a module wrapped again] in succession.py
        torch_wrap.listen()  # Note [torch's DDP over a fusedist wrapper] in torch_wrap.py
        # [reliability] bucket layouts compared across ranks when built and when rebuilt;
        # optimizer.step() misuse caught on the rank that makes it.
        if checks:
            check_layout_agrees(self.comm, self.reducer.layout)
        self.reducer.layout_listeners.append(LayoutAgreementCheck(self.comm))  # (Note [a dropped wrapper goes at once])
        if checks_enabled():
            optimizer_guard.install()
        # what a copy does not take from the original (Note [what a copy keeps] in copies.py)
        self._names_at_construction = frozenset(self.__dict__) | {"_names_at_construction"}

    def _retire(self, reason: str) -> None:
        """Stop reducing gradients for good: the hooks come off and a forward through this
        wrapper raises ``reason`` (the first one given stays). For whoever retires a wrapper --
        a newer wrapper over its parameters (Note [a module wrapped again]), a framework's
        teardown -- instead of reaching into the engine."""
        succession.retire(self, reason)

    def _release_gradient_holder(self, holder) -> None:
        """``holder`` (a stage-2 optimizer) was retired: average into ``p.grad`` again if this
        wrapper reduced into it (``fusedist.ownership.release``)."""
        succession.release_holder(self, holder)

    def __setattr__(self, name, value):
        # (Note [the wrapped module replaced] in module_swap.py, once the wrapper is built)
        if name == "module" and "reducer" in self.__dict__:
            swap_module(self, value, super().__setattr__)
        else:
            super().__setattr__(name, value)

    # ------------------------------------------------------------------ copies
    def __deepcopy__(self, memo):
        """Note [copies of the wrapper] in copies.py."""
        if self.device_mesh is None and self.process_group is None:  # Note [the process group, held weakly]
            raise RuntimeError(
                f"fusedist.DistributedDataParallel (rank {self.rank}): cannot copy this model: its process group "
                "was destroyed (torch.distributed.destroy_process_group()), so the copy would have no group to "
                "reduce over; copy model.module (or load model.state_dict() into a new model) and wrap it on a "
                "live group")
        return copy_wrapper(self, memo)

    def __reduce_ex__(self, protocol):
        """Note [a pickled wrapper] in copies.py: ``torch.save(model)`` over the default group."""
        return pickled_wrapper(self)

    def __copy__(self):
        refuse_shallow_copy(self)

    # ------------------------------------------------------------------ use
    def forward(self, *args, **kwargs):
        if self._nested:  # Note [a module wrapped again]: the outer wrapper does the work
            return self.module(*args, **kwargs)
        args, kwargs = self._inputs_on_device(args, kwargs)  # Note [inputs moved to the module's device]
        # Note [bookkeeping outside compiled graphs]: only the module's own forward is traced.
        compiling = torch.compiler.is_compiling()
        if self._before_forward(compiling):
            return _join.run_module(self, args, kwargs)
        out = self.module(*args, **kwargs)
        if not compiling and torch.is_grad_enabled():
            before = RemovableHandle.next_id
            arm_again_through(self.reducer, out, sync=self._no_sync_depth == 0)
            if self._sparse and self._no_sync_depth == 0:
                self._sparse.arm(out)
            if self._buffer_hook_due:  # (after the arming: its futures are waited for after the reduction)
                self._buffer_hook_after_forward(out)  # Note [a buffer hook's futures] in buffer_futures.py
            reducer = self.reducer  # Note [the user's gradient hooks first] in grad_hook.py
            reducer._hooks_ordered = still_in_order(reducer._hooks_ordered, before)
        elif self._buffer_hook_due:
            self._buffer_hook_after_forward()  # (POST_FORWARD: Note [a buffer communication hook] in buffer_hook.py)
        return out

    # Note [bookkeeping outside compiled graphs]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # When the wrapper itself is compiled (``torch.compile(ddp_model)``), dynamo traced what a
    # forward does before the module runs -- the step checks, the buffer broadcast through the
    # communicator, the join exchange. None of it is graph material: it broke the graph inside
    # the communicator, whose frames dynamo then guarded on the collective's tag and sequence
    # number, so every step recompiled them until dynamo's recompile limit ("hit
    # config.recompile_limit" warnings, one compile per step for the first eight). It runs
    # eagerly here, one graph break before the module; ``traced`` says whether the forward
    # around it is being compiled (Note [hooks inside compiled modules]). Under
    # ``fullgraph=True`` that break is an error; the reason dynamo prints with it says the way
    # that compiles whole (torch's own DDP fails there too, unless its Python reducer is chosen).
    @torch.compiler.disable(reason=_BOOKKEEPING_RUNS_EAGERLY)
    def _before_forward(self, traced: bool) -> bool:
        """Everything a forward does before the module runs; True when a join context is
        active and the module must run through :func:`_join.run_module`."""
        if self._superseded_by is not None:
            raise RuntimeError(self._superseded_by)
        refuse_forward_on_destroyed_group(self)  # Note [a forward after its group was destroyed]
        if self._buffer_futures is not None:  # not waited for by a backward (Note [a buffer hook's futures])
            self._wait_for_buffer_futures()
        if torch.is_grad_enabled():
            refuse_compiled_autograd_at_forward(type(self).__name__)
            self._synced_forwards += self._no_sync_depth == 0  # Note [torch's DDP logging data]
            if traced:
                self._sparse.refuse_compiled(self.rank)
        if self._join_config.enable and torch.is_grad_enabled():
            self._refuse_buffer_hook_in_join()
            _join.before_forward(self)  # uneven inputs (Note [joined ranks] in join.py)
            self._wait_for_params(traced)
            return True
        sync_buffers, grad = self._buffers_due, torch.is_grad_enabled()
        # Note [when buffers are broadcast] in buffer_broadcast.py
        self._buffers_due = grad and self._no_sync_depth == 0
        if grad and self._reduction_check_due and self._no_sync_depth == 0:
            self._reduction_check_due = False
            check_reduction_agrees(self)  # Note [reduction settings across ranks] in agreement.py
        if grad:
            self.reducer.check_previous_backward()  # Note [interrupted backward]
            # Before this step's first collective (observers read the last step's checks).
            self.reducer.prepare_forward(sync=self._no_sync_depth == 0)
        if self._buffer_hook_due:  # (left by a forward whose module raised)
            self._buffer_hook_due = False
        tree_checked = sync_buffers and self.config.broadcast_buffers
        if tree_checked:
            self.reducer.tracker.find_inserted()  # their buffers too (Note [submodules inserted into a container])
            buffers = self._module_buffers()
            if buffers:
                self._sync_buffers_at_forward(buffers)  # Note [a buffer communication hook] in buffer_hook.py
        if grad:
            self.reducer.tracker.observe(self.reducer, tree_checked)  # Note [trainable set changes]
        self._wait_for_params(traced)
        return False

    # Note [hooks inside compiled modules]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # ZeroRedundancyOptimizer waits for each bucket's parameter all-gather in a forward
    # pre-hook of the modules that use it, installed at its first step -- after the first
    # forward compiled the model, if it is compiled. A graph dynamo compiled before a hook
    # existed can keep running without it (dynamo does not guard on module hooks), and then
    # the forward reads parameters the all-gather is still writing (parity with AdamW was lost
    # within a few steps, for each way of compiling). So the waiters
    # registered here run before the module's forward, outside any graph (a disabled function
    # is always called, eagerly, also from inside a compiled DDP forward), and wait for every
    # all-gather when the forward is compiled -- correct, without the overlap of waiting
    # layer by layer, which an eager forward keeps. ``traced``: this forward is being
    # compiled (the DDP wrapper itself is compiled). Compiled submodules are looked for at
    # the optimizer's first step; one compiled later is traced with the hooks in place, and
    # they fire (tests/test_compile.py: exact parity with per-layer and whole-model compile).
    def add_param_waiter(self, waiter) -> None:
        """Call the bound method ``waiter(traced: bool)`` before every forward of the module
        (held weakly: it goes with its owner). A waiter comes with hooks that wait as they are copied: the
        module's parameters are copied after them (Note [a copy of the inner module under overlapped gathers])."""
        self._param_waiters.append(weakref.WeakMethod(waiter))
        copy_parameters_last(self.module)

    @torch.compiler.disable
    def _wait_for_params(self, traced: bool) -> None:
        for ref in list(self._param_waiters):
            waiter = ref()
            if waiter is None:
                self._param_waiters.remove(ref)
            else:
                waiter(traced)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally for backward passes whose forward runs in this context;
        the first synchronized backward afterwards reduces the accumulated sum."""
        synced = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = synced

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch's flag: whether the backwards of forwards run now reduce gradients (False in
        ``no_sync()``, which restores it on exit, as torch's). Scripts set it themselves
        (nanoGPT: ``model.require_backward_grad_sync = micro_step == last``)."""
        return self._no_sync_depth == 0

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._no_sync_depth = 0 if value else 1

    # torch's read-only views of the constructor's settings
    find_unused_parameters = property(lambda self: self.config.find_unused_parameters)
    static_graph = property(lambda self: self.config.static_graph)
    gradient_as_bucket_view = property(lambda self: self.config.gradient_as_bucket_view)

    # ------------------------------------------------------------------ torch's hook API
    def register_comm_hook(self, state, hook) -> None:
        """torch's DDP communication hooks. The three that only average --
        ``default_hooks.allreduce_hook``, ``fp16_compress_hook`` and ``bf16_compress_hook`` --
        map onto fusedist's own fused bucket reduction (``reduce_dtype``: cast, divide, sum,
        cast back, as those hooks do); their ``state`` is the hooks' process group, None or
        this model's. Any other hook (PowerSGD, quantization, user code) is called with each
        ready bucket as torch calls it, ``state`` passed through (Note [communication hooks]
        in comm_hook.py). Once per model, before ZeRO stage 2 or a ``reduce_dtype``, as each
        of those decides the reduction itself."""
        register_comm_hook(self, state, hook)

    def register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch's ``dist.BuiltinCommHookType``: ALLREDUCE (the default) or FP16_COMPRESS."""
        register_builtin_comm_hook(self, comm_hook_type)

    # ------------------------------------------------------------------ uneven inputs
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """As torch's: a context manager for ranks with different numbers of batches. A rank
        that runs out shadows the others' collectives (zero gradients, the same buckets, its
        SyncBatchNorm layers with an empty batch) until every rank is out; then the model of
        the last rank to finish is broadcast to all. ``divide_by_initial_world_size=False``
        averages over the ranks still training instead. ``throw_on_early_termination=True``
        raises on every rank as soon as one runs out. With an optimizer that communicates
        (ZeroRedundancyOptimizer) use ``fusedist.Join([model, optimizer], ...)`` (or torch's
        ``Join``). Note [joined ranks] in ``fusedist/ddp/join.py``."""
        self._sparse.refuse_join(self.rank)
        return _join.Join([self], enable, throw_on_early_termination,
                          divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        """torch's Joinable protocol: the hook that shadows this model on a joined rank."""
        self._sparse.refuse_join(self.rank)
        return _join.DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.comm.device

    @property
    def join_process_group(self):
        return self.process_group

    def _set_static_graph(self) -> None:
        """torch's (private) way to declare a static graph after construction, as
        ``static_graph=True`` does: the next synchronized backward counts the gradient arrivals
        (Note [gradients that arrive twice] in static_graph.py)."""
        if self.reducer.in_backward:
            raise RuntimeError("fusedist.DistributedDataParallel: _set_static_graph was called during backward")
        self.config.static_graph = True
        if self.reducer.arrivals is None:
            self.reducer.arrivals = ArrivalCounts()

    def check_consistency(self) -> None:
        """Raise :class:`fusedist.RankMismatchError` on every rank unless all ranks have run the
        same forwards, backwards and optimizer steps on this model so far, and the replicated
        parameters hold the same values (Note [parameter check] in reliability/param_check.py;
        not with ``FUSEDIST_PARAM_CHECK_EVERY=0``). A collective: call
        it on every rank at the same point, e.g. after the last step of a run (the per-step
        check reports a divergence at the next training forward, which the last step lacks).
        ``fusedist.checkpoint.save`` calls it before writing anything. Nothing is checked with
        ``FUSEDIST_CHECKS=0``."""
        self.reducer.check_previous_backward()  # an interrupted backward is reset or reported first
        self.watch.check_now(self.reducer)

    def comm_stats(self) -> dict:
        """Timing of the last synchronized backward: ``backward_us``, ``comm_span_us`` (first
        launch to last bucket done), ``exposed_comm_us`` (the part after backward compute
        ended), ``hidden_fraction`` and ``first_launch_before_last_grad`` (overlap proof);
        ``buckets_finished_in_backward`` (finished by gradient hooks, before backward ended),
        ``peak_grad_bytes`` / ``grad_bytes`` (full-gradient memory held at most / in all)."""
        return dict(self.reducer.last_stats)

    @property
    def buckets(self):
        return self.reducer.layout.buckets

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Like torch DDP's, but also accepts a state dict saved from the bare module (keys
        without the ``module.`` prefix)."""
        if assign:
            raise ValueError(
                "fusedist.DistributedDataParallel.load_state_dict(assign=True) would replace the "
                "parameters the gradient hooks are attached to; load with assign=False"
            )
        keys = list(state_dict.keys())
        # Bare when no key is one of this wrapper's own: a module whose own child is named
        # ``module`` has bare keys that start with "module." too.
        own = _state_dict_keys(self)
        if keys and not any(k in own for k in keys) and any("module." + k in own for k in keys):
            metadata = getattr(state_dict, "_metadata", None)
            state_dict = OrderedDict(("module." + k, v) for k, v in state_dict.items())
            if metadata is not None:
                state_dict._metadata = OrderedDict(
                    (("module." + k) if k else "module", v) for k, v in metadata.items()
                )
        return super().load_state_dict(state_dict, strict=strict)


def _state_dict_keys(module) -> set:
    """The keys ``module.state_dict()`` gives, without running its state_dict hooks: a load reads them only to
    tell a bare module's keys, and torch's DDP runs no user hook of the save on a load."""
    keys: dict = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        sub._save_to_state_dict(keys, f"{path}." if path else "", True)
    return set(keys)
