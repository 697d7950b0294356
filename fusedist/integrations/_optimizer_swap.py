"""The optimizer a fusedist strategy swaps in for the one a user built (Lightning's Trainer
and Fabric strategies share it): torch's Adam/AdamW/SGD become fusedist's fused ones, optionally
sharded by ``ZeroRedundancyOptimizer``, under the user's class name; whoever kept the user's
optimizer (its LR schedulers, the user's own reference) reaches the new one.
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref

import torch

import fusedist
from fusedist.optim import FusedAdam, FusedAdamW, FusedSGD
from fusedist.optim._scaler_protocol import _HANDED_TO, FlagOfAnother, hand_protocol_over

__all__ = ["convert_optimizer", "hand_over", "kept_for", "retire_successor", "stepping_for", "successors_over"]

# torch optimizer -> its fused drop-in (same constructor keywords).
_FUSED = {torch.optim.AdamW: FusedAdamW, torch.optim.Adam: FusedAdam, torch.optim.SGD: FusedSGD}


def _refuse_unfusable_settings(optimizer: torch.optim.Optimizer, strategy: str) -> None:
    """The fused optimizers run no CUDA-graph-capturable or differentiable step: an optimizer
    built to run one is refused at setup, with the strategy setting that keeps torch's (the fused
    optimizer's own refusal would name a class the user never wrote). Its ``defaults`` say so, as
    torch reads them (Note [a group's capturable or differentiable flag])."""
    name = type(optimizer).__name__
    for flag in ("capturable", "differentiable"):
        if optimizer.defaults.get(flag):
            raise ValueError(
                f"{strategy}: {name}({flag}=True) has no fused counterpart (fusedist's fused "
                f"{name} does not support {flag}=True); pass {strategy}(fused_optimizer=False) "
                f"to train with torch's {name}, or drop {flag}=True")


# Note [a group's capturable or differentiable flag]
# A param group may say capturable=True or differentiable=True while the optimizer was built without
# them: torch's load_state_dict copies the saved groups' flags (a state dict of a CUDA-graph run, or
# of one with a differentiable group), and add_param_group keeps what the group says. torch's step
# then still runs without autograd (it reads ``defaults["differentiable"]``), and the fused drop-ins
# load and step such groups as torch does (Note [a capturable state dict] and Note [a differentiable
# group] in fusedist/optim/adam.py). The swap used to refuse them at setup, so a run that had
# loaded such a state dict could not start with the strategy at all; only the optimizer's own
# settings are refused now, and the groups pass to the fused optimizer with their flags.


def convert_optimizer(optimizer: torch.optim.Optimizer, *, fused_optimizer: bool, zero_stage: int,
                      master_weights: bool, strategy: str, fresh_from: str) -> torch.optim.Optimizer:
    """``optimizer`` as a strategy runs it: its fused counterpart (torch's Adam, AdamW, SGD, when
    ``fused_optimizer``; same hyperparameters and param groups, FP32 masters when
    ``master_weights``), sharded by ``ZeroRedundancyOptimizer`` when ``zero_stage`` is 1 or 2,
    under the returned class's name (Note [the optimizer's name]); ``optimizer`` itself when
    nothing changes, or when it is a ``ZeroRedundancyOptimizer`` already: the user sharded it, at
    the stage they chose (sharding it again nested one inside the other: its first step failed
    with an unclear error, or it trained 3e-2 off torch). ``strategy`` names the strategy in
    errors, ``fresh_from`` where a fresh optimizer comes from."""
    if isinstance(optimizer, fusedist.ZeroRedundancyOptimizer):
        return optimizer
    cls = type(optimizer)
    fused = _FUSED.get(cls) if fused_optimizer else None
    if fused is None and zero_stage == 0:
        return optimizer
    earlier = stepping_for(optimizer)  # Note [an optimizer given to a strategy again]
    if earlier is None and (optimizer.__dict__.get(_TAKEN_BACK, False) or _has_stepped(optimizer)):
        earlier = optimizer  # Note [an optimizer that stepped before the strategy]
    if fused is not None:
        _refuse_unfusable_settings(optimizer, strategy)
    target = fused or cls
    defaults = {k: v for k, v in optimizer.defaults.items() if k in _keywords(target)}
    groups = [dict(group) for group in optimizer.param_groups]
    if fused is not None:
        defaults["master_weights"] = master_weights
        # which of torch's implementations to run (foreach=, fused=False): the conversion
        # replaces the implementation, so they say nothing here (fused=False was refused)
        for settings in (defaults, *groups):
            settings.pop("foreach", None)
            settings.pop("fused", None)
    if zero_stage == 0:
        converted = _named_as(target, cls)(groups, **defaults)
    else:
        converted = _named_as(fusedist.ZeroRedundancyOptimizer, cls)(groups, target, stage=zero_stage, **defaults)
    if earlier is not None:
        _carry_state(earlier, converted, strategy, fresh_from)
        if earlier is optimizer:  # (its moments now live in the converted one, which it forwards to)
            optimizer.state.clear()
    return converted


def _carry_state(earlier, converted, strategy: str, fresh_from: str) -> None:
    """``converted`` takes ``earlier``'s whole state, or the conversion is refused saying why
    (Note [an optimizer that stepped before the strategy])."""
    whole = _whole_state(earlier)
    try:
        converted.load_state_dict(whole)
    except (KeyError, ValueError, TypeError, RuntimeError) as error:
        raise RuntimeError(
            f"{strategy}: {type(earlier).__name__} has state from earlier steps, which its replacement "
            f"{type(converted).__name__} cannot take over ({error}); {fresh_from}, or keep this optimizer "
            "as it is with fused_optimizer=False and zero_stage=0") from error


# Note [an optimizer that stepped before the strategy]
# A run that warms an optimizer up alone (plain torch steps, a pre-training phase, a resume that
# loaded a state dict by hand) and then hands it to fabric.setup or returns it from
# configure_optimizers continues from that state under Fabric's and Lightning's DDP: the same
# optimizer object steps on. The swap used to refuse such an optimizer ("already has state").
# The converted optimizer now loads its state dict -- Adam's moments and step counts, SGD's
# momentum buffers, anything torch's format holds -- as a load_state_dict into the converted
# optimizer would (sharded, at stage 1/2, from each rank's own copy, as torch's
# ZeroRedundancyOptimizer loads a whole state dict), and the kept optimizer drops its own copy:
# it forwards to the converted one (Note [the returned optimizer]). A state the replacement cannot
# load is refused naming the reason and the setting that keeps torch's optimizer.


# Note [an optimizer given to a strategy again]
# A module that builds its optimizer once and returns it from configure_optimizers on every fit (or
# a loop handing it to a second Fabric) gives the strategy an optimizer it handed over before. With
# Lightning's DDP the second fit steps that optimizer on, its moments and step counts kept; here its
# state lived in the optimizer it was handed to, its own state stayed empty, and it was converted
# afresh: the second fit restarted Adam's moments (4e-2 off Lightning's DDP after one epoch). The
# new conversion now starts from the earlier one's whole state (gathered to every rank when it was
# sharded: a collective, which every rank's setup runs alike), at any stage on either side.


def stepping_for(optimizer):
    """The optimizer that stepped for ``optimizer`` after an earlier hand-over, or None (the link
    is its ``_opt_called``; a fused optimizer keeps that under another key)."""
    for key in ("_opt_called", "_fusedist_opt_called"):
        flag = optimizer.__dict__.get(key)
        if isinstance(flag, _SteppedThrough):
            return flag.optimizer()
    return None


def _whole_state(optimizer) -> dict:
    """``optimizer``'s state dict in torch's format, on every rank when it is sharded."""
    if not isinstance(optimizer, fusedist.ZeroRedundancyOptimizer):
        return optimizer.state_dict()
    import torch.distributed as dist

    group = optimizer.process_group
    whole = [optimizer.consolidate_state_dict(to=0)]
    dist.broadcast_object_list(whole, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return whole[0]


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds state a step made. torch's Adagrad fills its state when it is
    built (``step`` 0, ``sum`` at ``initial_accumulator_value``), which its converted
    counterpart builds again; any other entry (a ``step`` past 0, a ``momentum_buffer``) would
    be lost by the conversion."""
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if step is None or float(step) != 0:
            return True
    return False


@functools.lru_cache(maxsize=None)
def _keywords(cls) -> frozenset:
    return frozenset(inspect.signature(cls.__init__).parameters)


# Note [the optimizer's name]
# LearningRateMonitor names its keys after the optimizer's class ("lr-AdamW/pg1") and numbers
# several optimizers of one class by type ("lr-AdamW", "lr-AdamW-1"). The optimizer the
# strategy swaps in would log "lr-FusedAdamW/pg1" or "lr-ZeroRedundancyOptimizer/pg1": the same
# training under other keys, so dashboards and monitors keyed on them go blank when only the
# strategy changed. The swapped optimizer is therefore an instance of a subclass of its
# implementation that carries the returned class's name -- one subclass per (implementation,
# returned class), so the numbering by type is Lightning's too. It is still the implementation
# (isinstance, methods, ZeroRedundancyOptimizer's repr, the algorithm fusedist's checkpoints
# record, found through the bases; pickling); only __name__ is borrowed, which torch's
# Optimizer repr and fusedist's messages about the optimizer also show: the class the user
# wrote. An optimizer the strategy keeps as it is keeps its own name, so one written as
# fusedist.optim.FusedAdamW logs under "lr-FusedAdamW" with every strategy, Lightning's too;
# giving its LR scheduler config "name": "lr-AdamW" keeps torch's keys.


@functools.lru_cache(maxsize=None)
def _named_as(implementation: type, returned: type) -> type:
    """``implementation`` under the name of ``returned`` (Note [the optimizer's name])."""
    if implementation.__name__ == returned.__name__:
        return implementation

    def __reduce_ex__(self, protocol):
        # The class is made here, not found by name: pickle rebuilds it from the two classes.
        return _new_named, (implementation, returned), self.__getstate__()

    named = type(returned.__name__, (implementation,),
                {"__module__": __name__, "__qualname__": f"{implementation.__qualname__}[{returned.__name__}]",
                 "__doc__": (f"{implementation.__qualname__}, named as {returned.__qualname__} "
                             "(Note [the optimizer's name])."),
                 "__reduce_ex__": __reduce_ex__})
    return named


def _new_named(implementation: type, returned: type):
    cls = _named_as(implementation, returned)
    return cls.__new__(cls)


# Note [the returned optimizer]
# The optimizer configure_optimizers returned stays reachable after the swap: SequentialLR and
# ChainedScheduler keep it in their parts (the usual warm-up then decay is a SequentialLR),
# and modules keep it to set a learning rate by hand (self.opt = AdamW(...); return self.opt).
# Written to, its param groups used to be a discarded copy: the learning rate of the optimizer
# that steps stayed where the swap left it, and training went on without a word. The returned
# optimizer now reads and writes the new one's param groups, so a hyperparameter set through
# it takes effect; and every scheduler in a config's tree drives the new optimizer, as torch
# otherwise warns that a part stepped an optimizer that never stepped. A param group added
# through it (unfreezing a backbone: self.opt.add_param_group(...)) is added by the new one:
# torch's add_param_group appended a group the new optimizer had not set up -- without FP32
# masters under "bf16-true", and refused by ZeRO as parameters "not held" by it. Its state
# dicts are the new one's: state_dict() returned the returned optimizer's empty state, and
# load_state_dict() (resuming from a file of the user's own) loaded into an optimizer that
# never steps -- and, replacing its param groups, cut it off from the new one's, so learning
# rates set through it afterwards were lost too. A ZeroRedundancyOptimizer's consolidate_state_dict
# is forwarded with them: Fabric consolidates an optimizer given to fabric.save when it has that
# method, and fabric.save(path, {"optimizer": optimizer}) with the optimizer passed to
# fabric.setup (Fabric's DDP saves the full state of that very object) wrote rank 0's shard of
# the state, which fabric.load then refused on every rank. Its step and zero_grad are the new
# one's too: a loop that kept stepping the optimizer it passed to fabric.setup (as Fabric's DDP
# allows: it is the optimizer that steps there) stepped that torch optimizer, with its own state,
# instead of the fused or sharded one -- on ZeRO stage 2, which keeps no p.grad, not at all, and
# the model did not train. A load into the new optimizer (a resume with
# trainer.fit(ckpt_path=...), fabric.load) replaces the new one's list of groups as well,
# which the returned optimizer follows: the learning rates of a warm-up written against it
# stopped reaching the optimizer that steps after a resume.
# A GradScaler given it checks, unscales and tells the new one (Note [the protocol of a
# handed-over optimizer] in fusedist/optim/_scaler_protocol.py): scaler.step(optimizer) on the one
# the program kept applied the scaled gradients, or an overflowed step, through the new one.


def hand_over(old, new, schedulers) -> None:
    """``new`` takes ``old``'s place for the LR ``schedulers`` (and those they hold) and for whoever kept ``old``
    (Note [the returned optimizer]); ``new``'s groups carry the schedulers' ``initial_lr``."""
    earlier = stepping_for(old)
    if earlier is not None and earlier is not new:  # Note [an earlier successor forwards to the new one]
        from fusedist import ownership

        ownership.release([p for group in earlier.param_groups for p in group["params"]], [earlier])
        hand_over(earlier, new, ())
    for top in schedulers:
        for scheduler in _scheduler_tree(top):
            if getattr(scheduler, "optimizer", None) is old:
                scheduler.optimizer = new
                _track_step_calls(new)
    scheduled = hasattr(old.step, "_wrapped_by_lr_sched")
    # Note [a scheduler built on the returned optimizer]: one built on it before, or after, now
    _track_step_calls(new)
    old.__dict__.pop(_PENDING, None)  # (Note [a kept optimizer after its sharded successor retires])
    old.__dict__.pop(_TAKEN_BACK, None)
    old._opt_called = _SteppedThrough(new)
    hand_protocol_over(old, new)  # (a GradScaler given old tells new: Note [the returned optimizer])
    old.step, old.zero_grad = _step_of(new, old, scheduled), _zero_grad_of(new, old)
    old.param_groups = new.param_groups
    old.add_param_group = new.add_param_group
    old.state_dict, old.load_state_dict = new.state_dict, new.load_state_dict
    old.state = _state_of(new, old)
    if hasattr(new, "consolidate_state_dict"):  # a ZeroRedundancyOptimizer (Note [the returned optimizer])
        old.consolidate_state_dict = new.consolidate_state_dict
    new.register_load_state_dict_post_hook(functools.partial(_share_loaded_groups, weakref.ref(old)))
    _KEPT[new] = weakref.ref(old)


def _state_of(new, old):
    """What ``old.state`` reads after the hand-over (Note [the returned optimizer's state])."""
    if not isinstance(new, fusedist.ZeroRedundancyOptimizer):
        return new.state
    return ShardedStateNote(f"{type(old).__name__}.state: the state of this optimizer lives in the "
                            f"ZeroRedundancyOptimizer (stage {new.stage}) that steps for it, sharded across "
                            f"{new.world_size} ranks, and no rank holds a parameter's whole state")


class ShardedStateNote(dict):
    """An empty, read-only ``state`` whose lookups say where the sharded state is (Note [the
    returned optimizer's state]). A dict, so iterating it (moving state between devices) finds
    nothing to do, and it pickles."""

    def __init__(self, what: str = "") -> None:
        super().__init__()
        self.what = what

    def __reduce__(self):
        return ShardedStateNote, (self.what,)

    def _refuse(self, *args, **kwargs):
        raise TypeError(f"{self.what}; it is read-only here: load a state dict into the optimizer instead")

    __setitem__ = __delitem__ = update = setdefault = _refuse

    def __missing__(self, key):
        raise KeyError(
            f"{self.what}. Gather it with optimizer.consolidate_state_dict(to=0) (a collective every rank calls; "
            "rank 0 then reads optimizer.state_dict()['state']), or read this rank's shard with the "
            "ZeroRedundancyOptimizer's shard_state_dict(); zero_stage=0 keeps each parameter's whole state in "
            "optimizer.state")


# Note [the returned optimizer's state]
# Callbacks and loops read the optimizer's state by parameter (optimizer.state[p]["exp_avg"]: logging
# the moments, checking an LR finder's warm-up) on the optimizer they were given -- under Fabric's and
# Lightning's DDP the torch optimizer that steps. Here that one forwards to the optimizer swapped in,
# and its own .state was empty: such reads found nothing, without a word. Its state is now the swapped-in
# optimizer's own per-parameter state (the fused drop-ins keep torch's keys, plus "master_param", the
# FP32 master, under master weights); a write into it reaches the optimizer that steps. A ZeRO
# optimizer keeps no whole per-parameter state on any rank: a lookup raises a KeyError naming the
# calls that read the sharded state, and iterating it finds nothing. A take-back (Note [a kept
# optimizer after its sharded successor retires]) loads the kept optimizer's own state again.


# Note [an earlier successor forwards to the new one]
# Fabric's DDP steps the very optimizer it was given, so a program that sets up its model and
# optimizer again (a second fabric.setup of the same objects: a new phase, another precision) may
# step either returned optimizer: both are the one torch optimizer. Here each setup swaps in a new
# optimizer, loaded with the earlier one's whole state (Note [an optimizer given to a strategy
# again]); the optimizer the first setup returned kept stepping its own, stale state -- and at
# ZeRO stage 2 gradients the new wrapper never reduced into it -- 2e-2 off Fabric's DDP in two
# steps. The earlier successor now forwards to the new one as the kept optimizer does (its step,
# zero_grad, param groups and state dicts; a clip through it measures the new one's gradients,
# clip_by_norm in _strategy_options.py), so every optimizer the program holds steps one state.
# The earlier one also gives up what it was registered for: a ZeRO stage-2 optimizer stays the
# parameters' gradient holder otherwise, and a second Fabric with zero_stage=0 over the same
# objects had its new wrapper reduce into the stage-2 shards nobody stepped (2e-2 off Fabric's
# DDP in three steps).


# Note [a kept optimizer after its sharded successor retires]
# A module that builds its optimizer once and fits first with zero_stage=1/2, then with Lightning's
# "ddp" (or a plain loop), steps the kept optimizer again -- which still forwarded to the
# ZeroRedundancyOptimizer retired at teardown (Note [the wrapper retires at teardown] in
# lightning.py). At stage 2 that one reads gradients from the retired wrapper's buckets, never from
# p.grad: the second fit trained 3.7e-2 off "ddp" run twice, without a word. At the retirement the
# kept optimizer's forwarding methods become ones that take the whole state back first -- its
# moments and step counts, its param groups with what was set on them -- and then run the kept
# optimizer's own method: every later step is torch's, on the gradients the new fit synchronized.
# Taking the state back gathers the shards (a collective on the sharded optimizer's process group,
# bounded by its timeout), so it runs lazily at the kept optimizer's next step, zero_grad,
# state_dict or add_param_group, which every rank reaches alike, never at teardown (which a rank
# may reach through an exception while the others train on). A load_state_dict replaces the state
# anyway and gathers nothing. Given to a fusedist strategy again before that, the kept optimizer is
# converted from its retired successor's state as before (Note [an optimizer given to a strategy
# again]); after it, from its own.

_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # successor -> the kept optimizer
_FORWARDED = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group")
_PENDING, _TAKEN_BACK = "_fusedist_takes_back_from", "_fusedist_took_back"


def kept_for(new):
    """The optimizer ``new`` was handed over from and still steps for, or None."""
    ref = _KEPT.get(new)
    old = None if ref is None else ref()
    return old if old is not None and stepping_for(old) is new else None


def successors_over(params) -> list:
    """The swapped-in optimizers alive that hold one of ``params``, whichever strategy made them."""
    ids = {id(p) for p in params}
    return [new for new in list(_KEPT.keys())
            if any(id(p) in ids for group in new.param_groups for p in group["params"])]


def retire_successor(new) -> None:
    """``new``, a sharded optimizer, stops stepping for the optimizer it was handed (Note [a kept
    optimizer after its sharded successor retires])."""
    ref = _KEPT.pop(new, None)
    old = None if ref is None else ref()
    if old is None or not isinstance(new, fusedist.ZeroRedundancyOptimizer) or stepping_for(old) is not new:
        return
    scheduled = hasattr(old.step, "_wrapped_by_lr_sched")
    old.__dict__.pop("consolidate_state_dict", None)
    installed = {}
    for name in _FORWARDED:
        func = functools.partial(_taking_back, name)
        if name == "step" and scheduled:  # (torch's schedulers wrap a step once: it stays marked)
            func = _marked(func)
        installed[name] = old.__dict__[name] = types.MethodType(func, old)
    old.__dict__[_PENDING] = (new, installed)


def _marked(func):
    def step(self, *args, **kwargs):
        return func(self, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    return step


def _taking_back(name, old, *args, **kwargs):
    """``old``'s own ``name``, once ``old`` has taken its whole state back from its retired
    successor (a collective, except for a load, which replaces the state)."""
    pending = old.__dict__.pop(_PENDING, None)
    if pending is not None:
        new, installed = pending
        try:
            whole = None if name == "load_state_dict" else _whole_state(new)
        except BaseException:
            old.__dict__[_PENDING] = pending
            raise
        scheduled = hasattr(old.step, "_wrapped_by_lr_sched")
        for method, ours in installed.items():
            if old.__dict__.get(method) is ours:
                del old.__dict__[method]
        for key in ("_opt_called", "_fusedist_opt_called"):
            if isinstance(old.__dict__.get(key), _SteppedThrough):
                old.__dict__[key] = bool(old.__dict__[key])
        old.__dict__.pop(_HANDED_TO, None)
        old.__dict__[_TAKEN_BACK] = True
        if whole is not None:
            type(old).load_state_dict(old, whole)
        if scheduled and "step" not in old.__dict__:
            _track_step_calls(old)
    return getattr(type(old), name)(old, *args, **kwargs)


def _step_of(new, old, scheduled: bool):
    """``old.step``: ``new``'s, with ``old``'s own step hooks around it (Note [the returned
    optimizer's step hooks]). A bound method, as torch's LR schedulers wrap ``step.__func__``;
    marked as their wrapper when one was built on ``old``."""

    def step(self, *args, **kwargs):
        args = (self, *args)  # (torch's hooks see the optimizer among the arguments)
        for hook in list(getattr(self, "_optimizer_step_pre_hooks", {}).values()):
            result = hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"{type(self).__name__}.step's pre-hook {hook!r} must return None or a "
                                       f"tuple of (new_args, new_kwargs), but got {result!r}.")
                args, kwargs = result
        out = new.step(*args[1:], **kwargs)
        for hook in list(getattr(self, "_optimizer_step_post_hooks", {}).values()):
            hook(self, args, kwargs)
        return out

    if scheduled:
        step._wrapped_by_lr_sched = True
    return types.MethodType(step, old)


def _zero_grad_of(new, old):
    """``old.zero_grad``: ``new``'s, looked up at each call. The per-step check gives ``new`` its own
    ``zero_grad`` at its first guarded step, which notes a clearing before the step (Note [gradients
    cleared before the step] in fusedist/reliability/optimizer_guard.py); ``new``'s bound method taken
    at the hand-over, usually before that step, would bypass it, and zeroing through ``old`` went unseen."""

    def zero_grad(self, *args, **kwargs):
        return new.zero_grad(*args, **kwargs)

    zero_grad.__doc__ = type(new).zero_grad.__doc__
    return types.MethodType(zero_grad, old)


# Note [the returned optimizer's step hooks]
# Hooks registered on the returned optimizer (``register_step_pre_hook`` / ``_post_hook``: an EMA of
# the weights, a step counter), before the swap or after it, never ran: torch runs them in the
# class's step, which the forwarding step above replaces, and the new optimizer runs only its own.
# Its step now runs them around the new one's step, as torch's does (with the returned optimizer as
# the hooks' optimizer; a pre-hook may replace the arguments). torch's global step hooks run once,
# in the new one's step. A step the scaler skips runs none of them, as torch's scaler does not call
# the step it skips (Note [a skipped step runs no step hooks] in fusedist/amp/skipped_step.py).


# Note [a scheduler built on the returned optimizer]
# An LR scheduler the strategy is not handed -- built on the optimizer before
# fabric.setup_optimizers(optimizer) or fabric.setup(model, optimizer) without scheduler=, or
# kept by a LightningModule that steps it itself -- drives the new optimizer through the shared
# param groups, but torch's check of the step order reads the returned optimizer's
# ``_opt_called``, which only its own step sets: the first scheduler.step() warned that it came
# "before optimizer.step()" and that "the first value of the learning rate schedule" was skipped,
# although the new optimizer had stepped and nothing was skipped (Fabric's DDP, whose optimizer
# is the one the scheduler holds, gives no warning). The returned optimizer's flag now reads the
# new one's -- when read, which the scheduler does once -- so it warns where torch's would: after
# a step the scaler skipped for inf/nan gradients (Note [a skipped step and the LR scheduler] in
# fusedist/optim/_scaler_protocol.py), or when no step ran. That holds for a scheduler built on
# the returned optimizer after the hand-over too (a module building its own in on_train_start, a
# Fabric loop building one after fabric.setup): torch's scheduler then wraps the returned
# optimizer's step to set the flag, which only a call of that step does, and the loop steps the
# new optimizer -- so the flag is the new one's from the hand-over on, whether or not a
# scheduler exists yet. A returned optimizer that is a fused one itself (a user's FusedAdamW
# that zero_stage > 0 shards) has that flag as a property, whose setter keeps the link to the
# new one's flag as it is (FlagOfAnother in fusedist/optim/_scaler_protocol.py): it recorded
# the link as False, and the scheduler warned although the new optimizer had stepped.


class _SteppedThrough(FlagOfAnother):
    """The returned optimizer's ``_opt_called``: true once the new one has stepped (Note [a
    scheduler built on the returned optimizer]). Held weakly, as torch holds the optimizer. A
    FlagOfAnother, which a fused optimizer's flag keeps as it is (a user's FusedAdamW that the
    strategy shards)."""

    __slots__ = ("_new",)

    def __init__(self, new) -> None:
        self._new = weakref.ref(new)

    def __bool__(self) -> bool:
        new = self._new()
        return bool(new is not None and getattr(new, "_opt_called", False))

    def optimizer(self):
        return self._new()


def _share_loaded_groups(old_ref, new) -> None:
    """After a load into ``new``, which replaces its list of param groups, ``old`` reads and
    writes the loaded ones (Note [the returned optimizer])."""
    old = old_ref()
    if old is not None:
        old.param_groups = new.param_groups


def _scheduler_tree(scheduler, seen=None):
    """``scheduler`` and the schedulers it keeps, at any depth, in attributes or in lists and
    tuples held by them (SequentialLR's and ChainedScheduler's ``_schedulers``)."""
    seen = set() if seen is None else seen
    if id(scheduler) in seen:
        return
    seen.add(id(scheduler))
    yield scheduler
    kinds = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    for value in getattr(scheduler, "__dict__", {}).values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, kinds):
                yield from _scheduler_tree(item, seen)


def _track_step_calls(optimizer) -> None:
    # torch's LRScheduler marks optimizer.step to warn when the scheduler steps first; the
    # new optimizer gets the same mark (held weakly, as torch does).
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    owner = weakref.ref(optimizer)
    func = step.__func__

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        opt = owner()
        opt._opt_called = True
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper
