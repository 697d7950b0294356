"""SyncBatchNorm when the ranks do not call the same layers (Note [the same layer on every
rank] in fusedist/nn/_sync_stats.py).

Each statistics gather pairs the ranks' payloads by arrival order, so two layers of one width
called in another order on one rank, or a layer run on some ranks only, combined one layer's
statistics with another's and trained on without an error (torch.nn.SyncBatchNorm does the
same). They must now raise on every rank at the gather that mixes them, as soon as the
layers' running statistics tell them apart (from their second training step), and leave the
group usable.
"""

from __future__ import annotations

import time

import torch

from fusedist.testing import run_distributed

# Without the check, the layer run on one rank only leaves the other rank in its backward
# all-reduce: the collective timeout then ends the test instead of a silent pass.
_ENV = {"FUSEDIST_TIMEOUT_S": "15"}


def _layers(n: int):
    from fusedist.nn import SyncBatchNorm

    torch.manual_seed(0)
    return [SyncBatchNorm(4) for _ in range(n)]


def _swapped_once(rank, world_size):
    """Rank 1 runs two layers of one width in the opposite order at step 0 only: that step
    cannot be told (both layers still hold their initial statistics), step 1 is refused."""
    a, b = _layers(2)
    outcome = []
    for step in range(3):
        x = torch.randn(3, 4, 5, requires_grad=True) + rank
        try:
            y = a(b(x)) if (rank == 1 and step == 0) else b(a(x))
            y.sum().backward()
            outcome.append("trained")
        except ValueError as exc:
            outcome.append(str(exc))
            break
    return outcome


def _extra_layer_on_one_rank(rank, world_size):
    """An auxiliary layer of the same width, run by every rank at step 0, and at step 1 by rank
    1 only (a head used on a local condition): its statistics gather pairs with the other
    rank's next layer and is refused at once, on every rank; afterwards the ranks train on in
    step, their running statistics alike."""
    main1, main2, aux = _layers(3)
    outcome = []
    for step in range(3):
        x = torch.randn(3, 4, 5, requires_grad=True)
        start = time.monotonic()
        try:
            y = main1(x)
            if step == 0 or (rank == 1 and step == 1):
                y = y + aux(x)
            main2(y).sum().backward()
            outcome.append("trained")
        except ValueError as exc:
            outcome.append((str(exc), time.monotonic() - start))
    outcome.append([m.running_mean.tolist() + [int(m.num_batches_tracked)] for m in (main1, main2, aux)])
    return outcome


def test_layers_called_in_another_order_are_refused_on_every_rank():
    results = run_distributed(_swapped_once, 2, env=_ENV, timeout=120)
    for outcome in results:
        assert outcome[0] == "trained", outcome
        assert len(outcome) == 2, f"the mixed-up statistics trained on: {outcome}"
        message = outcome[1]
        assert "SyncBatchNorm(4): the ranks are not normalizing the same layer" in message, message
        assert "rank 0: num_batches_tracked=2" in message and "rank 1: num_batches_tracked=2" in message, message
        assert "same order and the same number of times" in message, message


def test_a_layer_run_on_one_rank_only_is_refused_at_once():
    results = run_distributed(_extra_layer_on_one_rank, 2, env=_ENV, timeout=120)
    for outcome in results:
        assert outcome[0] == "trained" and outcome[2] == "trained", outcome
        message, seconds = outcome[1]
        # rank 0 sent main2, which has normalized 2 batches with this one; rank 1 aux, also 2,
        # but with statistics of its own
        assert "the ranks are not normalizing the same layer" in message, message
        assert "rank 0: num_batches_tracked=2" in message and "rank 1: num_batches_tracked=2" in message, message
        assert seconds < 10, f"refused only after {seconds:.1f} s"
    # the refused forwards counted no batch, so the layers still agree across ranks
    assert results[0][3] == results[1][3], "running statistics differ across ranks after the refusal"
    assert [stats[-1] for stats in results[0][3]] == [3, 2, 1]
