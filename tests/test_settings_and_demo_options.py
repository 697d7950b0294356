"""Settings probes: environment variables of README's settings table, ``init_distributed``'s
arguments and environment, and the demo's command line -- a bad value is refused naming it."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import socket
import time

import pytest
import torch
from shared_rank_launch import launch_for_selected, results_of

from fusedist.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stall_under_init_timeout(rank, world_size, rank0_done):
    """Rank 1 comes late to DDP's construction check; it skips it when rank 0 has already given
    up (the file ``rank0_done`` exists: nothing would pair with it, and its own wait would only
    lengthen the run). Had rank 0 waited for it, it finds no file and construction succeeds."""
    import torch.distributed as dist

    import fusedist
    from fusedist.distributed import collective_timeout

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    fusedist.init_distributed(timeout=2)
    seen = collective_timeout()
    if rank == 1:
        time.sleep(3.5)  # late to the construction check, after rank 0's 2 s + 0.5 s: it must not wait for it
        if os.path.exists(rank0_done):
            dist.destroy_process_group()
            return seen, "skipped: rank 0 gave up first", 0.0
    t0 = time.monotonic()
    try:
        fusedist.DistributedDataParallel(torch.nn.Linear(4, 4))
        outcome = "constructed"
    except Exception as exc:  # noqa: BLE001
        outcome = type(exc).__name__
    elapsed = time.monotonic() - t0
    if rank == 0:
        open(rank0_done, "w").close()
    dist.destroy_process_group()
    return seen, outcome, elapsed


def test_init_distributed_timeout_bounds_fusedist_collectives(tmp_path):
    """init_distributed(timeout=2) is every fusedist collective's timeout on that group, as
    torch's init_process_group(timeout=2) is its collectives' (it was 600 s: a 3.5 s late rank
    was waited for, and construction succeeded)."""
    env = {"MASTER_PORT": str(_free_port()), "FUSEDIST_STALL_REPORT_S": "0.5"}
    out = run_distributed(_stall_under_init_timeout, 2, str(tmp_path / "rank0_done"), backend=None, env=env,
                          expect_failure=True, timeout=90)
    status, (seen, outcome, elapsed) = out[0]
    assert status == "ok" and seen == datetime.timedelta(seconds=2)
    assert outcome == "StallError" and elapsed < 4.5, (outcome, elapsed)


def _timeout_after_torch_init(rank, world_size):
    import fusedist
    from fusedist.distributed import collective_timeout

    before = collective_timeout()
    with pytest.raises(ValueError, match=r"init_distributed\(timeout=...\) must be a positive"):
        fusedist.init_distributed(timeout=-1)
    fusedist.init_distributed(timeout=float("inf"))  # no deadline: kept as the bound
    unbounded = collective_timeout()
    fusedist.init_distributed(timeout=3)  # torch.distributed is already initialized (by the harness)
    return before, unbounded, collective_timeout()


def test_init_distributed_timeout_applies_to_a_group_torch_made(harness_group):
    """A timeout passed once torch.distributed is initialized (by Lightning, accelerate, the
    user's own init_process_group) bounds fusedist's collectives: it was silently ignored.
    ``float("inf")`` is no deadline (LONGEST_TIMEOUT_S), as for ``timedelta.max``: it was refused."""
    from fusedist.distributed import LONGEST_TIMEOUT_S

    for before, unbounded, after in results_of(harness_group, "torch_init_timeout"):
        assert before != after == datetime.timedelta(seconds=3)
        assert unbounded == datetime.timedelta(seconds=LONGEST_TIMEOUT_S)


@pytest.mark.parametrize("value", ["abc", "nan", "", "1e-9", "-3", "0", "-inf"])
def test_timeout_setting_bad_values_name_the_variable(monkeypatch, value):
    import fusedist
    from fusedist.distributed import collective_timeout

    monkeypatch.setenv("FUSEDIST_TIMEOUT_S", value)
    with pytest.raises(ValueError, match="FUSEDIST_TIMEOUT_S must be a positive number of seconds"):
        collective_timeout()
    monkeypatch.setenv("FUSEDIST_TIMEOUT_S", "30")
    assert collective_timeout() == datetime.timedelta(seconds=30)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    for bad in (-1, 0, float("nan"), "soon", datetime.timedelta(0)):  # refused before any connection
        with pytest.raises(ValueError, match=r"init_distributed\(timeout=...\) must be a positive"):
            fusedist.init_distributed(timeout=bad)


@pytest.mark.parametrize("value", ["inf", "Infinity", "1e20", "1e9"])
def test_timeout_setting_inf_is_no_deadline(monkeypatch, value):
    """FUSEDIST_TIMEOUT_S=inf (or over the bound) is no deadline, kept as LONGEST_TIMEOUT_S -- what
    ``wait(float("inf"))`` and ``init_distributed(timeout=timedelta.max)`` take -- where it was refused."""
    from fusedist.distributed import LONGEST_TIMEOUT_S, collective_timeout

    monkeypatch.setenv("FUSEDIST_TIMEOUT_S", value)
    assert collective_timeout() == datetime.timedelta(seconds=LONGEST_TIMEOUT_S)


def _init_with_backend_spelling(rank, world_size):
    import torch.distributed as dist

    import fusedist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    info = fusedist.init_distributed(backend="GLOO")
    again = fusedist.init_distributed(backend="gloo")
    dist.destroy_process_group()
    return info.backend, again == info


def test_malformed_launch_environment_names_the_variable(monkeypatch):
    import fusedist

    for name, value in (("RANK", "abc"), ("WORLD_SIZE", "two"), ("LOCAL_RANK", "x")):
        with monkeypatch.context() as m:  # (the ranks below get this process's environment)
            for var, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                                 ("MASTER_PORT", "1"), ("LOCAL_RANK", "0")):
                m.setenv(var, default)
            m.setenv(name, value)
            with pytest.raises(RuntimeError, match=f"{name}='{value}' is not an integer"):
                fusedist.init_distributed()
    # torch spells backends case-insensitively: so does init_distributed (and a second call).
    out = run_distributed(_init_with_backend_spelling, 1, backend=None, env={"MASTER_PORT": str(_free_port())})
    assert out == [("gloo", True)]


def _ddp_construction(rank, world_size, stall_report_s):
    """DDP construction under ``FUSEDIST_STALL_REPORT_S=stall_report_s``, which is read there (a
    rank's environment as a launch would set it; put back after, for the scenarios that follow)."""
    import fusedist

    os.environ["FUSEDIST_STALL_REPORT_S"] = stall_report_s
    try:
        fusedist.DistributedDataParallel(torch.nn.Linear(4, 4))
        return "constructed"
    except ValueError as exc:
        return str(exc)
    finally:
        del os.environ["FUSEDIST_STALL_REPORT_S"]


@pytest.mark.parametrize("value", ["3s", "inf"])
def test_stall_report_setting_is_refused_before_training(monkeypatch, value, harness_group):
    """Documented: a bad FUSEDIST_STALL_REPORT_S is a ValueError naming it. It was read only when
    a collective failed, so a typo replaced the StallError by `could not convert string to
    float`, and `inf` made the failing rank wait forever for a dead peer's entry."""
    from fusedist.reliability.stall_report import report_window_s

    monkeypatch.setenv("FUSEDIST_STALL_REPORT_S", value)
    with pytest.raises(ValueError, match="FUSEDIST_STALL_REPORT_S must be a finite number"):
        report_window_s(600)
    out = results_of(harness_group, f"stall_report {value}")
    # (the value named too: each construction refused its own value, in the ranks' one process)
    assert all("FUSEDIST_STALL_REPORT_S" in o and f"got {value!r}" in o for o in out), out


def _harness_group(trace_prefix: str) -> dict:
    """{test: {scenario: (fn, args)}} that ``harness_group`` runs in one launch, in this order (the
    traced scenario last: its trace, written at exit, holds only its own models' events)."""
    return {
        "test_stall_report_setting_is_refused_before_training": {
            f"stall_report {value}": (_ddp_construction, (value,)) for value in ("3s", "inf")},
        "test_init_distributed_timeout_applies_to_a_group_torch_made": {
            "torch_init_timeout": (_timeout_after_torch_init, ())},
        "test_timeline_keeps_every_models_events_and_refuses_a_missing_directory": {
            "two models traced": (_two_models_traced, (trace_prefix,))},
    }


@pytest.fixture(scope="module")
def harness_group(request, tmp_path_factory):
    """The scenarios of the selected tests that run on the harness's own process group, in one
    launch of 2 ranks (tests/shared_rank_launch.py): starting ranks costs more than they do.
    Also holds the traced scenario's trace prefix, as ``"timeline prefix"``."""
    prefix = str(tmp_path_factory.mktemp("timeline") / "trace")
    return dict(launch_for_selected(request, _harness_group(prefix), 2, timeout=90), **{"timeline prefix": prefix})


def _two_models_traced(rank, world_size, prefix):
    """Ends with FUSEDIST_TIMELINE unset, as it found it: the trace is written at the launch's exit."""
    import fusedist

    os.environ["FUSEDIST_TIMELINE"] = prefix
    try:
        first = fusedist.DistributedDataParallel(torch.nn.Linear(4, 4))
        first(torch.randn(2, 4)).sum().backward()
        second = fusedist.DistributedDataParallel(torch.nn.Linear(4, 8))
        for _ in range(3):
            second(torch.randn(2, 4)).sum().backward()
        os.environ["FUSEDIST_TIMELINE"] = os.path.join(prefix, "missing", "trace")
        try:
            fusedist.DistributedDataParallel(torch.nn.Linear(4, 4))
            return "accepted"
        except ValueError as exc:
            return str(exc)
    finally:
        del os.environ["FUSEDIST_TIMELINE"]


def test_timeline_keeps_every_models_events_and_refuses_a_missing_directory(harness_group):
    """Each rank's trace (written at exit) holds the backwards of every DDP model: the second
    model's were lost (one exit flush per path, the first model's). A prefix in a missing
    directory is refused at construction, not at exit after the run."""
    prefix, out = harness_group["timeline prefix"], results_of(harness_group, "two models traced")
    assert all("FUSEDIST_TIMELINE=" in o and "does not exist" in o for o in out), out
    for rank in range(2):
        with open(f"{prefix}.rank{rank}.json") as f:
            events = json.load(f)["traceEvents"]
        assert sum(e["name"] == "backward begins" for e in events) == 4


def test_launch_cache_setting_refuses_unknown_values(monkeypatch):
    from fusedist.triton_kernels import launch_cache

    for value in ("true", "yes", "2"):
        monkeypatch.setenv("FUSEDIST_TRITON_LAUNCH_CACHE", value)
        with pytest.raises(ValueError, match="FUSEDIST_TRITON_LAUNCH_CACHE must be 0 or 1"):
            launch_cache._enabled()
    monkeypatch.setenv("FUSEDIST_TRITON_LAUNCH_CACHE", "0")
    assert launch_cache._enabled() is False


def test_kernel_backend_setting_empty_is_auto_and_a_typo_is_refused(monkeypatch):
    from fusedist import backend

    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", " ")  # empty, as the other settings take it: the default
    assert backend.requested_backend() == "auto"
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "Torch")
    assert backend.requested_backend() == "torch"
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "trition")
    with pytest.raises(ValueError, match="FUSEDIST_KERNEL_BACKEND='trition' is not one of auto"):
        backend.requested_backend()


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("train_gpt_probe", os.path.join(ROOT, "examples", "train_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-1"], "--steps must be >= 0"),
    (["--resume", "a", "--checkpoint-dir", "b"], "--resume and --checkpoint-dir"),
    (["--dim", "32", "--heads", "3"], "must be a multiple of --heads"),
    (["--context", "0"], "--context must be >= 1"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--checkpoint-dir", "d", "--checkpoint-every", "0"], "--checkpoint-every must be >= 1"),
    (["--overlap-param-gather", "--zero", "0"], "--overlap-param-gather applies to --zero 1 or 2"),
    (["--optimizer", "torch", "--zero", "0", "--precision", "bf16"], "needs FP32 master weights"),
])
def test_demo_refuses_bad_options_before_starting(demo, capsys, argv, message):
    """An argparse error (status 2) before any rank starts, not a checkpoint labelled step -1, an
    ignored --resume or a traceback deep inside the model."""
    with pytest.raises(SystemExit) as info:
        demo.parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert demo.parse_args(["--steps", "0", "--dim", "32", "--heads", "2"]).steps == 0


def test_demo_plot_without_matplotlib_is_refused_first(demo, capsys):
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed")
    with pytest.raises(SystemExit) as info:
        demo.parse_args(["--plot", "x.png"])
    assert info.value.code == 2 and "--plot needs matplotlib" in capsys.readouterr().err

