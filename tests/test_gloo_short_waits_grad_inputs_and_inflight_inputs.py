"""Communicator handles against torch.distributed's gloo works, on random inputs.

A ``wait(timeout)`` shorter than the communicator's timeout that runs out must leave the
collective going, as a torch gloo work's does: a later ``wait()`` returns the result torch's
collective computes, and the group stays usable. (Before, on the gloo exchange, the short
wait failed the exchange for good and gloo closed the connection, so every later collective
of the group failed too.) Also: outputs written outside autograd and inference mode (a
parameter's reduce-scatter, an inference tensor's small all-reduce), an all-gather that sends
its launch-time input, and a gather of complex tensors.

The 2-rank scenarios share one launch of the ranks and the 3-rank ones another
(tests/shared_rank_launch.py): starting the ranks costs more than the scenarios do.
"""

import datetime
import time

import pytest
import torch
from shared_rank_launch import launch_for_selected, results_of


LATE_S = 1.5
SHORT = datetime.timedelta(seconds=0.3)


def _short_waits(rank, world_size, seed):
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator

    comm = get_communicator(None)
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    n = 257
    cases = {
        "all_gather": (torch.empty(n * world_size), torch.randn(n, generator=gen)),
        "reduce_scatter": (torch.empty(n), torch.randn(n * world_size, generator=gen)),
        "all_reduce": (torch.randn(4 * n, generator=gen), None),  # gloo's own all-reduce
        "all_reduce_small": (torch.randint(-9, 9, (3,), generator=gen), None),  # the exchange
    }
    refs = {}
    for name, (out, inp) in cases.items():
        if name == "all_gather":
            refs[name] = torch.empty_like(out)
            dist.all_gather_into_tensor(refs[name], inp)
        elif name == "reduce_scatter":
            full = inp.clone()
            dist.all_reduce(full)
            refs[name] = full.chunk(world_size)[rank]
        else:
            refs[name] = out.clone()
            dist.all_reduce(refs[name])
    if rank == 1:
        time.sleep(LATE_S)  # late: rank 0's short waits run out
    handles = {}
    for name, (out, inp) in cases.items():
        if name == "all_gather":
            handles[name] = comm.all_gather(out, inp, async_op=True, tag=name)
        elif name == "reduce_scatter":
            handles[name] = comm.reduce_scatter(out, inp, async_op=True, tag=name)
        else:
            handles[name] = comm.all_reduce(out, async_op=True, tag=name)
    short = {}
    for name, handle in handles.items():
        try:
            handle.wait(timeout=SHORT)
            short[name] = "completed"
        except CollectiveError as exc:
            short[name] = str(exc)
    errors = []
    for name, handle in handles.items():
        handle.wait()
        handle.wait()  # (twice: a no-op)
        out = cases[name][0]
        if not torch.allclose(out, refs[name], rtol=1e-5, atol=1e-5):
            errors.append(f"{name}: max diff {(out - refs[name]).abs().max()}")
    after = torch.randn(n, generator=gen)
    gathered = torch.empty(n * world_size)
    comm.all_gather(gathered, after, tag="after")
    ref = torch.empty_like(gathered)
    dist.all_gather_into_tensor(ref, after)
    if not torch.equal(gathered, ref):
        errors.append("the next all_gather differs from torch's")
    return short, errors


def test_short_wait_leaves_collective_going_as_torch_gloo(two_ranks):
    launched, seed = two_ranks
    results = results_of(launched, "short_waits")
    for rank, (short, errors) in enumerate(results):
        assert not errors, (rank, seed, errors)
    short = results[0][0]
    for name, message in short.items():
        op = name.replace("_small", "")
        assert f"{op} (tag '{name}'" in message and "rank 0 of 2" in message, (name, message)
        assert "wait() again" in message, (name, message)


def _grad_inputs(rank, world_size, seed):
    import torch.distributed as dist

    from fusedist.comm import get_communicator

    comm = get_communicator(None)
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    n = 37
    errors = []
    for op, torch_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
        for in_place in (False, True):
            param = torch.nn.Parameter(torch.randn(n * world_size, generator=gen))
            ref = param.detach().clone()
            dist.all_reduce(ref, op=torch_op)
            ref = ref.chunk(world_size)[rank]
            out = param.view(-1)[rank * n:(rank + 1) * n] if in_place else torch.empty(n)
            try:
                comm.reduce_scatter(out, param, op=op, tag=f"{op} {in_place}")
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"reduce_scatter {op} in_place={in_place}: {exc}")
                continue
            if not torch.allclose(out.detach(), ref, rtol=1e-5, atol=1e-5):
                errors.append(f"reduce_scatter {op} in_place={in_place}: differs from torch's")
    param = torch.nn.Parameter(torch.randn(n, generator=gen))
    gathered, ref = torch.empty(n * world_size), torch.empty(n * world_size)
    comm.all_gather(gathered, param, tag="gather a parameter")
    dist.all_gather_into_tensor(ref, param.detach())
    if not torch.equal(gathered, ref) or gathered.requires_grad:
        errors.append(f"all_gather of a parameter: equal={torch.equal(gathered, ref)}, "
                      f"requires_grad={gathered.requires_grad}")
    return errors


def test_reduce_scatter_of_a_parameter_matches_torch(three_ranks):
    """A collective records no autograd history: reducing a tensor that requires grad (a
    parameter) works for every op, in place or not, as torch's gloo reduce-scatter does."""
    launched, seed = three_ranks
    for rank, errors in enumerate(results_of(launched, "grad_inputs")):
        assert not errors, (rank, seed, errors)


def _inference_tensors(rank, world_size, seed):
    import torch.distributed as dist

    from fusedist.comm import get_communicator

    comm = get_communicator(None)
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    errors = []
    for n in (3, 600):  # the exchange's small all-reduce, and gloo's own
        for op, torch_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
            with torch.inference_mode():  # e.g. a validation metric
                metric = torch.randint(-50, 50, (n,), generator=gen).float()
            ref = metric.clone()
            dist.all_reduce(ref, op=torch_op)  # torch's collective writes an inference tensor
            for async_op in (False, True):
                with torch.inference_mode():
                    value = metric.clone()
                try:
                    comm.all_reduce(value, op=op, async_op=async_op, tag=f"metric {n} {op}").wait()
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(f"all_reduce {op} of {n} (async_op={async_op}): {exc}")
                    continue
                if not torch.equal(value, ref):
                    errors.append(f"all_reduce {op} of {n} (async_op={async_op}): differs from torch's")
    return errors


def test_all_reduce_of_an_inference_tensor_matches_torch(two_ranks):
    """A tensor made under torch.inference_mode() is all-reduced outside it as torch's
    all_reduce does, whatever its size (small ones go through the exchange) and whichever
    thread drives the collective."""
    launched, seed = two_ranks
    for rank, errors in enumerate(results_of(launched, "inference_tensors")):
        assert not errors, (rank, seed, errors)


def _same_tensor_in_flight(rank, world_size, seed):
    import torch.distributed as dist

    from fusedist.comm import get_communicator

    comm = get_communicator(None)
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    results = []
    for step in range(20):
        # Two collectives in flight on one tensor: which value the second one reads is a race
        # (as on torch's gloo), but every rank must end with the same result.
        x = torch.randint(-50, 50, (3,), generator=gen).float()
        first = comm.all_reduce(x, async_op=True, tag="first")
        second = comm.all_reduce(x, async_op=True, tag="second")
        first.wait()
        second.wait()
        y = torch.randint(-50, 50, (5,), generator=gen)
        gathered = torch.empty(5 * world_size, dtype=y.dtype)
        handle = comm.all_gather(gathered, y, async_op=True, tag="gather")
        y.add_(1000)  # changed before the wait (not allowed with torch; must not split the ranks)
        handle.wait()
        results.append((x.tolist(), gathered.tolist()))
    everyone = [None] * world_size
    dist.all_gather_object(everyone, results)
    return everyone


def test_same_tensor_in_two_collectives_in_flight_stays_consistent_across_ranks(two_ranks):
    launched, seed = two_ranks
    everyone = results_of(launched, "same_tensor_in_flight")[0]
    for step, (mine, other) in enumerate(zip(*everyone)):
        assert mine == other, (seed, step, mine, other)


def _two_all_reduces_one_late_rank(rank, world_size):
    from fusedist.comm import get_communicator

    comm = get_communicator(None)
    x = torch.arange(3, dtype=torch.float32) + 10 * rank
    first = comm.all_reduce(x, async_op=True, tag="first")
    if rank == 0:  # the progress thread finishes the first here before the second is launched
        time.sleep(0.2)
    second = comm.all_reduce(x, async_op=True, tag="second")
    second.wait()
    first.wait()
    total = sum(torch.arange(3, dtype=torch.float32) + 10 * r for r in range(world_size))
    return x.tolist(), (world_size * total).tolist()


def test_collectives_on_one_tensor_take_effect_in_issue_order(two_ranks):
    """Note [one buffer, issue order]: the second all-reduce of a tensor reads the first's
    result on every rank -- also on a rank that launched it only after the first had landed
    there, where the others had read the tensor before (the ranks ended with different values)."""
    for rank, (got, want) in enumerate(results_of(two_ranks[0], "issue_order")):
        assert got == want, (rank, got, want)


def _gather_complex(rank, world_size):
    from fusedist.comm import get_communicator

    comm = get_communicator()
    x = torch.randn(5, dtype=torch.complex64, generator=torch.Generator().manual_seed(rank))
    out = torch.empty(world_size * 5, dtype=torch.complex64) if rank == 0 else None
    comm.gather(out, x, dst=0)
    everyone = [torch.randn(5, dtype=torch.complex64, generator=torch.Generator().manual_seed(r))
                for r in range(world_size)]
    return out is None or torch.equal(out, torch.cat(everyone))


def test_gather_of_complex_tensors(three_ranks):
    """torch's gloo gather refuses complex dtypes ("Invalid scalar type"), which fusedist's
    all-gather and all-reduce carry: the gather sends their real pairs."""
    assert results_of(three_ranks[0], "gather_complex") == [True, True, True]


# ---------------------------------------------------------------- shared launches
#: {test: {scenario: (fn, takes the seed)}}, by world size, in the order the ranks run them
_BY_WORLD = {
    2: {"test_short_wait_leaves_collective_going_as_torch_gloo": {"short_waits": (_short_waits, True)},
        "test_all_reduce_of_an_inference_tensor_matches_torch": {"inference_tensors": (_inference_tensors, True)},
        "test_same_tensor_in_two_collectives_in_flight_stays_consistent_across_ranks": {
            "same_tensor_in_flight": (_same_tensor_in_flight, True)},
        "test_collectives_on_one_tensor_take_effect_in_issue_order": {
            "issue_order": (_two_all_reduces_one_late_rank, False)}},
    3: {"test_reduce_scatter_of_a_parameter_matches_torch": {"grad_inputs": (_grad_inputs, True)},
        "test_gather_of_complex_tensors": {"gather_complex": (_gather_complex, False)}},
}


def _launch(request, world):
    """({scenario: per-rank (passed, result)}, seed) of the selected tests of ``world`` ranks.
    FUSEDIST_TIMEOUT_S: 20 s, far past the short waits (0.3 s) and the late rank (1.5 s) the
    short-wait scenario needs, and a bound on a scenario that hangs well under ``timeout``."""
    seed = int(time.time()) % 1000
    by_test = {test: {name: (fn, (seed,) if seeded else ()) for name, (fn, seeded) in scenarios.items()}
               for test, scenarios in _BY_WORLD[world].items()}
    return launch_for_selected(request, by_test, world, 120, env={"FUSEDIST_TIMEOUT_S": "20"}), seed


@pytest.fixture(scope="module")
def two_ranks(request):
    return _launch(request, 2)


@pytest.fixture(scope="module")
def three_ranks(request):
    return _launch(request, 3)
