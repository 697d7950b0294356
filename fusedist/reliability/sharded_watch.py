"""The reliability layer's view of one ``fully_shard`` model (ZeRO-3), as ``engine_watch.py``
is for a DDP model.

Note [stage-3 step check]
    Unit all-gathers and reduce-scatters pair up by issue order, like DDP's buckets: a rank that
    skips a step, runs an extra forward, or steps its optimizer on a different iteration leaves
    the ranks out of step, and with sharded parameters nothing fails until the numbers are
    wrong. One case is easy to hit: ``torch.amp.GradScaler`` decides to skip a step from this
    rank's pieces of the gradients only, so the rank whose piece overflowed skips alone.

    So at the end of every synchronized backward, after the last unit's reduce-scatter (the
    same point of every rank's collective order), the root launches the per-step check of
    Note [step check] in ``step_check.py`` with the same fields -- synchronized backwards,
    training forwards, all backwards, optimizer steps (counted by the optimizer step guard),
    a CRC of the wrapping, the sequence number of the last collective, a digest of which
    parameters had a gradient in each unit's reduction (Note [rank-independent reductions] in
    ``fusedist/fsdp/grads.py``) -- and reads its verdict
    at the next training forward. A divergence is a ``RankMismatchError`` on every rank, one
    step after it happened. ``check_now()`` checks at once (``fusedist.checkpoint.save``
    calls it before writing). ``FUSEDIST_CHECKS=0`` turns it off.

    At world size 1 the root has its watch too, as a DDP model has its ``StepWatch``: the
    counters and the optimizer step guard apply; the cross-rank check (and the wrapping
    check) are off, so the watch issues no collective there.

Note [replica check]
    On a 2-D (replicate, shard) mesh (HSDP) the ranks of one shard group hold different pieces,
    so the step check, which runs over the shard group, has no replicated parameters to
    compare; the ranks that hold the same piece sit in different shard groups, and a rank that
    changes its piece (in place, by a checkpoint load or an optimizer step of its own) trains
    on with replicas that differ, silently. So every ``FUSEDIST_PARAM_CHECK_EVERY``
    synchronized backwards (Note [parameter check] in ``param_check.py``) and at every
    ``check_now()``, each rank all-reduces ``[d, -d]`` over its replicate group (MAX), ``d``
    the digest of its pieces, right after the last unit's reduce-scatter (the same point of
    every rank's order). Its spread ``max(d) - min(d)`` is nonzero iff the replicas of this
    rank's pieces differ; the step check's ``params`` field then carries 0 where they agree,
    else the rank's shard position + 1. Every shard group holds one rank of every replicate
    group, so every shard group sees the same field values, and the verdict (a mismatch on
    every rank) is the same everywhere; each rank then names, over its replicate group, the
    parameters whose pieces differ and the global ranks that agree. On a (replicas, 1) mesh the
    shard groups are single ranks: the step check itself runs over the replicate group there,
    its ``params`` field the digest (the counters are compared across the replicas too).

    Cost: the digest of the rank's pieces and one 2-element all-reduce, waited for (its result
    goes into the step check's vector: the host waits for the slowest replica there), once per
    period. Measured on CPU (gloo, 2 x 2 mesh, 4 ranks on a loaded 2-core machine, one thread
    each, 2026-12-06), 4 units of Linear + Tanh, batch 16: the digest and all-reduce took
    3-6 ms at 8.4K parameters per rank and 6.5 ms at 0.53M; with ``FUSEDIST_PARAM_CHECK_EVERY=1``
    a step took 84 ms instead of 75, and 123 instead of 79 (most of it the wait for the other
    replica, which the oversubscribed cores make long); at the default period of 100, 0.1% and
    0.6% of a step.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch

from ..ownership import register_step_watch
from .config import checks_enabled, param_check_every
from .engine_watch import PIPELINE_HINT, WatchBase
from .param_check import ParamDigest
from .stall_report import global_ranks
from .step_check import StepCheck

SUBJECT = {"subject": "fully_shard", "model": "fully_shard model", "reduced": "units", "explain": {
    "unused": "a different set of parameters received gradients (a branch of a unit ran on some ranks only): "
    "the ranks would step different pieces of one parameter; use every trainable parameter in the loss on "
    "every rank (e.g. add 0 * the branch's output on the ranks that skip it), or call "
    "model.set_reduce_scatter_unused_params(True) on the root so that every rank reduces every trainable "
    "parameter of a unit that ran (zeros where a rank computed no gradient), as torch's FSDP2 requires",
    "trainable": "the ranks ran different units in forward (a unit skipped, repeated or reordered on some ranks: "
    "rank-dependent control flow such as a per-rank layer drop), so their all-gathers and reduce-scatters "
    "paired one unit's with another's; every rank must call the same units in the same order"}}


class ShardedStepWatch(WatchBase):
    """Counters, the per-step check and the stall-report context of one fully_shard root."""

    owner_name = "fully_shard model"
    check_tag = "fully_shard step check"
    no_backward_advice = "so there are no reduced gradients to apply. Call loss.backward() before optimizer.step()."
    unsynced_advice = ("under set_requires_gradient_sync(False): the gradients are this rank's unreduced local "
                       "sums, so the ranks would diverge. Turn gradient synchronization back on for the last "
                       "micro-batch's backward before stepping." + PIPELINE_HINT)

    def __init__(self, comm, wrapping: list, params: list, units: list = ()):
        self.comm = comm
        self.units = len(wrapping)
        self.wrapping_crc = zlib.crc32(repr(wrapping).encode()) & 0x7FFFFFFF
        self.backwards = 0
        self.in_backward = False
        self._gradients_crc, self._without_grad = 0, []  # the last synchronized backward's reductions
        self._units_crc, self._units = 0, []  # the units its forward ran, in order
        super().__init__(comm)
        #: Note [replica check]: the replicate group's communicator (HSDP), else None
        self.replicate_comm = next((u.replicate_comm for u in units if u.replicate_comm is not None), None)
        if self.replicate_comm is None or self.replicate_comm.world_size < 2 or not checks_enabled():
            self.replicate_comm = None
        #: a (replicas, 1) mesh: every rank holds the whole parameters, the check runs over the replicas
        self.replicas_only = self.replicate_comm is not None and self.step_check is None
        if self.replicas_only:
            self.step_check = StepCheck(self.replicate_comm, self.check_tag)
        self.param_every = param_check_every() if self.replicate_comm is not None else 0
        self._replicas: Optional[ParamDigest] = None  # the digests of this rank's pieces, built when first due
        self._units_of = units
        from . import optimizer_guard

        if checks_enabled():  # FUSEDIST_CHECKS=0 turns the guard off, as for a DDP model
            optimizer_guard.install()  # counts optimizer steps over these parameters
        register_step_watch(params, self)

    # ------------------------------------------------------------------ events of the root
    def forward_begins(self) -> None:
        """A training forward of the root, before its first all-gather."""
        self.settle()
        self.forwards += 1

    def backward_begins(self) -> None:
        self.in_backward = True
        if self.monitor is not None:
            self.monitor.step_hint = self.sync_steps

    def backward_aborted(self) -> None:
        """The backward that began raised before its end (``reset_iter_state``, or Note [aborted
        backward] in ``fusedist/fsdp/state.py``): no longer in it. It is not counted as a
        backward: it reduced nothing the step check could compare."""
        self.in_backward = False

    def backward_ends(self, synced: bool, reductions: list = (), units: list = ()) -> None:
        """After the last unit's reduce-scatter was issued (and finished). ``reductions``: the
        backward's (unit, section, parameters with a gradient, names of those without) log
        (Note [rank-independent reductions] in ``fusedist/fsdp/grads.py``); ``units``: the
        units its forward ran, in order (their paths), compared too: ranks that ran different
        alike units pair gathers of equal sizes silently."""
        self.in_backward = False
        if synced and self.step_check is not None:
            log = sorted(entry[:3] for entry in reductions)
            self._gradients_crc = zlib.crc32(repr(log).encode()) & 0x7FFFFFFF
            self._without_grad = [name for entry in reductions for name in entry[3]]
            self._units = list(units)
            self._units_crc = zlib.crc32(repr(self._units).encode()) & 0x7FFFFFFF
            self._launch(checked_now=False)
        self.backwards += 1
        self.last_backward_synced = synced
        if synced:
            self.sync_steps += 1

    # ------------------------------------------------------------------ checks
    def check_now(self) -> None:
        """Compare where the ranks are now (a collective: every rank calls it at the same point)."""
        self._check_now(lambda: self._launch(checked_now=True))

    def _launch(self, checked_now: bool) -> None:
        detail = dict(SUBJECT, buckets=self.units, checked_now=checked_now, unused_names=self._without_grad,
                      describe_trainable=self._describe_units)
        flag = None
        if self.param_every and (checked_now or self.sync_steps % self.param_every == 0):
            detail.update(explain=dict(SUBJECT["explain"], params=REPLICAS_DIFFER))
            if self.replicas_only:  # (the step check's ranks are the replicas: the digest itself)
                flag = self._pieces().compute(self.replicate_comm.device)
                detail.update(describe_params=lambda comm, skip=(): self._replicas.describe(
                    comm, skip, labels=global_ranks(comm)))
            else:
                flag = self._replica_flag()  # Note [replica check]
                detail.update(describe_params=self._describe_replicas, params_listed=False)
        self.step_check.launch(
            [self.sync_steps, self.forwards, self.backwards, self.optimizer_steps, self.wrapping_crc,
             self.comm.last_seq, self._gradients_crc, self._units_crc, 0],  # (params: the replica flag, if due)
            detail, digest=flag)

    @torch.no_grad()
    def _replica_flag(self) -> torch.Tensor:
        """Note [replica check]: 0 where the replicas of this rank's pieces agree, else the
        rank's shard position + 1 (a 0-dim int64 tensor on the device)."""
        comm = self.replicate_comm
        digest = self._pieces().compute(comm.device)
        bounds = torch.stack([digest, -digest])
        comm.all_reduce(bounds, op="max", tag="fully_shard replica check").wait()
        return (bounds.sum() != 0).to(torch.int64) * (self.rank + 1)

    def _pieces(self) -> ParamDigest:
        if self._replicas is None:
            self._replicas = ParamDigest(_named_pieces(self._units_of))
        return self._replicas

    def _describe_replicas(self, comm, skip=()) -> list:
        """The lines naming the pieces whose replicas differ (a collective over the replicate
        group: every rank calls it on the same verdict, Note [replica check])."""
        replicas = self.replicate_comm
        lines = self._replicas.describe(replicas, labels=global_ranks(replicas))
        if not lines:
            return []
        shown = global_ranks(replicas) or list(range(replicas.world_size))
        return [f"  replicas of rank {_global(self.comm, self.rank)}'s pieces (ranks {shown}):"] + lines

    def _describe_units(self, comm) -> list:
        """This rank's units in forward order, for the mismatch report (every rank prints its own)."""
        units = self._units
        shown = ", ".join(units[:12]) + (f", ... ({len(units)} calls)" if len(units) > 12 else "")
        return [f"  units run in forward on rank {self.rank}: {shown}"]

    def backward_count(self) -> int:
        return self.backwards

    def position(self) -> dict:
        return {
            "fully_shard_step": self.sync_steps,
            "fully_shard_backward": self.backwards,
            "fully_shard_forwards": self.forwards,
            "optimizer_steps": self.optimizer_steps,
            "in_backward": self.in_backward,
        }


#: The ``params`` field's explanation on a (replicate, shard) mesh (Note [replica check]).
REPLICAS_DIFFER = ("the replicas of a shard (the ranks holding the same pieces along the mesh's replicate "
                   "dimension) hold different values: a rank changed weights in place, loaded a checkpoint, or "
                   "stepped an optimizer or a learning-rate scheduler on its own; the replicas now train different "
                   "models (load or change weights on every rank alike)")


def _named_pieces(units) -> list:
    """(name under the root, piece) of every parameter the units shard, for the replica check."""
    named = []
    for u in units:
        for fqn, piece in zip(u.fqns, u.sharded):
            named.append((f"{u.path}.{fqn}" if u.path else fqn, piece))
    return named


def _global(comm, position: int) -> int:
    """The global rank of ``position`` in ``comm``'s group."""
    ranks = global_ranks(comm)
    return ranks[position] if ranks is not None else position
