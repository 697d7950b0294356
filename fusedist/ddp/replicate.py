"""``fusedist.replicate``: torch's composable ``replicate`` (the DDP torchtitan applies) on
fusedist's DistributedDataParallel engine.

Note [replicate without a wrapper]
----------------------------------
``torch.distributed._composable.replicate(module, **ddp_kwargs)`` data-parallelizes a module in
place: the module stays what it was -- its own submodules, state-dict keys without a
``module.`` prefix, its methods -- and gains ``set_requires_gradient_sync`` and
``register_comm_hook``. torch attaches a DistributedDataParallel over the module's parameters
to forward hooks; so does this, with fusedist's engine: a ``DistributedDataParallel`` over the
module, kept in the module's ``__dict__`` (not a submodule: it is in none of ``modules()``,
``parameters()`` or ``state_dict()``; :func:`wrapper_of` finds it), whose pre-forward
bookkeeping (the per-step checks, ZeRO's parameter waits, inputs moved to ``device_id``) runs
in a forward pre-hook. A hook, not an override of ``forward``: a ``forward`` replaced on the
instance (Accelerate wraps ``model.forward`` in autocast that way) would skip an override, and
the gradients would silently go unsynchronized. The module's class becomes a subclass
``(ReplicatedModule, cls)`` for the methods.

When it is built. At the first forward, as torch builds its own: the module may still be
moved or converted after ``replicate`` (``model.to(device)``; torchtitan applies its
parallelisms to a model on the meta device, then ``to_empty`` and ``init_weights``), and
construction then compares the model across ranks and broadcasts rank 0's parameters -- a
checkpoint loaded into the module before it included. A ``ZeroRedundancyOptimizer`` made
before the first forward builds it (:func:`build_pending`): it shards along the engine's
buckets.

Submodules sharded by ``fully_shard`` are left out, as torch's replicate leaves out FSDP2's:
their units gather, reduce-scatter and check their own parameters, the engine reduces the
rest (the replicated module itself may not be a ``fully_shard`` module: refused, as by torch).
Replicated submodules (nested ``replicate``) are left to their own engines likewise: torch's two
DDPs would both reduce them, to the same average; two engines here would retire each other's hooks.

Uneven inputs. torch's replicated module is no ``Joinable``: ``Join([model])`` fails there
("no attribute 'join_hook'"), and a rank that runs out of data hangs the others. Here the
replicated module is one, served by its engine: ``fusedist.Join([model])`` (``[model,
optimizer]`` with a ZeroRedundancyOptimizer; or torch's ``Join``) shadows the engine's
collectives on a joined rank as for the wrapper (Note [joined ranks] in join.py), and the
forward hooks do what the wrapper's forward does under the context (the SyncBatchNorm layers
it runs are recorded for the joined ranks to replay).

Buffers are not synchronized, as with torch's replicate (its DDP is built over a
``ParameterList``, so there are none to broadcast: each rank keeps its own BatchNorm running
statistics). ``forward_sync_buffers=True`` broadcasts rank 0's buffers at each training
forward, as the wrapper does by default.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
import weakref

from . import join as _join
from .._process_hooks import install_module_registration_hook, install_parameter_registration_hook
from ..ownership import register_step_watch, release
from ..reliability import checks_enabled, optimizer_guard
from .prepared import arm_again_through

__all__ = ["replicate", "ReplicatedModule", "wrapper_of", "build_pending"]

_STATE = "_fusedist_replicate"
# replicated modules whose engine is not built yet (Note [replicate without a wrapper]: built at
# the first forward, or by a ZeroRedundancyOptimizer over their parameters). The modules, not
# their parameters: ``to_empty`` replaces the meta parameters with new ones.
_PENDING: weakref.WeakSet = weakref.WeakSet()


class _ReplicateState:
    """The engine of one replicated module, and what builds it when it is still pending."""

    def __init__(self, module: nn.Module, ignored_modules: set, kwargs: dict):
        self.module = module
        self.ignored_modules = ignored_modules
        self.kwargs = kwargs
        self.ddp = None
        self.requires_gradient_sync = True
        self.comm_hooks: list = []
        self.pending_watch = _PendingWatch(self)
        self._members: "weakref.WeakSet | None" = None  # the modules watch_assigned follows
        self.watch_pending()

    def watch_pending(self) -> None:
        """Have the optimizer step guard refuse steps over the parameters while the engine is not
        built (Note [a step before the first forward]); again after ``_apply`` (``to_empty`` makes
        new Parameters)."""
        if self.ddp is None:
            register_step_watch(self._engine_params(self.module), self.pending_watch)
            self._members = None

    def _engine_params(self, root: nn.Module) -> list:
        """The parameters under ``root`` that the engine will reduce (the left-out modules' excepted)."""
        left = self.ignored_modules | _fully_shard_submodules(root) | _replicated_submodules(root)
        left_ids = {id(p) for m in left for p in m.parameters()}
        return [p for p in root.parameters() if id(p) not in left_ids]

    def watch_assigned(self, module: nn.Module, param=None, submodule=None) -> None:
        """``param`` or ``submodule`` is being registered into ``module``: watched when ``module``
        is one whose parameters the engine will reduce (Note [assigned before the first forward])."""
        if self.ddp is not None:
            return
        if self._members is None:
            left = self.ignored_modules | _fully_shard_submodules(self.module) | _replicated_submodules(self.module)
            left_ids = {id(m) for top in left for m in top.modules()}
            self._members = weakref.WeakSet(m for m in self.module.modules() if id(m) not in left_ids)
        if module not in self._members:
            return
        if param is not None:
            register_step_watch([param], self.pending_watch)
        if submodule is not None:
            self._members = None  # (found again with the submodule's tree, once it is registered)
            if not isinstance(submodule, ReplicatedModule):
                register_step_watch(self._engine_params(submodule), self.pending_watch)

    def build(self):
        return self.ddp if self.ddp is not None else self._build()

    @torch.compiler.disable  # the first forward of a compiled module builds it: eagerly, not traced
    def _build(self):
        from .wrapper import DistributedDataParallel

        module = self.module
        on_meta = [n for n, p in module.named_parameters() if p.is_meta]
        if on_meta:
            raise RuntimeError(
                f"fusedist.replicate({_class_name(module)}): parameters {on_meta[:4]} are still on the meta "
                "device; materialize them (module.to_empty(device=...) and their initialization) before the "
                "first forward or the ZeroRedundancyOptimizer")
        kwargs = dict(self.kwargs)
        forward_sync = kwargs.pop("forward_sync_buffers", False)
        kwargs.pop("broadcast_buffers", None)  # (torch's replicate passes it to a DDP without buffers)
        init_sync = kwargs.pop("init_sync", True)
        device_id = kwargs.pop("device_id", None)
        if device_id is not None and torch.device(device_id if not isinstance(device_id, int) else
                                                  f"cuda:{device_id}").type != "cpu":
            kwargs["device_ids"] = [device_id]
        left_out = self.ignored_modules | _fully_shard_submodules(module) | _replicated_submodules(module)
        _refuse_dtensors(module, left_out)
        # By identity, under the names the engine knows them by: a parameter tied between a left-out
        # module and another one is left out (torch's), whichever name named_parameters() keeps.
        left = {id(t) for m in left_out for t in [*m.parameters(), *m.buffers()]}
        ignored = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if id(t) in left]
        if ignored:
            previous = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, previous + ignored)
        ddp = DistributedDataParallel(module, forward_sync_buffers=forward_sync, init_sync=False, **kwargs)
        if init_sync:
            ddp._broadcast_state(tag="replicate initial parameters", buffers=False)
        self.ddp = ddp
        self.kwargs = {}  # (built: a process group among them is the engine's to hold, weakly, from here on)
        _PENDING.discard(module)
        release(list(module.parameters()), [self.pending_watch])  # the engine's watches take over
        for args, hook_kwargs in self.comm_hooks:
            ddp.register_comm_hook(*args, **hook_kwargs)
        self.comm_hooks.clear()
        return ddp


# Note [a step before the first forward]
#     The engine of a replicated module is built at its first forward (Note [replicate without a
#     wrapper]); before it the parameters have no gradient hooks. A backward through a submodule
#     called on its own (``model.encoder(x)``) then leaves each rank its local gradients, and
#     torch's replicate, built likewise, steps on them silently: the replicas diverge. So the
#     parameters are watched from ``replicate`` on by a stand-in for the engine's watch, which the
#     optimizer step guard reads as it reads the engine's: a step before the first forward is
#     refused, with local gradients or without any (as the wrapper refuses a step before any
#     backward). ``torch.distributed.checkpoint``'s state-creating step (zero gradients, lr 0)
#     passes, as for the wrapper. The engine's own watch replaces it when the engine is built.


# Note [assigned before the first forward]
#     The common way to load a checkpoint into a model built on the meta device: replicate it,
#     then ``load_state_dict(sd, assign=True)`` (or ``module.w = nn.Parameter(...)``), make the
#     optimizer over ``model.parameters()``, train. Those Parameters are new objects, registered
#     without ``_apply``; so torch's global registration hooks watch them too (each one tested by
#     identity against the modules of the replicated tree, found once and again after a submodule
#     is registered): a step over them before the first forward is refused as over the ones
#     replicated. The engine, built at that forward, takes the module's Parameters as they are then.


def _assigned(keyword: str):
    """A registration hook (torch's global parameter or submodule one) that hands what is being
    registered, as ``keyword``, to every replicated module still waiting for its first forward."""
    def hook(module: nn.Module, name: str, value):
        for root in list(_PENDING):
            state = root.__dict__.get(_STATE)
            if state is not None and value is not None:
                state.watch_assigned(module, **{keyword: value})
        return None  # registered unchanged
    return hook


_parameter_assigned = _assigned("param")
_submodule_assigned = _assigned("submodule")


class _PendingWatch:
    """What the optimizer step guard reads of a model's watch (``WatchBase``'s surface), for a
    replicated module whose engine is not built yet (Note [a step before the first forward])."""

    def __init__(self, state: "_ReplicateState"):
        self.state = weakref.ref(state)
        self.rank = dist.get_rank()
        self.optimizer_steps = 0

    def averaging(self) -> bool:
        return False  # (no engine, no reduction under way)

    def _grads(self) -> bool:
        state = self.state()
        return state is not None and state.ddp is None and any(
            p.grad is not None for p in state.module.parameters())

    def backward_count(self) -> int:
        state = self.state()
        return 1 if state is None or state.ddp is not None or self._grads() else 0

    @property
    def last_backward_synced(self) -> bool:
        return not self._grads()

    def _name(self) -> str:
        state = self.state()
        return _class_name(state.module) if state is not None else "module"

    @property
    def owner_name(self) -> str:
        return f"replicated {self._name()} (fusedist.replicate)"

    @property
    def no_backward_advice(self) -> str:
        return (f"whose data-parallel engine is built at its first forward, and none has run: run forward and "
                f"backward through the replicated {self._name()} itself (model(x)) before optimizer.step().")

    @property
    def unsynced_advice(self) -> str:
        name = self._name()
        return (f"before the first forward of the replicated {name} (fusedist.replicate): its data-parallel "
                "engine is built at that forward, so these gradients -- from a submodule called on its own "
                "(model.layer(x)) or from the module called through another path -- are this rank's own, not "
                "averaged across ranks, and the replicas would diverge (torch's replicate steps on them). Run "
                f"the forward through the replicated {name} itself (model(x)), zero the gradients, and step "
                "after its backward.")


def _class_name(module: nn.Module) -> str:
    """The class the user replicated (not the ``DDP<class>`` subclass it became)."""
    cls = type(module)
    return cls.__mro__[2].__name__ if issubclass(cls, ReplicatedModule) else cls.__name__


def _fully_shard_submodules(module: nn.Module) -> set:
    """The ``fully_shard`` modules under ``module``: each unit owns its subtree's parameters
    (Note [replicate without a wrapper])."""
    from ..fsdp.api import FullyShardedModule

    return {m for m in module.modules() if isinstance(m, FullyShardedModule)}


def _replicated_submodules(module: nn.Module) -> set:
    """The replicated modules under ``module`` (nested ``replicate``): each engine reduces its own
    subtree, once (two engines over one parameter would retire each other's hooks)."""
    return {m for m in module.modules() if m is not module and isinstance(m, ReplicatedModule)}


def _before_forward(module: nn.Module, args, kwargs):
    """The forward pre-hook of a replicated module: what the wrapper's forward does before the
    module runs (Note [replicate without a wrapper])."""
    state: _ReplicateState = module.__dict__[_STATE]
    ddp = state.build()
    args, kwargs = ddp._inputs_on_device(args, kwargs)
    unsynced = 0 if state.requires_gradient_sync else 1
    ddp._no_sync_depth += unsynced  # (read by the bookkeeping below only)
    compiling = torch.compiler.is_compiling()
    try:
        # under a join context, recorded for the joined ranks (a compiled forward's is not: its
        # SyncBatchNorm layers are replayed in registration order)
        if ddp._before_forward(compiling) and not compiling:
            _join.begin_module(ddp)
    finally:
        ddp._no_sync_depth -= unsynced
    return args, kwargs


def _after_forward(module: nn.Module, args, kwargs, out):
    """The forward hook of a replicated module: the wrapper's forward hooks its outputs' autograd
    nodes (Note [the end of a backward with nested ones] in ``prepared.py``: a backward through
    chained reentrant checkpoints ended at the first nested one's end, its parameters without
    gradients; and Note [unused parameters known after the forward] in ``unused.py``)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return out
    state: _ReplicateState = module.__dict__[_STATE]
    if state.ddp._join_config.enable:  # as the wrapper's forward under a join context
        _join.end_module(state.ddp)
        return out
    arm_again_through(state.ddp.reducer, out, sync=state.requires_gradient_sync)
    return out


class ReplicatedModule:
    """What a module gains from :func:`replicate` (torch's composable ``DDP`` class): torch's two
    methods, and the wrapper's ``check_consistency``."""

    def __new__(cls, *args, **kwargs):
        """A new instance of a replicated module's class -- a container's slice (``seq[1:]``,
        ``layers[:2]``) is built by ``type(self)(...)``, a script's ``type(model)()`` -- is a module
        of the original class built by its ``__init__`` with the arguments given, none included: it
        was not replicated (a replicated one without an engine refused ``replicate`` as "already
        replicated" and was left out of an enclosing replicated module's). As torch's FSDP-based
        ``replicate`` and FSDP2 (Note [constructing through a sharded class] in
        fusedist/fsdp/sharded_class.py); torch's DDP-based one returns the original class
        uninitialized (``len()`` or a call fails on its missing ``_modules``). ``copy.copy`` constructs nothing:
        :meth:`__copy__`."""
        from ..fsdp.sharded_class import original_class

        return original_class(cls, ReplicatedModule)(*args, **kwargs)

    def __copy__(self):
        """``copy.copy``: an object of the original class holding this module's attributes, as torch's
        ``copy.copy`` of a replicated module gives (its engine state and hooks too: the copy's forwards
        are the replicated module's)."""
        from ..fsdp.sharded_class import shallow_copy

        return shallow_copy(self, ReplicatedModule)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: the backwards of the following forwards accumulate gradients locally, without
        communication; the first backward after it is set back to True reduces the sum (torch's
        ``no_sync``, as a setting)."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be a bool, got {type(requires_gradient_sync).__name__}")
        self.__dict__[_STATE].requires_gradient_sync = requires_gradient_sync

    def register_comm_hook(self, *args, **kwargs) -> None:
        """torch's DDP communication hook (``DistributedDataParallel.register_comm_hook``)."""
        state: _ReplicateState = self.__dict__[_STATE]
        if state.ddp is None:
            state.comm_hooks.append((args, kwargs))
        else:
            state.ddp.register_comm_hook(*args, **kwargs)

    # torch's Joinable protocol, served by the engine (Note [replicate without a wrapper]: uneven
    # inputs); built here if still pending (every rank enters the join context together).
    def join_hook(self, **kwargs):
        return self.__dict__[_STATE].build().join_hook(**kwargs)

    def _fusedist_join_engine(self):
        """The engine, for fusedist's ``Join`` (its communicator carries the join protocol)."""
        return self.__dict__[_STATE].build()

    @property
    def join_device(self) -> torch.device:
        return self.__dict__[_STATE].build().join_device

    @property
    def join_process_group(self):
        return self.__dict__[_STATE].build().join_process_group

    @property
    def _join_config(self):
        return self.__dict__[_STATE].build()._join_config

    @_join_config.setter
    def _join_config(self, config) -> None:
        self.__dict__[_STATE].build()._join_config = config

    def check_consistency(self) -> None:
        """Whether the ranks ran the same steps, with the last one included (the wrapper's
        ``check_consistency``; every rank calls it)."""
        ddp = self.__dict__[_STATE].ddp
        if ddp is not None:
            ddp.check_consistency()

    def _apply(self, fn, *args, **kwargs):
        """``nn.Module._apply`` (``to``, ``to_empty``, ``half``); before the engine is built, the
        new Parameters are watched (Note [a step before the first forward])."""
        out = super()._apply(fn, *args, **kwargs)
        state = self.__dict__.get(_STATE)
        if state is not None:
            state.watch_pending()
        return out

    def __deepcopy__(self, memo):
        raise AssertionError(
            "fusedist.replicate: a replicated module cannot be deep-copied (as with torch's replicate); copy "
            "its state_dict() into a new module instead")


_CLASSES: dict = {}


def _replicated_class(cls: type) -> type:
    replicated = _CLASSES.get(cls)
    if replicated is None:
        replicated = _CLASSES[cls] = type(f"DDP{cls.__name__}", (ReplicatedModule, cls), {})
    return replicated


def replicate(module: nn.Module, ignored_modules: Optional[Iterable[nn.Module]] = None, **kwargs) -> nn.Module:
    """Data-parallelize ``module`` in place, as ``torch.distributed._composable.replicate``
    (Note [replicate without a wrapper]); returns it. ``kwargs`` are fusedist
    :class:`~fusedist.DistributedDataParallel`'s (torch DDP's: ``device_mesh``,
    ``bucket_cap_mb``, ``find_unused_parameters``, ``static_graph``, ...) plus torch's
    ``device_id``; ``ignored_modules`` are left out (neither reduced nor broadcast), and so are
    ``fully_shard`` submodules (their units reduce their own parameters). Buffers are not
    synchronized (torch's), unless ``forward_sync_buffers=True``."""
    from ..fsdp.api import FullyShardedModule

    if not isinstance(module, nn.Module):
        raise TypeError(f"fusedist.replicate expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, ReplicatedModule):
        raise ValueError(f"fusedist.replicate: {_class_name(module)} is already replicated")
    if isinstance(module, FullyShardedModule):
        raise ValueError(
            f"fusedist.replicate: {type(module).__name__} is sharded by fully_shard (as torch's replicate, it takes "
            "modules whose submodules may be; for sharding with replication across groups, use fully_shard over "
            "a 2-D mesh: HSDP)")
    if "device_id" in kwargs and not isinstance(kwargs["device_id"], (int, torch.device, type(None))):
        raise TypeError(f"fusedist.replicate: device_id must be an int or a torch.device, got "
                        f"{type(kwargs['device_id']).__name__}")
    ignored_modules = set(ignored_modules or ())
    _refuse_dtensors(module, ignored_modules)
    if not dist.is_initialized():
        raise RuntimeError("fusedist.replicate: torch.distributed is not initialized; call fusedist.init_distributed() "
                           "(under torchrun) before replicating the model")
    _refuse_engine_over(module)
    module.__dict__[_STATE] = _ReplicateState(module, ignored_modules, kwargs)
    if checks_enabled():
        optimizer_guard.install()  # Note [a step before the first forward]
        # Note [assigned before the first forward]
        install_parameter_registration_hook("replicate parameters assigned before the first forward",
                                            _parameter_assigned)
        install_module_registration_hook("replicate submodules assigned before the first forward",
                                         _submodule_assigned)
    module.register_forward_pre_hook(_before_forward, with_kwargs=True)
    module.register_forward_hook(_after_forward, with_kwargs=True)
    module.__class__ = _replicated_class(type(module))
    _PENDING.add(module)
    return module


def _refuse_dtensors(module: nn.Module, ignored_modules: set) -> None:
    """DTensor parameters or buffers (a tensor-parallel module) are refused by name at ``replicate``
    and again when the engine is built (a module converted in between), in replicate's words, not in
    the wrapper's (Note [DDP over a tensor-parallel model] in arguments.py): the flat buckets carry
    no placements. Those of ``ignored_modules`` are the user's to reduce, as with torch's replicate;
    fully_shard's own pieces are plain tensors, not DTensors."""
    from .arguments import refuse_dtensors

    left_out = {id(t) for m in ignored_modules for t in [*m.parameters(), *m.buffers()]}
    refuse_dtensors([(n, p) for n, p in module.named_parameters() if id(p) not in left_out],
                    [(n, b) for n, b in module.named_buffers() if id(b) not in left_out],
                    who=f"fusedist.replicate({_class_name(module)})",
                    why="the module is tensor-parallel, and fusedist's data-parallel engine takes plain parameters "
                        "and buffers",
                    torch_way="torch's replicate(model, device_mesh=mesh['dp'])")


def _refuse_engine_over(module: nn.Module) -> None:
    """A submodule replicated after the first forward of a module holding it (replicated or
    wrapped): the engine already built reduces its parameters, and the submodule's engine,
    built at its first forward inside the outer one, would retire the outer engine's hooks
    (Note [a module wrapped again] in wrapper.py): that step trains unsynchronized. Refused."""
    from ..ownership import wrapping_owner

    for name, p in module.named_parameters():
        owner = wrapping_owner(p)
        if owner is not None and owner._superseded_by is None and owner.module is not module:
            raise RuntimeError(
                f"fusedist.replicate({type(module).__name__}) (rank {owner.rank}): its parameter '{name}' is "
                f"already reduced by the data-parallel engine of {type(owner.module).__name__} (a replicated "
                "module's is built at its first forward); a second engine would take its parameters over in the "
                "middle of training. Replicate submodules before the first forward of the module holding them "
                "(nested replicate: each engine reduces its own subtree)")


def wrapper_of(module: nn.Module):
    """The DistributedDataParallel engine of a replicated ``module`` (None when ``module`` is
    not replicated or its engine is not built yet: before its first forward)."""
    state = module.__dict__.get(_STATE) if isinstance(module, nn.Module) else None
    return state.ddp if state is not None else None


def build_pending(params: Iterable) -> None:
    """Build the engines of replicated modules still pending over any of ``params`` (a
    ZeroRedundancyOptimizer shards along its model's buckets, so it needs them built)."""
    ids = {id(p) for p in params}
    for module in list(_PENDING):
        if any(id(p) in ids for p in module.parameters()):
            module.__dict__[_STATE].build()
