"""A config.json of a model type the planner does not read is refused with shape flags chosen by
its features (fusedist/plan/arch_advice.py): it advised ``--arch llama`` for every one, which
counts an OPT model's blocks with a third MLP matrix and an untied output layer (OPT-1.3B:
1.82B for its published 1,315,758,080 parameters)."""

import json
import re

from fusedist.plan import cli

OPT_1_3B = {"model_type": "opt", "activation_function": "relu", "do_layer_norm_before": True, "enable_bias": True,
            "ffn_dim": 8192, "hidden_size": 2048, "max_position_embeddings": 2048, "num_attention_heads": 32,
            "num_hidden_layers": 24, "vocab_size": 50272, "word_embed_proj_dim": 2048}
INTERNLM2_7B = {"model_type": "internlm2", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
                "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
                "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "bias": False,
                "vocab_size": 92544, "tie_word_embeddings": False}


def _advice(tmp_path, capsys, cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert cli.main(["--hf-config", str(path), "--gpus", "8"]) == 2
    return capsys.readouterr().err


def _counted(capsys, flags: list) -> int:
    assert cli.main([*flags, "--gpus", "8", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["inputs"]["params"]


def test_opt_config_is_advised_gpt_blocks_that_count_it(tmp_path, capsys):
    err = _advice(tmp_path, capsys, OPT_1_3B)
    assert "look like --arch gpt's (learned positions, a two-matrix relu MLP, biases)" in err, err
    flags = re.search(r"give the shape instead, (--arch gpt[^;\n]*)", err).group(1).split()
    assert flags == ["--arch", "gpt", "--layers", "24", "--hidden", "2048", "--heads", "32", "--ffn-hidden", "8192",
                     "--vocab", "50272", "--seq", "2048"]
    assert abs(_counted(capsys, flags) - 1_315_758_080) <= 4096  # OPT's two offset position rows


def test_llama_like_config_is_advised_llama_blocks_with_its_values(tmp_path, capsys):
    err = _advice(tmp_path, capsys, INTERNLM2_7B)
    assert "look like --arch llama's (RMSNorm, rotary positions, a gated silu MLP, no biases, grouped key/value " \
           "heads (8 of 32))" in err, err
    assert ("--arch llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn-hidden 14336 --vocab 92544 "
            "--seq 32768") in err, err
    assert "approximate" not in err


def test_mixed_features_say_the_count_is_approximate(tmp_path, capsys):
    # rotary positions and RMSNorm, but a two-matrix GELU MLP with biases (a GPT-NeoX-like block)
    cfg = {"model_type": "mystery", "hidden_act": "gelu", "rms_norm_eps": 1e-5, "rope_theta": 1e4, "use_bias": True,
           "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100}
    err = _advice(tmp_path, capsys, cfg)
    assert "--arch llama's (RMSNorm, rotary positions)" in err, err
    assert "the count is approximate: a two-matrix gelu MLP, biases are --arch gpt's" in err, err
    assert "--ffn-hidden ?" in err and "--seq ?" in err, err
