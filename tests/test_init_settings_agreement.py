"""init_distributed checks the FUSEDIST_* settings of the group it creates (Note [settings that must agree]
in fusedist/reliability/settings_agreement.py): a setting that decides which collectives a step runs, different on
one rank, is one error on every rank naming it -- where it was a stall until the collective timeout ("Application
timeout caused pair closure") or "Connection closed by peer" at the first backward; torch has no such check
(it knows none of these settings), so the reference is the same prompt error on every rank. A setting read only
late (a checkpoint's peer silence) is refused at the start."""

from __future__ import annotations

import os
import socket

import pytest

from fusedist.testing import run_distributed

# (name, {variable: per-rank values}); run in this order in one launch, each on a group of its own
_CASES = [
    ("checks differ", {"FUSEDIST_CHECKS": ("1", "0")}),
    ("checks spelt differently", {"FUSEDIST_CHECKS": ("1", "true")}),
    ("param check period set on one rank", {"FUSEDIST_PARAM_CHECK_EVERY": (None, "1")}),
    ("gloo collectives misspelt on one rank", {"FUSEDIST_GLOO_COLLECTIVES": ("p2p", "xyz")}),
    ("peer silence nan everywhere", {"FUSEDIST_CHECKPOINT_PEER_SILENCE_S": ("nan", "nan")}),
    ("after the refusals", {}),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_under_each_case(rank, world, ports):
    """init_distributed under each case's settings: ``{case: ("ok", backend) or ("error", type, message)}``."""
    import torch.distributed as dist

    import fusedist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    out = {}
    for (name, settings), port in zip(_CASES, ports):
        os.environ["MASTER_PORT"] = str(port)
        for variable, values in settings.items():
            if values[rank] is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = values[rank]
        try:
            info = fusedist.init_distributed(backend="gloo", timeout=20)
            out[name] = ("ok", info.backend)
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[name] = ("error", type(exc).__name__, str(exc), dist.is_initialized())
        for variable in settings:
            os.environ.pop(variable, None)
    out["ddp over torch's init"] = _ddp_over_torchs_init(rank, ports[-1])
    return out


def _ddp_over_torchs_init(rank, port):
    """FUSEDIST_CHECKS differing across ranks under a group torch's init_process_group made (no
    init_distributed check): fusedist's DDP construction check names it."""
    import torch
    import torch.distributed as dist

    import fusedist

    os.environ["MASTER_PORT"], os.environ["FUSEDIST_CHECKS"] = str(port), ("1", "0")[rank]
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        fusedist.DistributedDataParallel(torch.nn.Linear(2, 2))
        return ("ok",)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return ("error", type(exc).__name__, str(exc))
    finally:
        os.environ.pop("FUSEDIST_CHECKS", None)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched():
    return run_distributed(_init_under_each_case, 2, [_free_port() for _ in _CASES] + [_free_port()], backend=None,
                           timeout=90)


def test_ddp_over_torchs_own_init_compares_the_settings_that_must_agree(launched):
    results = [by_case["ddp over torch's init"] for by_case in launched]
    assert [r[:2] for r in results] == [("error", "RankMismatchError")] * 2, results
    for r in results:
        assert "FUSEDIST_CHECKS=True" in r[2] and "FUSEDIST_CHECKS=False" in r[2], r[2]


def _errors(launched, case):
    results = [by_case[case] for by_case in launched]
    assert all(r[0] == "error" for r in results), results
    assert [r[3] for r in results] == [False, False], "the refused group must be destroyed on every rank"
    assert results[0][1] == results[1][1] == "SettingsError"
    return [r[2] for r in results]


def test_checks_on_one_rank_only_is_named_on_every_rank(launched):
    for rank, message in enumerate(_errors(launched, "checks differ")):
        assert f"FUSEDIST_CHECKS differs across ranks (this is rank {rank}): ranks [0]: '1'; ranks [1]: '0'" in message


def test_a_setting_set_on_one_rank_only_is_named_with_its_default_elsewhere(launched):
    for message in _errors(launched, "param check period set on one rank"):
        assert "FUSEDIST_PARAM_CHECK_EVERY differs across ranks" in message and "ranks [0]: unset; ranks [1]: '1'" \
            in message


def test_a_bad_value_on_one_rank_is_refused_on_every_rank_naming_it(launched):
    for message in _errors(launched, "gloo collectives misspelt on one rank"):
        assert "FUSEDIST_GLOO_COLLECTIVES='xyz' is refused on ranks [1]" in message
        assert "must be one of ('p2p', 'builtin')" in message


def test_a_setting_read_at_the_first_save_is_refused_at_init(launched):
    for message in _errors(launched, "peer silence nan everywhere"):
        assert "FUSEDIST_CHECKPOINT_PEER_SILENCE_S='nan' is refused on ranks [0, 1]" in message
        assert "finite number of seconds of at least 2" in message


def test_equal_settings_spelt_differently_and_a_retry_after_a_refusal_initialize(launched):
    # "1" and "true" both turn the checks on: no refusal; a refused init left no group behind, so the
    # next init_distributed makes a new, checked one instead of returning the refused one
    for case in ("checks spelt differently", "after the refusals"):
        assert [by_case[case] for by_case in launched] == [("ok", "gloo"), ("ok", "gloo")]


def test_a_misspelt_checks_setting_names_its_raw_value_and_the_accepted_ones(monkeypatch):
    from fusedist.reliability.config import checks_enabled

    monkeypatch.setenv("FUSEDIST_CHECKS", " Maybe")
    with pytest.raises(ValueError, match=r"FUSEDIST_CHECKS must be 0 or 1 \(also false/true, off/on; unset: 1\), "
                                         r"got ' Maybe'"):
        checks_enabled()
