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
