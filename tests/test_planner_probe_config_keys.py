"""A config.json whose sizes do not fit together: the refusal names the config's keys, the
ones to correct, not the command-line flags of a shape the user never typed."""

import json
import re

import pytest

from fusedist.plan.errors import PlanError
from fusedist.plan.hf_config import from_hf_config

_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 4, "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 64}
_FALCON = {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
           "vocab_size": 100, "new_decoder_architecture": True, "num_kv_heads": 2}


@pytest.mark.parametrize("base, change, key, other", [
    (_LLAMA, {"num_key_value_heads": 3}, "num_key_value_heads", "num_attention_heads"),
    (_LLAMA, {"num_key_value_heads": 16}, "num_key_value_heads", "num_attention_heads"),
    (_LLAMA, {"num_attention_heads": 6, "num_key_value_heads": 2}, "num_attention_heads", "hidden_size"),
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 5, "n_positions": 32, "vocab_size": 100},
     {}, "n_head", "n_embd"),
    (_FALCON, {"num_kv_heads": 3}, "num_kv_heads", "num_attention_heads"),
    (dict(_LLAMA, model_type="mixtral", num_local_experts=4), {"num_experts_per_tok": 5},
     "num_experts_per_tok", None),
    (dict(_LLAMA, model_type="qwen2_moe", num_experts=4, moe_intermediate_size=32,
          shared_expert_intermediate_size=32), {"num_experts_per_tok": 6}, "num_experts_per_tok", None),
])
def test_refusal_names_the_config_keys(tmp_path, base, change, key, other):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(base, **change)))
    with pytest.raises(PlanError) as err:
        from_hf_config(str(path))
    msg = str(err.value)
    assert msg.startswith(f"--hf-config: {path}: {key!r}: "), msg
    assert other is None or repr(other) in msg, msg
    assert not re.search(r"--(?!hf-config)[a-z]", msg), msg  # no flag the user did not give


@pytest.mark.parametrize("cfg, key, value", [
    (dict(_LLAMA, hidden_size=1 << 24, num_attention_heads=1 << 10, num_key_value_heads=1 << 10),
     "hidden_size", 1 << 24),
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 10 ** 9, "vocab_size": 100},
     "n_positions", 10 ** 9),
    (dict(_LLAMA, model_type="mixtral", num_local_experts=1 << 21, num_experts_per_tok=2),
     "num_local_experts", 1 << 21),
])
def test_size_past_the_bound_names_the_config_key(tmp_path, capsys, cfg, key, value):
    from fusedist.plan.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["--hf-config", str(path), "--gpus", "2", "--seq", "16"]) != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--hf-config: {key!r} {value} is beyond what the planner models" in err, err
