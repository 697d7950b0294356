"""gloo's own synchronous all-reduces: ranks whose tensors differ in size, dtype or op are told so on
every rank, naming each rank's part, where gloo ended every process (another size) or returned
garbage (another dtype of the same byte count, another op); parts that agree reduce as
torch.distributed does, bit for bit (Note [parts agreed before gloo's own all-reduce] in
fusedist/comm/part_agreement.py). Also refusals made before any launch: what they name, and a zero
timeout given to a communicator's constructor."""

import pytest
import torch

from shared_rank_launch import launch_for_selected, results_of

# (1000 float32 values: 4000 bytes, past the exchange's small all-reduces, so gloo's own all-reduce.)
N = 1000


def _reference(rank: int, tensor: torch.Tensor, op: str) -> torch.Tensor:
    """torch.distributed's all-reduce of a copy of ``tensor``."""
    import torch.distributed as dist

    out = tensor.clone()
    dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return out


def _agreeing(rank, world):
    """Parts that agree (shapes may differ: the collective is over flat tensors, as gloo's)."""
    from fusedist.comm import get_communicator

    comm = get_communicator()
    gen = torch.Generator().manual_seed(torch.seed() % 2**31 + rank)  # fresh inputs every run
    out = []
    for dtype, op, shape in ((torch.float32, "sum", (N,)), (torch.float64, "max", (10, 100) if rank else (100, 10)),
                             (torch.bfloat16, "sum", (N,)), (torch.int64, "min", (N,))):
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=gen).to(dtype)
        else:
            t = torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)
        for mode in ("sync", "async", "mixed"):  # mixed: rank 0 waits at once, rank 1 later
            x = t.clone()
            expected = _reference(rank, x, op)
            handle = comm.all_reduce(x, op=op, tag="agreeing", async_op=mode == "async" or (mode == "mixed" and rank))
            handle.wait()
            # Two ranks: every op is order-independent, so gloo's own result is bit for bit torch's.
            out.append((str(dtype), op, mode, torch.equal(x, expected)))
    return out


def _disagreeing(rank, world, case):
    from fusedist.comm import CollectiveError, get_communicator

    comm = get_communicator()
    if case == "size":  # (without the agreement: SIGABRT in gloo's transport, on both ranks)
        t, op = torch.ones(N + rank), "sum"
    elif case == "dtype":  # the same 4000 bytes: without it, garbage on both ranks
        t, op = (torch.ones(N), "sum") if rank == 0 else (torch.ones(N // 2, dtype=torch.float64), "sum")
    else:  # op (and "async op"): without it, each rank reduced with its own op, and the results differed
        t, op = torch.randn(N), ("max" if rank == 0 else "sum")
    sent = t.clone()
    try:
        comm.all_reduce(t, op=op, tag=f"parts differ by {case}", async_op=case.startswith("async")).wait()
        message = "no error"
    except CollectiveError as exc:
        message = str(exc)
    # The ranks are still in step and the group usable: the next all-reduce is torch's.
    after = torch.randn(N, generator=torch.Generator().manual_seed(torch.seed() % 2**31 + rank))
    expected = _reference(rank, after, "sum")
    comm.all_reduce(after, tag="after the mismatch")
    return message, torch.equal(t, sent), torch.equal(after, expected), comm.aborted


SCENARIOS = {
    "test_agreeing_parts_reduce_as_torch_does": {"agreeing": (_agreeing, ())},
    "test_parts_that_differ_fail_on_every_rank_naming_each_and_the_group_goes_on": {
        # (size last: without the agreement it ended the launch)
        case: (_disagreeing, (case,)) for case in ("dtype", "op", "async op", "size")},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, 2, timeout=120, env={"FUSEDIST_TIMEOUT_S": "20"})


def test_agreeing_parts_reduce_as_torch_does(launched):
    for per_rank in results_of(launched, "agreeing"):
        assert len(per_rank) == 12 and all(equal for *_, equal in per_rank), per_rank


def _part(numel, dtype="float32", op="sum"):
    return f"{numel} x torch.{dtype} (shape ({numel},)), op {op}"


@pytest.mark.parametrize("case, parts", [
    ("dtype", f"rank 0: {_part(N)}; rank 1: {_part(N // 2, 'float64')}"),
    ("op", f"rank 0: {_part(N, op='max')}; rank 1: {_part(N)}"),
    ("async op", f"rank 0: {_part(N, op='max')}; rank 1: {_part(N)}"),
    ("size", f"rank 0: {_part(N)}; rank 1: {_part(N + 1)}"),
])
def test_parts_that_differ_fail_on_every_rank_naming_each_and_the_group_goes_on(launched, case, parts):
    for rank, (message, unchanged, after_ok, aborted) in enumerate(results_of(launched, case)):
        assert message.startswith(f"fusedist: all_reduce (tag 'parts differ by {case}', collective #"), message
        assert f"failed on rank {rank} of 2: the ranks' tensors differ ({parts})" in message, message
        if case.startswith("async"):  # launched before the parts could be compared: gloo reduced them
            assert "launched with async_op=True" in message and "holds garbage" in message, message
        else:
            assert "launched on no rank" in message, message
            assert unchanged, "nothing was reduced into the tensor"
        assert after_ok and not aborted


class _Local:
    """A communicator with no peers to reach: the refusals below come before any launch."""

    @staticmethod
    def make(rank=1):
        from fusedist.comm import Communicator

        class Local(Communicator):
            name = "local"
            _all_reduce = _reduce_scatter = _all_gather = _broadcast = _wait_work = lambda self, *a: None

        return Local(rank, 2)


def test_refusals_name_the_rank_the_tag_and_the_tensor():
    """Before: "fusedist all_reduce: tensors must be contiguous (got strides (1, 4))" and "dtype mismatch
    [torch.float32, torch.int64]": no rank, no tag, no shape, no way to tell the output from the input."""
    comm = _Local.make(rank=1)
    with pytest.raises(ValueError) as info:
        comm.all_reduce(torch.zeros(4, 3).t(), tag="grads")
    assert str(info.value).startswith("fusedist all_reduce [grads] on rank 1: the tensor (shape (3, 4), strides "
                                      "(1, 3)) is not contiguous; pass a contiguous tensor"), info.value
    with pytest.raises(ValueError) as info:
        comm.reduce_scatter(torch.zeros(2), torch.zeros(4, dtype=torch.int64), tag="shards")
    assert str(info.value).startswith("fusedist reduce_scatter [shards] on rank 1: the tensors' dtypes differ "
                                      "(output torch.float32, input torch.int64)"), info.value


@pytest.mark.parametrize("timeout", [0, 0.0, "zero timedelta"])
def test_a_zero_timeout_is_refused_when_given_to_the_constructor_as_when_set(timeout):
    """Before, the constructor read a zero timeout as "none given" and used FUSEDIST_TIMEOUT_S (600 s by
    default), silently, where setting ``comm.timeout = 0`` later was refused."""
    import datetime

    timeout = datetime.timedelta(0) if timeout == "zero timedelta" else timeout
    comm = _Local.make()
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        comm.timeout = timeout
    with pytest.raises(ValueError, match="the local communicator's timeout must be a positive number of seconds"):
        type(comm)(0, 2, timeout)
