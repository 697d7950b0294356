"""The launcher switch for several ranks on one GPU (Note [several ranks on one GPU] in
fusedist/testing/shared_gpu.py): the environment each rank gets, checked on CPU, through the
pure function and through both launchers (the multiprocess harness and torchrun)."""

import json
import os
import re
import textwrap

import pytest
from torchrun_launch import finish, launch

from fusedist.testing import (RANKS_PER_GPU_ENV, device_for_rank, rank_environment, rank_slots,
                              ranks_per_gpu_setting, run_distributed)
from fusedist.testing import run_rank

NCCL_KEYS = ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE")


def test_two_ranks_per_gpu_environment():
    envs = [rank_environment(rank, 2) for rank in range(4)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1", "1"]
    # Distinct host ids on every rank, also between ranks of different GPUs: NCCL compares
    # host hash and bus id, and ranks sharing a GPU must differ in the hash.
    assert len({e["NCCL_HOSTID"] for e in envs}) == 4
    for e in envs:
        assert e["NCCL_SOCKET_IFNAME"] == "lo" and e["NCCL_IB_DISABLE"] == "1"
        assert set(e) == {"LOCAL_RANK", *NCCL_KEYS}
    assert envs[3]["NCCL_HOSTID"] == "fusedist-rank3"


def test_one_rank_per_gpu_leaves_nccl_alone():
    for rank in range(3):
        assert rank_environment(rank, 1) == {"LOCAL_RANK": str(rank)}


def test_device_comes_from_the_local_rank_and_must_exist():
    # Second machine of a job: global rank 6 is local slot 2, so device 1 at 2 per GPU; its
    # host id still names the global rank (unique across machines).
    env = rank_environment(6, 2, local_rank=2, gpu_count=2)
    assert env["LOCAL_RANK"] == "1" and env["NCCL_HOSTID"] == "fusedist-rank6"
    assert rank_environment(3, 4, gpu_count=1)["LOCAL_RANK"] == "0"
    with pytest.raises(ValueError, match=r"local rank 2 would use cuda:1, but 1 GPU\(s\) are visible.*holds 2 ranks"):
        rank_environment(2, 2, gpu_count=1)
    with pytest.raises(ValueError, match="ranks_per_gpu must be >= 1"):
        rank_environment(0, 0)
    assert rank_slots(1, 2) == 2 and rank_slots(2, None) == 2
    assert device_for_rank(3, 2) == 1 and device_for_rank(3, 1) == 3


def test_setting_parsing():
    assert ranks_per_gpu_setting({}) is None
    assert ranks_per_gpu_setting({RANKS_PER_GPU_ENV: " "}) is None
    assert ranks_per_gpu_setting({RANKS_PER_GPU_ENV: "2"}) == 2
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match=f"{RANKS_PER_GPU_ENV} must be a positive integer"):
            ranks_per_gpu_setting({RANKS_PER_GPU_ENV: bad})


def test_torchrun_worker_applies_the_setting_only_when_set():
    environ = {"RANK": "5", "LOCAL_RANK": "1", RANKS_PER_GPU_ENV: "2"}
    assert run_rank.apply(environ)["NCCL_HOSTID"] == "fusedist-rank5"
    assert environ["LOCAL_RANK"] == "0" and environ["NCCL_SOCKET_IFNAME"] == "lo"
    untouched = {"RANK": "1", "LOCAL_RANK": "1"}
    assert run_rank.apply(untouched) == {} and untouched == {"RANK": "1", "LOCAL_RANK": "1"}


def _seen_env(rank, world_size):
    return {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", *NCCL_KEYS)}


def test_run_distributed_gives_each_rank_its_environment(monkeypatch):
    monkeypatch.setenv(RANKS_PER_GPU_ENV, "2")
    # The caller's env wins over the sharing settings (a test that sets one means it).
    seen = run_distributed(_seen_env, 2, env={"NCCL_IB_DISABLE": "0"}, timeout=90)
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "0"]
    assert [s["RANK"] for s in seen] == ["0", "1"]
    assert [s["NCCL_HOSTID"] for s in seen] == ["fusedist-rank0", "fusedist-rank1"]
    assert all(s["NCCL_SOCKET_IFNAME"] == "lo" and s["NCCL_IB_DISABLE"] == "0" for s in seen)


_SCRIPT = textwrap.dedent("""
    import json, os, sys
    keys = ("RANK", "LOCAL_RANK", "NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE")
    # One write per line: under PYTHONUNBUFFERED, print's text and newline are two writes,
    # and the two workers' lines can interleave on the shared pipe.
    sys.stdout.write("ENV " + json.dumps({"name": __name__, "argv": sys.argv[1:],
                                          **{k: os.environ.get(k) for k in keys}}) + "\\n")
    sys.stdout.flush()
""")


def test_torchrun_launch_gives_each_worker_its_environment(tmp_path):
    script = tmp_path / "show_env.py"
    script.write_text(_SCRIPT)
    rc, out = finish(launch(str(script), "--flag", "x", env={RANKS_PER_GPU_ENV: "2"}), timeout=120)
    assert rc == 0, out[-3000:]
    seen = sorted((json.loads(found) for found in re.findall(r"ENV (\{[^{}]*\})", out)), key=lambda s: s["RANK"])
    assert [s["RANK"] for s in seen] == ["0", "1"], out[-3000:]
    for s in seen:
        assert s["name"] == "__main__" and s["argv"] == ["--flag", "x"]
        assert s["LOCAL_RANK"] == "0" and s["NCCL_SOCKET_IFNAME"] == "lo" and s["NCCL_IB_DISABLE"] == "1"
    assert [s["NCCL_HOSTID"] for s in seen] == ["fusedist-rank0", "fusedist-rank1"]
