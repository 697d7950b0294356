"""``GradScaler(found_inf_group=...)``: one inf/nan decision per iteration over the pipeline stages.

# Note [found_inf over the pipeline stages]
Each pipeline stage's optimizer checks only its stage's gradients, and each rank steps its own
optimizer(s): an overflow in one stage skipped that stage's step only, and lowered that rank's
scale only -- the next iteration's stages trained at different scales on weights that were no
longer one model's step. With ``found_inf_group`` the scaler takes, once per iteration, the max
of every flag of every optimizer this rank unscales or steps, over the group: an overflow in
any stage skips the step of every stage (of every optimizer on every rank) and backs the scale
off on every rank alike, as Megatron and torchtitan all-reduce found_inf over their
model-parallel groups. (torch's scaler in one process skips each optimizer by its own flag; a
pipeline split of one model must skip as one model, so the stages skip together.)

The agreement is one all-reduce of one flag, at the iteration's first ``step()`` (or at
``update()`` when nothing was stepped), so ranks holding different numbers of stages (of
optimizers) agree without matching calls: it used to be one all-reduce per optimizer, paired by
position, so a rank stepping two stages' optimizers against one stepping one hung, and ranks
stepping two each combined stage 0 with stage 1 and stage 2 with stage 3. Before the
agreement, each optimizer this rank has unscaled this iteration, or unscaled or stepped in an
earlier one, is checked (a flag-only pass for one not unscaled yet; a fused optimizer's step
then uses it and does not check again). An optimizer first seen after the agreement (a new one,
after the first iteration) cannot join it: the scaler raises, asking to ``unscale_`` it before
the first ``step()`` of the iteration.

# Note [the first iteration's steps wait for update()]
In the first iteration the scaler does not know yet which optimizers the rank steps: torch's
multi-optimizer loop (``scaler.step(opt1); scaler.step(opt2); scaler.update()``) agreed at
``step(opt1)`` without ``opt2``'s flag, stepped ``opt1`` (and every other rank's stages) through
an overflow in ``opt2``'s stage, then raised at ``step(opt2)``. So until the scaler knows the
rank's optimizers (the first ``update()`` after a step), ``step()`` checks and records the call,
and ``update()`` agrees over every optimizer stepped and runs the recorded steps, as the later
iterations do at the first ``step()``: the weights change at ``update()`` instead, once. A
gradient zeroed, replaced or written between such a ``step()`` and ``update()`` would be stepped
silently in its new state, so it raises, naming the optimizer.

A deferred step must still be the step of the call it stands for. torch's loop may move on
between ``step()`` and ``update()``: an LR scheduler stepped there (``scaler.step(opt);
scheduler.step(); scaler.update()``) changed the learning rate the deferred step then used -- the
first step ran at the schedule's second value -- and, finding no ``optimizer.step()`` call yet,
warned "Detected call of `lr_scheduler.step()` before `optimizer.step()`" on every run. So
``step()`` records the groups' hyperparameters (tensors copied) and the deferred step runs with
them (the later values put back after it), and until ``update()`` the optimizer counts as stepped
for a scheduler. ``update()`` then sets that flag as the step leaves it (unset when the agreed
flag skipped the step): a scheduler stepped after ``update()`` warns exactly as with torch's
scaler; one stepped before it does not warn, where torch's warns if that first step overflowed.

# Note [a closure in the first iteration]
torch's ``scaler.step(optimizer, closure)`` returns the closure's loss, or None when the step was
skipped (the closure then does not run: Note [a skipped step runs no closure] in grad_scaler.py).
A step waiting for ``update()`` returned None and ran the closure only at ``update()``, so a loop
reading the loss from ``step()`` (LBFGS-style, or one that logs it) got None in the first iteration.
The caller needs the answer now, so such a ``step()`` makes the iteration's agreement at once, as
the later iterations' first ``step()`` does: over the optimizers unscaled or stepped so far on this
rank (their waiting steps run first, in call order). An optimizer stepped after it in the same
iteration raises, asking to ``unscale_`` it before that ``step()``, as a new optimizer after the
first iteration does.

# Note [a stage without a loss]
A middle pipeline stage computes no loss, so it never calls ``scaler.scale(loss)``, which is
where torch's scaler makes its scale; its gradients come from the last stage's scaled loss and
are scaled all the same. With ``found_inf_group`` the scale is made on first use by
``unscale_``, ``step`` or ``update`` too (with the loaded or initial scale, as ``scale`` makes
it), where torch's asserts "Attempted step but _scale is None"; every rank's scale then follows
the same agreed flags. Without a group the assertion stays: there a missing ``scale(loss)``
means unscaled gradients, which the step would divide by the scale.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.amp.grad_scaler import OptState

from .._rank import this_rank
from ..optim._scaler_protocol import FlagOfAnother, follows_protocol, looked_up_once, protocol_owner, stepped_optimizer
from . import unscale


def device_of(optimizer, default) -> torch.device:
    """Where the scale of a stage without a loss lives: its optimizer's parameters' device."""
    for group in getattr(optimizer, "param_groups", ()):
        for param in group["params"]:
            return param.device
    return torch.device(default)


class FoundInfGroupMixin:
    """The ``found_inf_group`` part of :class:`fusedist.amp.GradScaler` (Note [found_inf over
    the pipeline stages])."""

    def _group(self):
        return self.__dict__.get("_found_inf_group")  # (None in a scaler pickled before it existed)

    def _scale_for_stage(self, optimizer=None) -> None:
        """Make the scale on first use under a group (Note [a stage without a loss])."""
        if self._scale is None and self._group() is not None:
            self._lazy_init_scale_growth_tracker(device_of(optimizer, self._device))

    def _remember(self, optimizer) -> None:
        """Count ``optimizer`` in this rank's agreements, from this iteration's on, while this
        iteration's is still to be made."""
        if self._group() is None or self.__dict__.get("_agreed") is not None:
            return
        known = self.__dict__.setdefault("_group_optimizers", {})
        stepped = stepped_optimizer(optimizer)  # (keyed by it: Note [one scaler state per stepped optimizer])
        ref = known.get(id(stepped))
        if ref is None or ref() is None or stepped_optimizer(ref()) is not stepped:
            known[id(stepped)] = weakref.ref(optimizer)

    def _flag_in_iteration(self, optimizer, found_inf: torch.Tensor) -> torch.Tensor:
        """``found_inf`` (measured on this rank), combined in place with the iteration's agreed
        flag once that is made; before, ``optimizer`` joins the agreement to come."""
        agreed = self.__dict__.get("_agreed")
        if self._group() is None:
            return found_inf
        if agreed is None:
            self._remember(optimizer)
            return found_inf
        flag, included = agreed
        if id(stepped_optimizer(optimizer)) not in included:
            raise RuntimeError(self._late_message(optimizer))
        torch.maximum(found_inf, flag.reshape(found_inf.shape).to(found_inf.device), out=found_inf)
        return found_inf

    def _late_message(self, optimizer) -> str:
        return (
            f"GradScaler(found_inf_group=...) on rank {this_rank()}: {type(optimizer).__name__} was first unscaled or "
            "stepped after this iteration's inf/nan flag was agreed over the group (at the first step()), so "
            "its gradients cannot count in it and its stage could step apart from the others. Call "
            "scaler.unscale_(optimizer) for an optimizer new after the first iteration before the first "
            "scaler.step() of the iteration (the scaler remembers each one it unscaled or stepped); in the first "
            "iteration, before a scaler.step(optimizer, closure), which agrees at once to return the closure's loss."
        )

    # -- Note [the first iteration's steps wait for update()] -----------------------------------

    def _defers_steps(self) -> bool:
        """Whether ``step()`` waits for ``update()``: a group, and no optimizer known yet."""
        return (self._group() is not None and self.__dict__.get("_agreed") is None
                and not self.__dict__.get("_knows_optimizers", False))

    def _pending(self) -> list:
        return self.__dict__.setdefault("_pending_steps", [])

    def _is_pending(self, optimizer) -> bool:
        stepped = stepped_optimizer(optimizer)  # (any of its names: Note [one scaler state per stepped optimizer])
        return any(stepped_optimizer(entry[0]) is stepped for entry in self._pending())

    def _defer_step(self, optimizer, args: tuple, kwargs: dict) -> None:
        """``step()`` before the scaler knows the rank's optimizers: torch's checks now, the step
        at ``update()``."""
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        if self._is_pending(optimizer) or self._record_of(optimizer)["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        self._remember(optimizer)
        self._pending().append((optimizer, args, kwargs, _grads_now(optimizer), _hyperparameters_now(optimizer),
                                _count_as_stepped(optimizer)))

    def _agree_for_closure(self, optimizer) -> None:
        """A first-iteration ``step()`` with a closure: the agreement now, over ``optimizer`` and
        those known so far, and the steps that waited for it (Note [a closure in the first
        iteration])."""
        self._check_scale_growth_tracker("step")
        self._remember(optimizer)
        self._agree_and_run_pending()

    def _agree_and_run_pending(self) -> None:
        """``update()``'s part: the agreement (when no ``step()`` made it), then the steps that
        waited for it."""
        pending, self._pending_steps = self._pending(), []
        changed = [entry[0] for entry in pending if not _same_grads(entry[3], _grads_now(entry[0]))]
        self._agree_iteration()  # (first: the other ranks wait for it)
        for optimizer, *_, scheduler_flag in pending:
            _restore_scheduler_flag(optimizer, scheduler_flag)  # (the step sets it as torch's would)
        if changed:
            raise RuntimeError(self._changed_message(changed[0]))
        for optimizer, args, kwargs, _, hyperparameters, _ in pending:
            with _hyperparameters_as(optimizer, hyperparameters):
                self.step(optimizer, *args, **kwargs)
        if self.__dict__.get("_group_optimizers"):
            self._knows_optimizers = True

    def _changed_message(self, optimizer) -> str:
        return (
            f"GradScaler(found_inf_group=...) on rank {this_rank()}: the gradients of {type(optimizer).__name__} were "
            "zeroed, replaced or written between scaler.step(optimizer) and scaler.update() of the first "
            "iteration. Until it knows every optimizer of the rank, the scaler steps them at update(), once "
            "their inf/nan flags are agreed over the group, so it would step the new gradients. Zero the "
            "gradients after scaler.update()."
        )

    def _agree_iteration(self, stepping=None) -> None:
        """The iteration's one all-reduce of the inf/nan flag over the group (Note [found_inf
        over the pipeline stages]); written into every flag this rank recorded."""
        group = self._group()
        if group is None or self.__dict__.get("_agreed") is not None:
            return
        if stepping is not None:
            self._remember(stepping)
        known = self.__dict__.setdefault("_group_optimizers", {})
        flag = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        states = []
        for key, ref in list(known.items()):
            optimizer = ref()
            if optimizer is None:
                del known[key]
                continue
            state = self._per_optimizer_states[key]
            if state["stage"] is OptState.READY and not state["found_inf_per_device"]:
                self._check_before_agreement(optimizer, state)
            for value in state["found_inf_per_device"].values():
                flag = torch.maximum(flag, value.reshape(1).to(flag.device, torch.float32))
            states.append(state)
        from ..comm import get_communicator  # (the collective deadline and stall report)

        get_communicator(group, flag.device).all_reduce(flag, op="max", tag="GradScaler found_inf_group")
        for state in states:
            for value in state["found_inf_per_device"].values():
                value.copy_(flag.reshape(value.shape).to(value.device))
        self._agreed = (flag, set(known))

    def _check_before_agreement(self, optimizer, state: dict) -> None:
        """The flag of an optimizer not unscaled this iteration, for the agreement: a fused
        optimizer's step uses it (no second check); torch's path measures again when it
        unscales (in place, as torch's step does)."""
        device = self._scale.device
        if follows_protocol(optimizer):
            owner = protocol_owner(optimizer)
            if not owner._fusedist_has_grads():
                return
            with looked_up_once(owner):
                found_inf, _ = owner._fusedist_check_and_norm(None)
            found_inf, _ = unscale.combine_over_shards(owner, found_inf)  # [sharded gradients]
            state["found_inf_per_device"] = {device: found_inf.reshape(())}
            state["checked_for_step"] = True
            return
        one, zero = torch.ones(1, device=device), torch.zeros(1, device=device)
        flags = unscale.unscale_per_device(optimizer, one, zero, allow_fp16=True)  # (x * 1: a check)
        for value in flags.values():
            unscale.combine_over_shards(optimizer, value)  # [sharded gradients]
        state["found_inf_per_device"] = flags

    def _end_agreement(self) -> None:
        self._agreed = None


def _grads_now(optimizer) -> list:
    """The gradients of ``optimizer``'s parameters, and those a fused optimizer steps (a stage-2
    ZeroRedundancyOptimizer's shards: its ``p.grad`` is None; views made afresh at each call for
    stage 1), each with its address and version count (the tensors are held, so a new gradient
    cannot take an old one's address)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    if follows_protocol(optimizer):
        grads += protocol_owner(optimizer)._fusedist_local_grads()
    return [(g, None) if g is None else (g, (g.data_ptr(), g._version)) for g in grads]


def _same_grads(before: list, now: list) -> bool:
    """Whether no gradient was replaced, dropped or written in place since ``before``."""
    return len(before) == len(now) and all(u == v for (_, u), (_, v) in zip(before, now))


# -- what a deferred step keeps of its call (Note [the first iteration's steps wait for update()]) --

def _count_as_stepped(optimizer):
    """Mark ``optimizer`` as stepped for an LR scheduler (torch's ``_opt_called``) until
    ``update()`` runs its step; what :func:`_restore_scheduler_flag` puts back (None: nothing
    was marked). The mark goes where the flag is read: an optimizer handed over to another reads
    the other's (a :class:`FlagOfAnother`), which link is kept (Note [a deferred step keeps the
    hand-over's flag])."""
    holder = _flag_holder(optimizer)
    if getattr(holder, "_opt_called", False) is True:
        return None
    key = _flag_key(holder)
    saved = (holder, key, holder.__dict__.get(key, _ABSENT))
    holder._opt_called = True  # (a fused optimizer's flag: no step flag set yet, so "called")
    return saved


def _restore_scheduler_flag(optimizer, saved) -> None:
    """The flag as it was before :func:`_count_as_stepped` (a link to another's flag, a pending
    device flag), for the step to set as torch's would."""
    if saved is None:
        return
    holder, key, value = saved
    if value is _ABSENT:
        holder.__dict__.pop(key, None)
    else:
        holder.__dict__[key] = value


# Note [a deferred step keeps the hand-over's flag]
# A deferred step's mark used to be written on the optimizer passed to ``step()``, and then
# replaced by False: on an optimizer handed over to another (``hand_over`` in
# fusedist/integrations/_optimizer_swap.py), whose flag is a link to the other's, the link was
# lost -- a scheduler on it then warned "lr_scheduler.step() before optimizer.step()" at its first
# step whenever that came after the first update(), however many steps had run -- and on a fused
# one the link kept the mark from showing, so a scheduler stepped before update() warned. The
# mark now goes on the optimizer at the end of the links, and the raw flag is put back as it was.
_ABSENT = object()


def _flag_key(optimizer) -> str:
    """Where ``optimizer`` keeps its step flag: a fused optimizer's is a property over another
    name (Note [a skipped step and the LR scheduler] in fusedist/optim/_scaler_protocol.py)."""
    fused = isinstance(getattr(type(optimizer), "_opt_called", None), property)
    return "_fusedist_opt_called" if fused else "_opt_called"


def _flag_holder(optimizer):
    """The optimizer whose own step flag ``optimizer``'s flag reads: itself, or, following
    :class:`FlagOfAnother` links, the one it was handed over to."""
    for _ in range(8):  # (bounded against cycles)
        raw = getattr(optimizer, "__dict__", {}).get(_flag_key(optimizer))
        other = raw.optimizer() if isinstance(raw, FlagOfAnother) else None
        if other is None:
            return optimizer
        optimizer = other
    return optimizer


def _frozen(value):
    """``value`` as it is now: tensors copied (a scheduler changes a tensor lr in place)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _same(value, frozen) -> bool:
    if value is frozen:
        return True
    if isinstance(value, torch.Tensor) and isinstance(frozen, torch.Tensor):
        return value.shape == frozen.shape and value.dtype == frozen.dtype and torch.equal(value, frozen)
    if isinstance(value, tuple) and isinstance(frozen, tuple):
        return len(value) == len(frozen) and all(_same(v, f) for v, f in zip(value, frozen))
    return False


def _hyperparameters_now(optimizer) -> list:
    """Each group's hyperparameters at ``step()``: (the object, its value then) by key."""
    return [{key: (value, _frozen(value)) for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups]


@contextlib.contextmanager
def _hyperparameters_as(optimizer, recorded: list):
    """Within the block, the groups' hyperparameters that changed since ``recorded`` was taken
    are the recorded values; after it, the changed ones again (a scheduler's next value)."""
    changed = []
    for group, then in zip(optimizer.param_groups, recorded):
        for key, (value, frozen) in then.items():
            if key in group and not (group[key] is value and _same(value, frozen)):
                changed.append((group, key, group[key]))
                group[key] = frozen
    try:
        yield
    finally:
        for group, key, value in changed:
            group[key] = value
