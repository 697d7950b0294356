"""DDP's bucket all-reduces post no part fingerprints (Note [parts a caller checked] in
fusedist/comm/base.py): their layout is checked across ranks and their op is fixed, so the
fingerprints of Note [parts agreed before gloo's own all-reduce] were a message to and from every
peer per bucket for nothing (fusedist DDP's step took 1.33x torch DDP's wall on a tiny MLP with
them). The results still match torch DDP, with even inputs and under ``model.join()`` with uneven
ones, where a joined rank's shadow of each bucket pairs with the active rank's bucket (both
skip the fingerprints: one that posted one while its peer did not would time out)."""

import contextlib

import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

import pytest


@contextlib.contextmanager
def _counting_fingerprints():
    """Inside, every fingerprint made appends its tensor's element count to the list yielded."""
    from fusedist.comm import part_agreement

    made, plain = [], part_agreement.fingerprint

    def counted(tensor, op, seq):
        made.append(tensor.numel())
        return plain(tensor, op, seq)

    part_agreement.fingerprint = counted
    try:
        yield made
    finally:
        part_agreement.fingerprint = plain


def _mlp():
    # 8*64 + 64 + 64*64 + 64 + 64*4 + 4 = 4996 fp32 values: a bucket past the exchange's small all-reduces
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _train(model, opt, batches, ctx):
    with ctx:
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()


def _versus_torch(rank, world, steps_per_rank):
    """fusedist DDP and torch DDP trained alike (``steps_per_rank[r]`` batches on rank r, under
    ``join()`` when they differ): largest parameter difference, fingerprints made by fusedist DDP's
    training, and by one plain gloo all-reduce of 1000 values after it (which still posts one)."""
    import fusedist
    from fusedist.comm import get_communicator

    seed = torch.seed() % 2**31  # fresh inputs every run; rank 0's seed rules (broadcast below)
    seed_t = torch.tensor([seed])
    torch.distributed.broadcast(seed_t, 0)
    torch.manual_seed(int(seed_t))
    base = _mlp()
    ours, ref = fusedist.DistributedDataParallel(_mlp()), nn.parallel.DistributedDataParallel(_mlp())
    for m in (ours.module, ref.module):
        m.load_state_dict(base.state_dict())
    gen = torch.Generator().manual_seed(int(seed_t) + rank)
    batches = [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen))
               for _ in range(steps_per_rank[rank])]
    uneven = len(set(steps_per_rank)) > 1
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    with _counting_fingerprints() as from_ddp:
        _train(ours, opt_ours, batches, ours.join() if uneven else contextlib.nullcontext())
    _train(ref, opt_ref, batches, ref.join() if uneven else contextlib.nullcontext())
    plain = torch.randn(1000, generator=gen)
    expected = plain.clone()
    torch.distributed.all_reduce(expected)
    with _counting_fingerprints() as after:
        get_communicator().all_reduce(plain, tag="plain")
    diff = max((a - b).abs().max().item() for a, b in zip(ours.module.parameters(), ref.module.parameters()))
    return diff, from_ddp, after, torch.equal(plain, expected)


def _checked_by_caller(rank, world):
    """A caller's own all-reduces with ``parts_checked=True`` (waited for at once, and launched with
    ``async_op=True``): torch's results bit for bit (two ranks: a sum is order-independent), no fingerprints."""
    from fusedist.comm import get_communicator

    comm = get_communicator()
    gen = torch.Generator().manual_seed(torch.seed() % 2**31 + rank)
    out = []
    for async_op in (False, True):
        x = torch.randn(1000, generator=gen)
        expected = x.clone()
        torch.distributed.all_reduce(expected)
        with _counting_fingerprints() as made:
            comm.all_reduce(x, async_op=async_op, tag="checked", parts_checked=True).wait()
        out.append((torch.equal(x, expected), made))
    return out


SCENARIOS = {
    "test_a_callers_checked_parts_reduce_as_torch_without_fingerprints": {"checked": (_checked_by_caller, ())},
    "test_ddp_buckets_post_no_fingerprints_and_match_torch_ddp": {"even": (_versus_torch, ((4, 4),))},
    "test_joined_ranks_shadows_post_none_either_and_match_torch_ddp_join": {"uneven": (_versus_torch, ((2, 5),))},
}


@pytest.fixture(scope="module")
def launched(request):
    # (FUSEDIST_TIMEOUT_S short: a rank whose bucket waited for a fingerprint its peer never posts fails fast)
    return launch_for_selected(request, SCENARIOS, 2, timeout=180, env={"FUSEDIST_TIMEOUT_S": "30"})


def _check(launched, scenario):
    for rank, result in enumerate(results_of(launched, scenario)):
        diff, from_ddp, after, plain_ok = result
        assert from_ddp == [], f"rank {rank}: DDP's training posted fingerprints of {from_ddp}"
        assert after == [1000] and plain_ok, (rank, after, plain_ok)  # a plain all-reduce still agrees first
        # fp32, a handful of SGD steps on the same averaged gradients: torch DDP's sums in another
        # order round differently by a few ulps per step
        assert diff < 1e-5, f"rank {rank}: parameters differ from torch DDP's by {diff}"


def test_ddp_buckets_post_no_fingerprints_and_match_torch_ddp(launched):
    _check(launched, "even")


def test_joined_ranks_shadows_post_none_either_and_match_torch_ddp_join(launched):
    _check(launched, "uneven")


def test_a_callers_checked_parts_reduce_as_torch_without_fingerprints(launched):
    for rank, per_mode in enumerate(results_of(launched, "checked")):
        assert per_mode == [(True, [])] * 2, (rank, per_mode)


def test_a_communicator_that_compares_nothing_takes_parts_checked_as_a_plain_all_reduce():
    """A Communicator implementation with only ``_all_reduce`` (the direct-NCCL one, a user's) accepts
    ``parts_checked`` and runs its all-reduce as usual."""
    from fusedist.comm import Communicator

    class Recording(Communicator):
        name = "recording"
        _reduce_scatter = _all_gather = _broadcast = _wait_work = lambda self, *a: None

        def _all_reduce(self, tensor, op):
            self.reduced = (tensor.numel(), op)

    comm = Recording(0, 2)
    comm.all_reduce(torch.zeros(6), op="max", parts_checked=True)
    assert comm.reduced == (6, "max")
