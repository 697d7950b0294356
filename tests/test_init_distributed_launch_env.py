"""init_distributed names a malformed launch variable (README, Launching: it "says which variables
are missing or malformed"): torch's env:// rendezvous reads MASTER_PORT with a bare int()."""

import pytest


@pytest.mark.parametrize("var, value, words", [
    ("MASTER_PORT", "abc", "MASTER_PORT='abc' is not an integer"),
    ("MASTER_PORT", "70000", "MASTER_PORT=70000 is not a port"),
    ("LOCAL_RANK", "-1", "LOCAL_RANK=-1 is negative"),
])
def test_init_distributed_names_a_malformed_launch_variable(monkeypatch, var, value, words):
    # README (Launching): init_distributed "says which variables are missing or malformed";
    # torch's env:// rendezvous raised a bare int() ValueError for MASTER_PORT.
    import fusedist

    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_RANK": "0"}
    env[var] = value
    for name, v in env.items():
        monkeypatch.setenv(name, v)
    with pytest.raises(RuntimeError, match="malformed launch environment: " + words.replace("(", r"\(")):
        fusedist.init_distributed()


@pytest.mark.parametrize("local_rank, local_world, words", [
    ("2", "2", "LOCAL_RANK=2 is outside LOCAL_WORLD_SIZE=2"),
    ("0", "0", "LOCAL_RANK=0 is outside LOCAL_WORLD_SIZE=0"),
    ("0", "two", "LOCAL_WORLD_SIZE='two' is not an integer"),
])
def test_init_distributed_names_local_rank_outside_local_world_size(monkeypatch, local_rank, local_world, words):
    # torchrun keeps LOCAL_RANK in 0..LOCAL_WORLD_SIZE-1; a hand-set pair that disagrees went on to
    # init_process_group (and, with NCCL, bound a GPU no local process should use).
    import fusedist
    import fusedist.distributed as fd

    def reached(*args, **kwargs):
        raise AssertionError("init_process_group reached with a malformed launch environment")

    monkeypatch.setattr(fd.dist, "init_process_group", reached)
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_world}
    for name, v in env.items():
        monkeypatch.setenv(name, v)
    with pytest.raises(RuntimeError, match="malformed launch environment: " + words):
        fusedist.init_distributed()


class _Reached(Exception):
    pass


def test_init_distributed_accepts_local_rank_below_local_world_size(monkeypatch):
    # the check must not refuse a good launch: it goes on to torch's init_process_group
    import fusedist
    import fusedist.distributed as fd

    def reached(*args, **kwargs):
        raise _Reached

    monkeypatch.setattr(fd.dist, "init_process_group", reached)
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    for name, v in env.items():
        monkeypatch.setenv(name, v)
    with pytest.raises(_Reached):
        fusedist.init_distributed()
