"""How the multi-rank harness reports ranks that end unusually, and settings checked at first use.

* ``run_distributed``: a rank ending with ``sys.exit`` is judged by its status as a launcher
  would (0 is a clean end, anything else a failure naming the rank and code); a rank killed by
  a signal is named with the signal; ranks past the deadline are killed and named; and
  ``expect_failure=True`` reports a rank as failed exactly when the raising mode would.
* ``FUSEDIST_CPU_ISA`` / ``FUSEDIST_TEST_START``: a misspelt value raises naming the accepted
  ones, whatever backend the step would have run with.
* Cross-rank checks name the entries only some ranks hold (a layer more on one rank); a model
  built after ``fusedist._process_hooks.uninstall()`` publishes crashes again; a stall report
  leaves the process group's store with its own timeout.
"""

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fusedist import _extension
from fusedist.optim import FusedAdamW
from fusedist.optim import functional
from fusedist.testing import DistributedRunError, run_distributed
from shared_rank_launch import launch_for_selected, results_of


def _exits(rank, world_size, codes):
    """Rank r >= 1 ends through sys.exit(codes[r - 1]) (``("raise", c)``: raise SystemExit(c)
    itself); several ranks, one code each, share one launch."""
    if rank >= 1:
        code = codes[rank - 1]
        if isinstance(code, tuple):
            raise SystemExit(code[1])
        sys.exit(code)
    return rank * 10


def test_sys_exit_in_a_rank_is_judged_by_its_status():
    clean = (0, None, False)
    assert run_distributed(_exits, 1 + len(clean), clean, timeout=60) == [0, None, None, None]
    failing = ((3, 3), (("raise", 4), 4), ("fatal: bad config", 1), (True, 1))
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_exits, 1 + len(failing), [code for code, _ in failing], timeout=60)
    assert set(info.value.failures) == {1, 2, 3, 4}, info.value.failures
    for rank, (code, status) in enumerate(failing, start=1):
        failure = info.value.failures[rank]
        assert f"rank {rank} exited with code {status} (sys.exit(" in failure, (code, failure)
        assert "SystemExit" in failure, (code, failure)
    results = run_distributed(_exits, 2, [3], timeout=60, expect_failure=True)
    assert results[0] == ("ok", 0)
    assert results[1][0] == "error" and "rank 1 exited with code 3" in results[1][1]


#: how a rank dies (one rank each, ranks 1, 2, 3 of one launch), and what the report says
_DEATHS = (("signal", "rank 1 was killed by SIGKILL (exit code -9) without reporting"),
           ("os._exit", "rank 2 exited with code 5 without reporting"),
           ("exit code at shutdown", "rank 3 returned its result, then exited with code 7"))


def _dies(rank, world_size):
    # every rank past the group's set-up first: gloo connects the ranks pairwise, and a rank
    # dying while a peer still connects fails that peer's init_process_group instead
    torch.distributed.barrier()
    how = _DEATHS[rank - 1][0] if rank >= 1 else None
    if how == "signal":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit code at shutdown":
        import atexit

        atexit.register(os._exit, 7)  # the rank answers first, then its exit fails
    elif how == "os._exit":
        os._exit(5)
    return rank


def test_ranks_that_die_are_reported_the_same_way_in_both_modes():
    world = 1 + len(_DEATHS)
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_dies, world, timeout=60)
    assert set(info.value.failures) == {1, 2, 3}, info.value.failures
    results = run_distributed(_dies, world, timeout=60, expect_failure=True)
    assert results[0] == ("ok", 0), results
    for rank, (how, text) in enumerate(_DEATHS, start=1):
        assert text in info.value.failures[rank], (how, info.value.failures)
        assert results[rank][0] == "error" and text in results[rank][1], (how, results)


def _hangs(rank, world_size):
    if rank == 1:
        time.sleep(120)
    return rank


def test_a_rank_past_the_deadline_is_killed_and_named():
    # (not timed: how soon it is killed depends on the machine's load.) Rank 0 ends within
    # about 1.5 s of its start on a loaded 2-core machine; 5 s leaves it 3x that. Both modes
    # run at once, each launch waited for on its own thread: one deadline's wait, not two.
    with ThreadPoolExecutor(2) as pool:
        lenient = pool.submit(run_distributed, _hangs, 2, timeout=5, expect_failure=True)
        strict = pool.submit(run_distributed, _hangs, 2, timeout=5)
        results = lenient.result()
        assert results[0] == ("ok", 0)
        # with where it hung (Note [a hung rank's stacks] in fusedist/testing/multiprocess.py)
        status, text = results[1]
        assert status == "error" and text.startswith(
            "rank 1 did not finish within 5 s (killed)\nwhere its threads were when it was killed:\n"), text
        assert "in _hangs" in text, text
        with pytest.raises(DistributedRunError, match=r"1 of 2 ranks failed; hung: \[1\]"):
            strict.result()


def test_a_misspelt_start_method_is_refused(monkeypatch):
    monkeypatch.setenv("FUSEDIST_TEST_START", "spwan")
    with pytest.raises(ValueError, match="FUSEDIST_TEST_START='spwan' is not one of forkserver, spawn"):
        run_distributed(_exits, 2, [0], timeout=60)


def _adamw_pair(seed):
    torch.manual_seed(seed)
    ours = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_misspelt_cpu_isa_is_refused_whatever_backend_runs_the_step(monkeypatch, backend):
    """With TRITON_INTERPRET=1 (or FUSEDIST_KERNEL_BACKEND=torch) the C++ kernel never runs,
    so its setting was never read: ``avx5l2`` stepped silently."""
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", backend)
    ours, ref = _adamw_pair(0)
    opt = FusedAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(4, 6)
    functional._has_cpu_adam.cache_clear()  # (the first step of a process is where it is asked)
    monkeypatch.setenv("FUSEDIST_CPU_ISA", "avx5l2")
    before = [p.detach().clone() for p in ours.parameters()]
    with pytest.raises(ValueError, match=r"FUSEDIST_CPU_ISA='avx5l2' is not one of auto, scalar, avx2, avx512"):
        _step(ours, opt, x)
    assert all(torch.equal(a, p) for a, p in zip(before, ours.parameters()))
    # ... and changed nothing: corrected, the same optimizer's first step is torch's first step
    # (the failed step had counted itself, and every later bias correction was off)
    monkeypatch.setenv("FUSEDIST_CPU_ISA", "auto")
    functional._has_cpu_adam.cache_clear()
    opt.step()
    _step(ref, ref_opt, x)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # accepted values (any case, blank = default) step as torch does
    for value in ("", " Auto ", "scalar"):
        monkeypatch.setenv("FUSEDIST_CPU_ISA", value)
        functional._has_cpu_adam.cache_clear()
        fresh, ref = _adamw_pair(1)
        opt, ref_opt = (FusedAdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1),
                        torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1))
        for _ in range(2):
            x = torch.randn(4, 6)
            _step(fresh, opt, x)
            _step(ref, ref_opt, x)
        for a, b in zip(fresh.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_cpu_extension_is_refused_by_name_under_a_misspelt_isa(monkeypatch):
    """Asking whether the CPU extension is available checks the setting first."""
    monkeypatch.setenv("FUSEDIST_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="FUSEDIST_CPU_ISA='sse9' is not one of auto, scalar, avx2, avx512"):
        _extension.is_available("_cpu_ops")
    assert _extension.is_available("_C") in (True, False)  # other extensions have no such setting
    monkeypatch.setenv("FUSEDIST_CPU_ISA", "AVX2")
    _extension.check_settings("_cpu_ops")
    from fusedist.optim import _cpu_adam

    assert set(_extension._SETTINGS["_cpu_ops"][1]) == set(_cpu_adam._ISA_CODES)  # one list of values


def _extra_layer_on_rank_1(rank, world_size):
    import fusedist
    from fusedist import RankMismatchError

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    if rank == 1:
        net.add_module("extra", torch.nn.Linear(2, 2))
    try:
        fusedist.DistributedDataParallel(net)
    except RankMismatchError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def launched(request):
    """The two tests whose ranks run to their end, in one launch (the others' ranks exit, die or
    are refused before they start)."""
    return launch_for_selected(request, {
        "test_a_layer_more_on_one_rank_is_named_not_read_as_a_settings_difference": {
            "extra layer": (_extra_layer_on_rank_1, ())},
        "test_a_model_built_after_uninstall_publishes_crashes_again": {  # last: it uninstalls the hooks
            "hooks after uninstall": (_hooks_after_uninstall, ())},
    }, 2, timeout=60)


def test_a_layer_more_on_one_rank_is_named_not_read_as_a_settings_difference(launched):
    """The first difference by position paired rank 1's extra parameter with rank 0's first
    setting entry; the message now also names what only some ranks hold."""
    for text in results_of(launched, "extra layer"):
        assert text is not None
        assert ("Not on every rank: ranks [1] hold param 'extra.weight' shape (2, 2) dtype torch.float32, "
                "param 'extra.bias' shape (2,) dtype torch.float32.") in text, text


def test_entries_not_on_every_rank_are_grouped_by_rank():
    from fusedist._consistency import describe_unshared

    everyone = [["a", "b", "c"], ["a", "c"], ["a", "b", "c", "d", "e", "f", "g"], ["c", "a", "b"]]
    assert describe_unshared(everyone, str) == "ranks [0, 3] hold b; ranks [2] hold b, d, e, ... (5 in all)"
    assert describe_unshared([["a", "b"], ["b", "a"]], str) is None


class _RebuildsOnlyInTheRank:
    """Pickles in the rank; rebuilding it in the parent raises (a class importable only there)."""

    def __reduce__(self):
        return (_refuse_rebuild, (os.getpid(),))


def _refuse_rebuild(pid):
    if pid != os.getpid():
        raise ModuleNotFoundError("No module named 'only_in_the_rank'")
    return _RebuildsOnlyInTheRank()


def _returns_unrebuildable(rank, world_size):
    return _RebuildsOnlyInTheRank() if rank == 1 else rank


def test_a_result_that_cannot_be_unpickled_is_that_ranks_failure():
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_returns_unrebuildable, 2, timeout=60)
    assert set(info.value.failures) == {1}
    assert "rank 1 returned a result that cannot be unpickled here" in info.value.failures[1]
    assert "No module named 'only_in_the_rank'" in info.value.failures[1]
    results = run_distributed(_returns_unrebuildable, 2, timeout=60, expect_failure=True)
    assert results[0] == ("ok", 0) and results[1][0] == "error", results


def _hooks_after_uninstall(rank, world_size):
    import fusedist
    from fusedist import _process_hooks

    fusedist.DistributedDataParallel(torch.nn.Linear(3, 2))
    first = _process_hooks.installed()
    _process_hooks.uninstall()
    fusedist.DistributedDataParallel(torch.nn.Linear(3, 2))  # the same group, its monitor kept
    return first, _process_hooks.installed()


def test_a_model_built_after_uninstall_publishes_crashes_again(launched):
    for first, again in results_of(launched, "hooks after uninstall"):
        for key in ("publish a crashed rank", "publish a rank's exit"):
            assert key in first and key in again, (first, again)


def _store_timeout_around_a_failure(rank, world_size):
    import fusedist
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    before = store.timeout
    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        if rank == 1 and step == 1:
            os._exit(3)  # a peer dies while rank 0 is in its gradient all-reduce
        try:
            model(torch.randn(3, 4)).sum().backward()
        except Exception as exc:  # the program catches it and goes on (rebuilds its groups, say)
            return type(exc).__name__, before, store.timeout
        opt.step()
        opt.zero_grad()
    return None, before, store.timeout


def test_a_stall_report_gives_the_store_its_timeout_back():
    """The report's store calls are bounded to a few seconds; torch's later users of the same
    store (an NCCL communicator's id exchange after an in-process restart) get its own back."""
    results = run_distributed(_store_timeout_around_a_failure, 2, timeout=90, pg_timeout=40,
                              env={"FUSEDIST_TIMEOUT_S": "20"}, expect_failure=True)
    status, (error, before, after) = results[0]
    assert status == "ok" and error == "StallError", results
    assert before.total_seconds() == 40 and after == before, (before, after)
    assert results[1] == ("error", "rank 1 exited with code 3 without reporting")


def test_an_environment_value_that_is_not_a_string_is_refused_by_name():
    with pytest.raises(TypeError, match=r"'FUSEDIST_TIMEOUT_S'=5 \(int\); pass 'FUSEDIST_TIMEOUT_S': '5'"):
        run_distributed(_exits, 2, [0], timeout=60, env={"FUSEDIST_TIMEOUT_S": 5})
