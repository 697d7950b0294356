"""What a pipeline stage's step did, so that the next step can drop what a step that raised left, or
refuse to run: the step counts, the schedule found from ``clear_runtime_states``, the gradients and
buffers put back, the refusal's message.

Note [a step that raised]
    torch's schedules keep the losses of a step that raised (the last stage's ``loss_fn`` failing
    on micro-batch 2's target, say) and hand them to the next step's backwards in place of its
    own: the gradient came out wrong by ~lr-sized amounts, silently, torch's own stage alike. A
    stage counts what its step did (forwards, backward passes; a training step ends when the
    schedule reduces the gradients, a forward-only one with its last forward). At the next step's
    beginning -- torch's schedules call ``clear_runtime_states`` from their ``step``, where the
    stage finds the schedule -- a step that ended leaves nothing; one that raised before its end:
    - on a pipeline whose stages are all on this rank, the schedule's leftover losses are
      dropped, the gradients put back as the step found them (from the set-aside of Note
      [accumulating over synchronized pipeline steps] in set_aside.py; those it found None set to
      None again), and the step runs, as a fresh schedule's would. A stage module fusedist or torch
      reduces keeps unreduced sums this cannot put back, as does a step accumulating under the
      user's own switch: after backward passes such a stage refuses every later step instead.
      The buffers the step's forwards updated (a BatchNorm's running statistics and batch count)
      are put back too (Note [the buffers a failed step puts back]): torch's stage kept the failed
      step's update, so an ``eval()`` afterwards normalized by statistics that counted batches no
      training step took.
    - on a pipeline over several ranks, the other ranks were in the step too: waiting for this
      rank's messages, or having sent some it never received (gloo's sends wait for their
      receive), and no rank can tell the others (the exception may come from the schedule's own
      code, and a peer blocked in a receive sees nothing else). A new step would pair its
      messages with theirs -- activations and gradients of other micro-batches, another step's
      targets -- silently. So the rank refuses this and every later step, naming what it had
      done; the peers' steps fail too -- at once where the failure is told to every rank (Note [a
      failure told at the step's end] in step_status.py), else at the process group's
      timeout (or when this process ends) -- and refuse theirs in turn.
    A step whose shape inference failed on every rank at once left nothing unmatched (Note [a
    shape inference that fails on one rank] in inference.py): it counts as ended.
    A step driven by hand (no schedule's ``step``) is not tracked. The leftover losses of a step
    that ended (an ``eval`` whose ``loss_fn`` raised on the last micro-batch) are dropped too.

Note [a stage that ended in a step that raised]
    With several stages on one rank, a stage's part of a step can end -- its last backward ran, its gradients
    were reduced and divided -- before another stage of the rank raises (stage 0's backward of the last
    micro-batch, after stage 1's). The step raised, but that stage's step counted as ended: the next step
    kept its gradients of the failed step and added the new step's to them, silently (2e-2 to 1e-1 off the
    unpipelined model's, whatever the stage module). The schedule's step now records whether it raised (Note
    [the targets a step was given] in schedule_step.py wraps it), and such a stage counts as one
    whose step raised: a stage module no one reduces gets its gradients back from the set-aside, kept past the
    step's division until the next step begins (no copy more: the one the step took), and its buffers from the
    step's record, kept likewise; one fusedist or torch reduces refuses every later step, naming why.

Note [the buffers a failed step puts back]
    Copying every buffer of the stage module at each step's first forward cost a copy of buffers
    no forward changes too -- a rotary or mask cache of many MiB, on every step of the run. The
    copy at a step's beginning is now of the buffers known to move: a normalization layer's
    running statistics, and any buffer whose version counter (``_version``, counting in-place
    updates) moved between a step's first forward and its end (and, as before, any tensor subclass's:
    its counter may not see an update of its contents). Every other buffer is kept by a
    snapshot taken once, when the stage first sees the buffer at that version, and reused while the
    version stays (in host memory for a tensor on an accelerator: it is read only after a failure);
    a step that updates such a buffer makes it one known to move. After a failed step each buffer
    is the tensor the step found (a buffer the step reassigned gets that tensor back), and one whose
    version moved -- first updated in the failing step included -- gets its value back from the
    copy or the snapshot. An in-place update the version counter does not see (through
    ``buf.data``, which counts apart) is neither learned nor put back, as in torch's stage, for a
    buffer not known to move; a running statistic is put back whatever updated it.
    On a pipeline over several ranks the buffers were put back on one rank only: a failure told to every
    rank (Note [a failure told at the step's end] in step_status.py, and the notices of a first
    send that cannot be made in inference.py and notice_back.py) left every rank's
    forwards' updates in place (a BatchNorm's batch count 0 -> 4 on rank 0 after a failed first step),
    though no rank applied the step. The same record is now taken where such failures are told, and every
    rank puts its buffers back when it raises the failure (its next step being refused). The cost on a step
    that does not fail: per stage and step, one walk over the module's buffers reading their version
    counters, and copies of the running statistics and of the buffers known to move only (the one-rank
    case's cost); a buffer no forward changes is copied once, when first seen (in host memory for one on an
    accelerator), and never again while its version stays. Not taken where no failure is told
    (``FUSEDIST_CHECKS=0``, a schedule the exchange does not arm): such a step's buffers stay as it left them.

Note [a refusal after a failure every rank raised]
    The refusal of a pipeline over several ranks said the other ranks "were left waiting" on the failed
    step's messages. Where the failure was told to every rank -- the notices of a first send (inference.py,
    notice_back.py), the exchange at the step's end (step_status.py): a batch smaller than
    ``n_microbatches`` is refused so on every rank at once (Note [a batch smaller than n_microbatches] in
    small_batch.py) -- no rank was left waiting: every rank raised the same step's failure, its messages
    were all matched, and the buffers (and a stage module no one reduces, its gradients) were put back. Such
    a step is marked where it is told (``told_every_rank``), and its refusal says so and what works: new
    ``PipelineStage`` objects over the same modules and a new schedule, on every rank (a new schedule over
    the old stage is refused as well: the refusal stays with the stage), or a restart from the last
    checkpoint; where the step's backward passes left sums that cannot be put back (a DDP or ``fully_shard``
    stage module, a step under the user's own sync switch), the restart only.
"""

from __future__ import annotations

import sys

import torch


class Step:
    """What a stage did in the step it last began (Note [a step that raised])."""

    def __init__(self):
        self.forwards, self.backwards, self.ended = 0, 0, False
        self.held_over, self.unset, self.buffers = False, [], None
        self.set_aside, self.ended_buffers = None, None  # (Note [a stage that ended in a step that raised])
        self.told = False  # (Note [a refusal after a failure every rank raised])

    def end(self) -> None:
        """The step's messages are all exchanged (a forward-only step's last forward ran)."""
        self.ended = True
        if self.buffers is not None:
            self.buffers.ended()
            self.buffers, self.ended_buffers = None, self.buffers

    def began(self, module, held_over: bool) -> None:
        """At the step's first forward: whether the set-aside was an earlier step's, and the
        parameters without a gradient."""
        self.held_over = held_over
        self.unset = [p for p in module.parameters() if p.grad is None]


def told_every_rank(stage) -> None:
    """The stage's failed step was raised on every rank of the pipeline at once, its messages all matched
    (Note [a refusal after a failure every rank raised])."""
    step = getattr(stage, "_step", None)
    if step is not None:
        step.told = True


def last_schedule(stage):
    """The schedule whose step the stage took part in last (held weakly), or None."""
    stepping = getattr(stage, "_stepping", None)
    return stepping() if stepping is not None else None


def schedule_stepping(stage):
    """The schedule whose ``step`` is beginning, clearing ``stage`` (None when the stage is driven
    by hand): torch's schedules call ``clear_runtime_states`` from their ``step``. The walk passes
    the stage's own frames (subclasses' overrides, however many) and frames of no method (wrappers,
    comprehensions); the first method of another object decides. A fixed depth lost the schedule
    under a third override, and the next step then backpropagated the failed step's losses."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    frame = sys._getframe(1)
    for _ in range(32):
        frame = frame.f_back
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if caller is None or caller is stage:
            continue
        if not isinstance(caller, _PipelineSchedule):
            return None
        stages = [getattr(caller, "_stage", None), *getattr(caller, "_stages", ())]
        return caller if any(s is stage for s in stages) else None
    return None


def after_the_last_step(stage, schedule, plain: bool) -> None:
    """Drop what the stage's last step left if it raised (Note [a step that raised]), or refuse.
    ``plain``: the stage module is one neither fusedist nor torch reduces (nothing kept unreduced)."""
    refusal = getattr(stage, "_refusal", None)
    step = getattr(stage, "_step", None)
    if refusal is None and step is not None and (not step.ended or ended_in_a_step_that_raised(stage, step)):
        if stage.group_size > 1 or (step.backwards and (step.held_over or not plain)):
            refusal = stage._refusal = _refusal(stage, step, plain)
        else:
            if step.backwards:
                put_back_gradients(stage, step)
            buffers = step.buffers or step.ended_buffers
            if buffers is not None:  # a BatchNorm's statistics, as the step found them
                buffers.put_back()
            if not step.held_over:
                stage._held_before = None
            stage._held_over = step.held_over
    if refusal is not None:
        raise RuntimeError(refusal)
    schedule._internal_losses.clear()  # the losses of a step that raised; none otherwise


def ended_in_a_step_that_raised(stage, step) -> bool:
    """The stage's step ended, with backward passes, in a schedule step that raised at another stage of this
    rank (Note [a stage that ended in a step that raised])."""
    schedule = last_schedule(stage)
    return bool(step.ended and step.backwards and schedule is not None
                and schedule.__dict__.get("_fusedist_step_raised", False))


def put_back_gradients(stage, step) -> None:
    """The gradients as ``step`` found them, from the set-aside its first backward took (Note [accumulating
    over synchronized pipeline steps] in set_aside.py), kept past the step's division where the step
    ended; those it found None set to None again."""
    with torch.no_grad():
        held = getattr(stage, "_held_before", None) or step.set_aside
        for grad, before in held.pairs() if held is not None else []:
            grad.zero_() if before is None else grad.copy_(before)
    for p in step.unset:
        p.grad = None


def _refusal(stage, step, plain: bool) -> str:
    head = (f"fusedist.pipelining.PipelineStage: stage {stage.stage_index} (rank {torch.distributed.get_rank()}): "
            f"the previous step raised before its end, after {step.forwards} of its {stage.chunks} forwards and "
            f"{step.backwards} backward passes")
    if step.ended:  # Note [a stage that ended in a step that raised]
        head = (f"fusedist.pipelining.PipelineStage: stage {stage.stage_index} (rank {torch.distributed.get_rank()}): "
                "the previous step raised at another stage of this rank after this stage's part of it had ended "
                f"({step.forwards} forwards and {step.backwards} backward passes, its gradients reduced)")
    if stage.group_size > 1 and step.told:  # Note [a refusal after a failure every rank raised]
        kept = bool(step.backwards) and (step.held_over or not plain)
        return (
            f"{head}. Every rank of the pipeline raised that step's failure at once and its messages were all "
            "matched; still, this rank refuses every later step on this stage (a step that raised is never "
            "resumed, under a new schedule neither). " + (
                f"Its backward passes left {_kept_sums(stage, plain)} that cannot be put back: fix what raised "
                "and restart every rank from the last checkpoint" if kept else
                "The stage module's buffers and gradients are as the step found them and the process group "
                "stays usable: fix what raised (a batch smaller than n_microbatches: drop_last=True), then build "
                "new PipelineStage objects over the same modules and a new schedule on every rank, or restart "
                "every rank from the last checkpoint"))
    if stage.group_size > 1:
        return (
            f"{head}. The pipeline's other ranks were left waiting on that step's messages (or sent ones "
            "this stage never received): a new step would pair its activations and gradients with other "
            "micro-batches' and another step's targets, silently. So this rank refuses every later step, and "
            "the other ranks' steps fail too (at once if this process ends, else at the process group's "
            "timeout). Fix what raised and restart every rank from the last checkpoint")
    why = _kept_sums(stage, plain)
    if plain:
        fix = ("zero the gradients and build the stages and the schedule anew (or restart from the last "
                    "checkpoint)")
    else:
        fix = "restart from the last checkpoint (the sums stay with the module)"
    return (
        f"{head}: its backward passes accumulated part of that step's gradients, and {why} cannot be put back "
        f"as the step found them. So every later step is refused: {fix}")


def _kept_sums(stage, plain: bool) -> str:
    return ("an earlier step's gradients set aside under the user's own gradient-sync switch" if plain else
            f"the unreduced sums a {type(stage.submod).__name__} stage module keeps")


def kept_buffers(stage) -> "BufferKeeper":
    """The stage's keeper of its module's buffers (Note [the buffers a failed step puts back])."""
    keeper = getattr(stage, "_kept_buffers", None)
    if keeper is None:
        keeper = stage._kept_buffers = BufferKeeper()
    return keeper


class BufferKeeper:
    """Which of a stage module's buffers its forwards update, learned over the steps, and the
    copies that put them back (Note [the buffers a failed step puts back])."""

    def __init__(self):
        self.moving: set = set()  # (id(owner), name) of buffers a step's forwards updated in place
        self.snapshots: dict = {}  # the others': (id(owner), name) -> (buffer, its version, a copy)

    def began(self, module) -> "StepBuffers":
        """At a step's first forward: every buffer with its version, and a copy of its value --
        taken now for a buffer known to move, else the snapshot taken when it last changed."""
        entries = []
        with torch.no_grad():
            for owner in module.modules():
                for name, buf in owner._buffers.items():
                    if buf is None:
                        continue
                    key, version = (id(owner), name), _version(buf)
                    if (version is None or type(buf) is not torch.Tensor or key in self.moving
                            or _running_statistic(owner, name)):  # (a subclass's counter may not see its updates)
                        entries.append((owner, name, buf, version, buf.detach().clone(), True))
                        continue
                    snap = self.snapshots.get(key)
                    if snap is None or snap[0] is not buf or snap[1] != version:
                        snap = self.snapshots[key] = (buf, version, _snapshot(buf))
                    entries.append((owner, name, buf, version, snap[2], False))
        return StepBuffers(self, entries)


class StepBuffers:
    """A step's record of its stage module's buffers as the step found them."""

    def __init__(self, keeper: BufferKeeper, entries: list):
        self.keeper, self.entries = keeper, entries

    def ended(self) -> None:
        """The step's forwards are done: a buffer whose version moved is one a forward updates."""
        for owner, name, buf, version, _, copied in self.entries:
            if not copied and _version(buf) != version:
                self.keeper.moving.add((id(owner), name))
                self.keeper.snapshots.pop((id(owner), name), None)

    def put_back(self) -> None:
        """The module's buffers as the step found them: the same tensors, their values."""
        moved = [(owner, name, buf, value) for owner, name, buf, version, value, copied in self.entries
                 if copied or _version(buf) != version]
        self.ended()
        with torch.no_grad():
            for owner, name, buf, version, _, _ in self.entries:
                owner._buffers[name] = buf
            for owner, name, buf, value in moved:
                buf.copy_(value)


def _version(buf: torch.Tensor):
    """The tensor's in-place update count, None where it keeps none (an inference-mode tensor)."""
    try:
        return buf._version
    except Exception:  # noqa: BLE001 - then copied every step
        return None


def _running_statistic(owner, name: str) -> bool:
    """A normalization layer's running statistic: updated by every training forward (copied from
    the first step on, without a snapshot)."""
    from torch.nn.modules.batchnorm import _NormBase

    return isinstance(owner, _NormBase) and name in ("running_mean", "running_var", "num_batches_tracked")


def _snapshot(buf: torch.Tensor) -> torch.Tensor:
    """A copy of a buffer not known to move, kept across steps: in host memory for a tensor on an
    accelerator (it is read only after a failed step that updated the buffer)."""
    return buf.detach().to("cpu", copy=True) if buf.device.type != "cpu" else buf.detach().clone()
