"""The planner's command line with odd inputs: an empty ``--hf-config`` (an unset shell variable),
a config whose maximum positions -- only the default ``--seq`` of a llama-style model -- are past
what the planner models, and negative values argparse took for flags."""

import json

import pytest

from fusedist.plan.cli import main

_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 100, "intermediate_size": 128, "max_position_embeddings": 128}


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    return err


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_config_path_is_refused_not_ignored(capsys, path):
    # with --params it was planned as if --hf-config were absent; alone, the error asked for a model
    err = _error(capsys, ["--params", "7B", "--hf-config", path, "--gpus", "8", "--seq", "2048"])
    assert "--hf-config: the path is empty" in err, err
    assert "--hf-config: the path is empty" in _error(capsys, ["--hf-config", path, "--gpus", "8"])


def test_config_positions_past_the_bound_name_the_config_default_and_an_explicit_seq_plans(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(_LLAMA, max_position_embeddings=10 ** 12)))
    err = _error(capsys, ["--hf-config", str(path), "--gpus", "2"])
    # (it read "--seq: 1000000000000 is beyond ...", a flag the user never gave)
    assert "the model's 1000000000000 positions, the default --seq, are beyond" in err and "give --seq" in err, err
    assert main(["--hf-config", str(path), "--gpus", "2", "--seq", "64"]) == 0
    capsys.readouterr()
    assert "--seq: 70000000 is beyond what the planner models" in _error(
        capsys, ["--hf-config", str(path), "--gpus", "2", "--seq", "70000000"])


@pytest.mark.parametrize("extra, said", [(["--params", "-7B"], "--params: must be positive, got -7e+09"),
                                         (["--params", "7B", "--ref-lr", "-1e-4", "--ref-batch", "8"],
                                          "--ref-lr: must be positive, got -0.0001"),
                                         (["--params", "7B", "--mfu", "-.5"], "--mfu: must be in (0, 1], got -0.5")])
def test_a_negative_value_argparse_took_for_a_flag_gets_the_values_own_error(capsys, extra, said):
    # argparse reads only plain integers and decimals as negative numbers: "--params -7B" was
    # "argument --params: expected one argument", as if the value were missing
    assert said in _error(capsys, ["--gpus", "8", "--seq", "2048"] + extra)
