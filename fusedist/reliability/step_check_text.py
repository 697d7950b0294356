"""The step check's fields and the error text of a disagreement (Note [step check] in step_check.py).

Kept apart from the check itself: what every field means, and how a verdict that the ranks diverged is
told -- which ranks hold which value, or only the range over the ranks where the details could not be
exchanged (Note [verdict without details]) -- with the advice that fits what differs.
"""

from __future__ import annotations

from typing import Optional

from ..comm.base import CollectiveError
from .clip_check import EXPLAIN as CLIPS_EXPLAIN
from .mode_check import EXPLAIN as MODES_EXPLAIN
from .scale_check import EXPLAIN as SCALE_EXPLAIN, shown as shown_scale

# A joined rank's value in every slot (Note [joined ranks] in fusedist/ddp/join.py); real values are far above it.
JOINED = -(2**62)

#: The check's vector, in order (Note [step check] in step_check.py says what each counts).
FIELDS = ("sync_step", "forward", "backward", "optimizer_steps", "layout", "collective_seq", "unused", "trainable",
          "modes", "loss_scale", "grads_cleared", "clips", "params", "replicas")

#: Fields that differ while the ranks are at the same point of their steps (every counter agrees).
SAME_POINT_FIELDS = {"modes", "loss_scale", "grads_cleared", "clips", "params"}

_EXPLAIN = {
    "sync_step": "a rank skipped (or added) a synchronized backward pass, so bucket averages "
    "mixed gradients of different steps",
    "forward": "ranks ran a different number of training forward passes (e.g. a rank computed a loss "
    "and skipped its backward/step, or ran an extra forward)",
    "backward": "ranks ran a different number of backward passes (e.g. one more micro-batch under no_sync())",
    "optimizer_steps": "optimizer.step() was called on a different iteration on some ranks",
    "layout": "the gradient bucket layouts (DDP) or the fully_shard units differ",
    "collective_seq": "ranks issued a different number of fusedist collectives before this step "
    "(a collective inside rank-dependent code)",
    "unused": "a different set of parameters received gradients: a different branch of the model ran on some "
    "ranks (pass find_unused_parameters=True if that is intended)",
    "trainable": "ranks changed requires_grad of different parameters after wrapping the model (frozen or "
    "unfrozen on some ranks only); change the same parameters on every rank, before the same forward",
    "modes": MODES_EXPLAIN,
    "loss_scale": SCALE_EXPLAIN,
    "grads_cleared": "optimizer.step() ran with the model's gradients cleared (optimizer.zero_grad() between "
    "backward() and step()) on some ranks only: their step applied nothing while the others applied the averaged "
    "gradients, so the replicas drift apart; clear (or skip the step) on every rank alike",
    "clips": CLIPS_EXPLAIN,
    "params": "the replicated parameters' values differ across ranks: a rank changed its gradients after they "
    "were averaged (code between backward() and optimizer.step() that writes p.grad on some ranks only), changed "
    "weights in place, loaded a checkpoint, stepped an optimizer or a learning-rate scheduler on its own, or the "
    "model was wrapped with init_sync=False from different values; the ranks now train different models (change "
    "gradients and weights on every rank alike; load weights before wrapping)",
    "replicas": "the replicas of a shard (the ranks holding the same pieces along the mesh's replicate dimension) "
    "ran different steps: a whole shard group skipped or added a forward, a backward or an optimizer step, so "
    "the replicate all-reduce averaged gradients of different steps",
}


def differs(table: list[list[int]], column: int) -> bool:
    """Whether the ranks still training hold different values in ``column``."""
    return len({row[column] for row in table if row[0] != JOINED}) > 1


def render_bounds(reduced: list[int], values: list[int], rank: int, detail: dict,
                  error: Optional[CollectiveError]) -> str:
    """The error text when the ranks are known to differ but the all-gather of every rank's
    values failed (Note [verdict without details]): each differing field's range over the
    ranks and this rank's value, then why the details are missing.

    Note [verdict without details]
        The reduced ``[max(v), max(-v)]`` already proves the divergence; the all-gather only
        says which rank holds which value. It fails when another rank never takes part: most
        often the faulty rank itself, which finished its loop (a rank that skipped a
        backward runs out of iterations first, and the verdict of its last step is read at a
        forward it never runs) and destroyed its process group, or which crashed. Raising
        the failed all-gather's error instead would bury the cause under "connection closed
        by peer" and a stall report that calls the rank that diverged one that merely "ran
        fewer iterations"; so the mismatch is still raised, as a :class:`RankMismatchError`
        with what the reduction tells, and the failure (with its stall report) is attached.
    """
    k = len(FIELDS)
    step = values[0] if values[0] != JOINED else reduced[0]
    what = detail.get("subject", "DDP")
    when = ("found by check_consistency()" if detail.get("checked_now") else
            f"in synchronized backward #{step}, whose {detail.get('reduced', 'buckets')} "
            f"0..{detail.get('buckets', 0) - 1} were reduced across ranks that were at different points")
    lines = [f"fusedist {what}: ranks diverged (detected on every rank that took part; this is rank {rank}) {when}:"]
    differing = []  # (the fields reported: digests of different steps are a consequence, not a cause)
    for i, field in enumerate(FIELDS):
        high, low = reduced[i], -reduced[k + i]
        if high == low:
            continue
        explain = detail.get("explain", {}).get(field, _EXPLAIN[field])
        if field == "params":  # a digest: its range says nothing (nor when the steps differ)
            if reduced[0] == -reduced[k]:
                lines.append(f"  {field}: the ranks' digests differ -- {explain}")
                differing.append(field)
            continue
        differing.append(field)
        if field == "replicas":  # a flag (Note [replica check]): its range says nothing
            lines.append(f"  {field}: {explain}")
            continue
        if field == "modes":  # a digest of flags: its range says nothing
            lines.append(f"  {field}: the ranks' modules ran in different train/eval modes -- {explain}")
            continue
        mine = "joined" if values[i] == JOINED else values[i]
        if field == "loss_scale":
            low, high, mine = shown_scale(low), shown_scale(high), mine if mine == "joined" else shown_scale(mine)
        lines.append(f"  {field}: ranks range from {low} to {high} (rank {rank}: {mine}) -- {explain}")
    if error is not None:
        report = getattr(error, "report", None)
        first = str(getattr(error, "cause", None) or error).splitlines()[0]
        lines.append(
            "Which rank holds which value is unknown: exchanging the values failed, because a rank did not "
            f"take part (it crashed, or finished its loop and left): {first}"
        )
        if report:
            lines.append(report)
    lines.append(_advice(differing, detail))
    return "\n".join(lines)


def render_mismatch(table: list[list[int]], rank: int, detail: dict) -> str:
    """The error text: each differing field, which ranks hold which value, and why it matters."""
    joined = [r for r, row in enumerate(table) if row[0] == JOINED]
    step = max((row[0] for row in table if row[0] != JOINED), default=0) if rank in joined else table[rank][0]
    what = detail.get("subject", "DDP")
    named = detail.get("global_ranks")  # on a subgroup: positions -> global ranks
    rank = named[rank] if named else rank
    if detail.get("checked_now"):
        lines = [
            f"fusedist {what}: ranks diverged (detected on every rank; this is rank {rank}) after "
            f"{step} synchronized backward(s), found by check_consistency() (which "
            "fusedist.checkpoint.save runs before writing):"
        ]
    elif [f for i, f in enumerate(FIELDS) if differs(table, i)] == ["params"]:
        lines = [  # the ranks are at the same point, only their parameters differ
            f"fusedist {what}: ranks diverged (detected on every rank; this is rank {rank}): their parameters "
            f"differ, found by the periodic parameter check at synchronized backward #{step} (reported at "
            f"{detail.get('reported_at', 'the next training forward')}):"
        ]
    elif set(f for i, f in enumerate(FIELDS) if differs(table, i)) <= SAME_POINT_FIELDS:
        lines = [  # the ranks are at the same point, but did not run it alike
            f"fusedist {what}: ranks diverged (detected on every rank; this is rank {rank}) in synchronized "
            f"backward #{step}: the ranks were at the same point but did not run it alike (reported at "
            f"{detail.get('reported_at', 'the next training forward')}):"
        ]
    else:
        lines = [
            f"fusedist {what}: ranks diverged (detected on every rank; this is rank {rank}) in synchronized "
            f"backward #{step}, whose {detail.get('reduced', 'buckets')} 0..{detail.get('buckets', 0) - 1} were "
            "reduced across ranks that were at different points (reported at "
            f"{detail.get('reported_at', 'the next training forward')}):"
        ]
    for field_index, field in enumerate(FIELDS):
        groups: dict[int, list[int]] = {}
        for r, row in enumerate(table):
            if r not in joined:
                groups.setdefault(row[field_index], []).append(named[r] if named else r)
        if len(groups) <= 1:
            continue
        if field == "params":  # a digest: which ranks agree is what tells
            if differs(table, 0):
                continue  # digests of different steps (or none on some ranks): a consequence, not a cause
            listing = " | ".join(f"ranks {ranks}" for ranks in sorted(groups.values())) + " hold different values"
            if detail.get("params_listed") is False:  # (a flag of its own, Note [replica check]: no ranks to list)
                lines.append(f"  {field}: {detail.get('explain', {}).get(field, _EXPLAIN[field])}")
                continue
        elif field == "modes":  # a digest of flags: the ranks in each group, the lines below name the modules
            listing = " | ".join(f"ranks {ranks}" for ranks in sorted(groups.values())) + " ran in different modes"
        elif field == "replicas":  # a flag: the lines of each rank's replicas say who ran what
            lines.append(f"  {field}: {detail.get('explain', {}).get(field, _EXPLAIN[field])}")
            continue
        else:
            listing = "; ".join(f"ranks {ranks}: {shown_scale(value) if field == 'loss_scale' else value}"
                                for value, ranks in sorted(groups.items(), key=lambda kv: kv[1]))
        explain = detail.get("explain", {}).get(field, _EXPLAIN[field])
        lines.append(f"  {field}: {listing} -- {explain}")
    if joined:
        joined = [named[r] for r in joined] if named else joined
        lines.append(f"  ranks {joined} had run out of inputs (joined) and were not compared")
    lines.extend(detail.get("trainable_lines", ()))
    lines.extend(detail.get("mode_lines", ()))
    lines.extend(detail.get("param_lines", ()))
    lines.extend(detail.get("replica_lines", ()))
    unused = detail.get("unused_names")
    if unused:
        more = " ..." if len(unused) > 10 else ""
        lines.append(f"  parameters without a gradient on rank {rank}: {unused[:10]}{more}")
    lines.append(_advice([f for i, f in enumerate(FIELDS) if differs(table, i)], detail))
    return "\n".join(lines)


# Note [parameters that differ after the same steps]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# When only the parameter digest differs, every counter the check compares agrees: the ranks
# ran the same forwards, backwards, optimizer steps and collectives, so each bucket averaged
# gradients of the same step and every rank received the same averages. Rank-dependent control
# flow around the step is then ruled out as the cause (it would show in a counter); what is
# left is a change made on some ranks only after the reduce -- most often user code between
# backward() and optimizer.step() that writes p.grad (a rank-local clip, scale or inf/NaN
# fix-up, a gradient edit), or weights changed, loaded or stepped outside the step. The advice
# says that, instead of pointing at control flow.
#
# Limit: the counters cannot see such a change at all, with a torch optimizer or a fused one
# alike -- nothing the check carries describes the gradients after the reduce, and a digest of
# them would be a pass over every gradient at every step. Three such changes have cheap fields of
# their own, named at the next step: a GradScaler scale that differs (Note [loss scale in the step
# check] in scale_check.py), gradients cleared before the step (Note [gradients cleared before
# the step] in optimizer_guard.py) and a clip_grad_norm_ on some ranks only (Note [a clip on some
# ranks only] in clip_check.py). The rest shows only through the parameter
# digest, at its period (FUSEDIST_PARAM_CHECK_EVERY, default 100) and at check_consistency():
# the ranks may train apart for up to that many steps before the error. (An inf written on one
# rank usually turns the parameters NaN on every rank after the next average: the ranks then
# agree again, on NaN, and there is nothing to report across ranks.)


def _advice(differing: list[str], detail: dict) -> str:
    """The error's closing advice, by what differs (Note [parameters that differ after the same steps])."""
    model = detail.get("model", "DistributedDataParallel model")
    if differing == ["params"]:
        return (
            f"The ranks ran the same forwards, backwards, optimizer steps and collectives on their {model}, so "
            "they averaged the same gradients: the values drifted apart after the reduce. Look for code that "
            "writes p.grad or the weights on some ranks only -- between backward() and optimizer.step() (a "
            "rank-local clip or scale, an inf/NaN fix-up, a gradient edit) or around the step -- and make it act "
            "on every rank alike (decide from the averaged gradients, or from a flag all-reduced across ranks). "
            "FUSEDIST_PARAM_CHECK_EVERY=1 compares the parameters at every step, to find the first one."
        )
    if differing and set(differing) <= SAME_POINT_FIELDS:
        return (f"The ranks ran the same forwards, backwards, optimizer steps and collectives on their {model}, "
                "but not alike: make what the field above names the same on every rank.")
    return (
        f"Every rank must run the same sequence of forward/backward/optimizer.step() calls on its {model}; "
        "look for rank-dependent control flow around the step named above."
    )
