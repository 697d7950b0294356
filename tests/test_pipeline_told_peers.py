"""Note [the next step waits until the peers were told] (fusedist/pipelining/told_peers.py), in one process: how long
the step after a published failure waits for each group's data-parallel peers, read from a store as the ranks'
processes would leave it. (The pp=2 x dp=2 runs are in test_pipelining.py: a retried step meeting a peer late.)"""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from fusedist.pipelining import told_peers as told_peers
from fusedist.reliability import stall_report

PROBE_S = 0.1
TIMEOUT_S = 0.6


class _Comm:
    def __init__(self, rank, group):
        self.rank, self.world_size, self.group = rank, 2, group
        self.timeout = datetime.timedelta(seconds=TIMEOUT_S)


class _Monitor:
    def __init__(self, store, name, rank, group):
        self.store, self.group_name, self.generation, self.reports = store, name, 0, []
        self.comm = _Comm(rank, group)
        self.has_left, self.members, self.torch_group_name = False, [0, 1], ""


class _Stage:
    """What the wait reads of a stage: its module, its index and its steps."""

    def __init__(self, step):
        self.submod, self.stage_index, self._steps_begun = None, 0, step


@pytest.fixture
def groups(monkeypatch):
    """Rank 0's and rank 1's monitors of two groups: ``dp``, the one the stage's gradients are reduced over, and
    ``other`` (another model's, say); rank 0 published a failure to both."""
    monkeypatch.setenv("FUSEDIST_DIVERGENCE_PROBE_S", str(PROBE_S))
    monkeypatch.setenv("FUSEDIST_CHECKS", "1")
    monkeypatch.setattr(told_peers, "MARGIN_S", 0.2)  # (below TIMEOUT_S: the two bounds told apart, quickly)
    store = dist.HashStore()
    made = {}
    for name in ("dp", "other"):
        group = object()
        made[name] = [_Monitor(store, name, rank, group) for rank in range(2)]
    dp_group = made["dp"][0].comm.group
    monkeypatch.setattr(told_peers, "reduction_comms", lambda module: [_Comm(0, dp_group)])
    for rank0, _ in made.values():
        stall_report.publish(store, rank0.group_name, 0, 0, {"kind": "failure", "failed_elsewhere": "the failure"})
    told_peers.count_published([rank0 for rank0, _ in made.values()])
    return made


def _timed(call):
    began = time.monotonic()
    try:
        return call(), time.monotonic() - began
    except RuntimeError as e:
        return e, time.monotonic() - began


def test_a_peer_never_told_fails_the_step_after_the_reducing_groups_timeout_naming_both_steps(groups):
    """The group the stage reduces over is waited for up to its collective timeout (not the probe's delay and
    MARGIN_S, after which a late peer's reductions of the failed step paired with the retried step's), then the
    step is refused naming the peer, the group and both steps; the other group only up to the former bound."""
    error, waited = _timed(lambda: told_peers.wait_until_told(_Stage(2), [groups["dp"][0], groups["other"][0]]))
    assert isinstance(error, RuntimeError), error
    assert TIMEOUT_S <= waited < TIMEOUT_S + 1, waited
    text = str(error)
    assert "step #2 refused" in text and "failure in step #1" in text and "group 'dp'" in text, text
    assert "global ranks [1]" in text, text

    result, waited = _timed(lambda: told_peers.wait_until_told(_Stage(2), [groups["other"][0]]))
    assert result is None and PROBE_S + told_peers.MARGIN_S <= waited < TIMEOUT_S + told_peers.MARGIN_S, waited


def test_a_peer_whose_step_failed_alike_without_publishing_ends_the_wait_at_once(groups, monkeypatch):
    """A peer whose pipeline failed the same step, told at the step's end (Note [a failure told at the step's
    end] in fusedist/pipelining/step_status.py), publishes nothing, never reaches a reduction and so is never told: its
    failed step counts as a published one (once a step), and the wait ends at once."""
    from fusedist.reliability import monitor

    peer_stage = _Stage(1)
    monkeypatch.setattr(monitor, "_monitors", [groups["dp"][1], groups["other"][1]])
    told_peers.count_failed_step(peer_stage)
    told_peers.count_failed_step(peer_stage)  # (a second failure told in the same step: counted once)
    result, waited = _timed(lambda: told_peers.wait_until_told(_Stage(2), [groups["dp"][0]]))
    assert result is None and waited < PROBE_S, waited

    told_peers.step_began(peer_stage)
    told_peers.count_failed_step(peer_stage)  # (the peer's next step failed too: one more)
    assert told_peers._published(groups["dp"][1], 1) == 2


def test_the_counts_of_published_failures_go_with_the_group(groups):
    """The last rank to leave a group deletes its failure counts with its other entries (Note [the last rank to
    leave a group clears its entries] in fusedist/reliability/group_left.py): they stayed for the job's life."""
    from fusedist.reliability import group_left

    rank0, rank1 = groups["dp"]
    key = told_peers._count_key(rank0, 0)
    assert rank0.store.check([key])
    group_left.leave(rank0)
    assert rank0.store.check([key])  # (rank 1 is still in the group: its reports may read them)
    group_left.leave(rank1)
    assert not rank0.store.check([key])
