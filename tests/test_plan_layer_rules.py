"""Which blocks a config's per-layer rules pick: Qwen2-MoE's sliding-window blocks (transformers 5's
Qwen2MoeConfig default ``layer_types``, which Qwen2MoeAttention and the masks follow block by
block), Qwen3-MoE's (every block: transformers 5's Qwen3MoeConfig has no ``layer_types`` nor
``max_window_layers``, and Qwen3MoeAttention and Mixtral's masks take ``sliding_window`` for all)
and DeepSeek's ``moe_layer_freq``, which transformers' DeepSeek classes ignore and the
plan names when it is not 1 (Note [moe_layer_freq] in fusedist/plan/hf_config.py)."""

import json

import pytest

from fusedist.plan import cli, from_hf_config
from test_plan_configs import DEEPSEEK_V3, QWEN3_30B_A3B, QWEN15_MOE


def _write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _qwen2_moe_layer_types(layers, use_sliding_window=False, max_window_layers=28):
    """Qwen2MoeConfig.__post_init__'s default in transformers 5: "sliding_attention" where
    ``bool((i + 1) % 2) and i < max_window_layers and use_sliding_window``."""
    return ["sliding_attention" if bool((i + 1) % 2) and i < max_window_layers and use_sliding_window
            else "full_attention" for i in range(layers)]


# (config changes to Qwen1.5-MoE-A2.7B's (24 layers), the windowed blocks as transformers 5 picks them)
QWEN2_MOE_WINDOWS = [
    ({}, ()),  # the released config: use_sliding_window false
    ({"use_sliding_window": True, "max_window_layers": 21}, (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20)),
    ({"use_sliding_window": True}, tuple(range(0, 24, 2))),  # max_window_layers 28 by default: all the even ones
    ({"use_sliding_window": True, "max_window_layers": 5}, (0, 2, 4)),
    ({"use_sliding_window": True, "max_window_layers": 0}, ()),
    ({"use_sliding_window": True, "num_hidden_layers": 3, "max_window_layers": 2}, (0,)),
]


@pytest.mark.parametrize("changes, windowed", QWEN2_MOE_WINDOWS)
def test_qwen2_moe_windows_the_even_blocks_below_max_window_layers(tmp_path, changes, windowed):
    cfg = {**QWEN15_MOE, "sliding_window": 4096, **changes}
    layers = cfg["num_hidden_layers"]
    types = _qwen2_moe_layer_types(layers, cfg.get("use_sliding_window", False), cfg.get("max_window_layers", 28))
    assert tuple(i for i, t in enumerate(types) if t == "sliding_attention") == windowed  # the table is the source's
    try:  # where transformers is installed, its own config class too
        from transformers import Qwen2MoeConfig
    except ImportError:
        Qwen2MoeConfig = None
    if Qwen2MoeConfig is not None:
        hf = Qwen2MoeConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        assert tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention") == windowed
    spec = from_hf_config(_write(tmp_path, cfg))
    assert spec.window_layers == windowed
    assert spec.sliding_window == (4096 if windowed or changes.get("use_sliding_window") else None)
    # a layer_types list still names each block itself
    given = ["sliding_attention"] * 2 + ["full_attention"] * (layers - 2)
    spec = from_hf_config(_write(tmp_path, {**cfg, "use_sliding_window": True, "layer_types": given}))
    assert spec.window_layers == (0, 1)


def _qwen3_moe_windowed(layers, use_sliding_window=False):
    """transformers 5: Qwen3MoeConfig nulls ``sliding_window`` without ``use_sliding_window``;
    Qwen3MoeAttention hands ``config.sliding_window`` to its attention in every block and the
    model (Mixtral's) builds one sliding-window mask for all of them when it is not null."""
    return tuple(range(layers)) if use_sliding_window else ()


# (config changes to Qwen3-30B-A3B's (48 layers), the windowed blocks as transformers 5 picks them)
QWEN3_MOE_WINDOWS = [
    ({}, ()),  # the released config: use_sliding_window false
    ({"use_sliding_window": True}, tuple(range(48))),
    ({"use_sliding_window": True, "max_window_layers": 40}, tuple(range(48))),  # not read (Qwen3's rule: 40..47)
    ({"use_sliding_window": True, "max_window_layers": 0, "num_hidden_layers": 3}, (0, 1, 2)),
    # not a Qwen3MoeConfig field: its attention and masks do not read it either
    ({"use_sliding_window": True, "layer_types": ["full_attention"] * 48}, tuple(range(48))),
    ({"use_sliding_window": False, "max_window_layers": 2}, ()),
]


@pytest.mark.parametrize("changes, windowed", QWEN3_MOE_WINDOWS)
def test_qwen3_moe_windows_every_block(tmp_path, changes, windowed):
    cfg = {**QWEN3_30B_A3B, "sliding_window": 4096, **changes}
    use = cfg.get("use_sliding_window", False)
    assert _qwen3_moe_windowed(cfg["num_hidden_layers"], use) == windowed  # the table is the source's
    try:  # where transformers is installed, its own config class too
        from transformers import Qwen3MoeConfig
    except ImportError:
        Qwen3MoeConfig = None
    if Qwen3MoeConfig is not None:
        hf = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "layer_types")})
        assert (hf.sliding_window is not None) == bool(windowed)
    spec = from_hf_config(_write(tmp_path, cfg))
    assert spec.window_layers == windowed
    assert spec.sliding_window == (4096 if use else None)


def test_deepseek_moe_layer_freq_is_named_in_the_plan(tmp_path, capsys):
    """Released configs say 1 (DeepSeek's rule and transformers' agree: experts from
    first_k_dense_replace on); with 2 the plan counts DeepSeek's modeling code's blocks and says so."""
    released = from_hf_config(_write(tmp_path, DEEPSEEK_V3))
    assert released.moe_layer_freq is None and released.dense_ids == (0, 1, 2)
    path = _write(tmp_path, {**DEEPSEEK_V3, "moe_layer_freq": 2})
    spec = from_hf_config(path)
    transformers_dense = tuple(range(3))  # DeepseekV3DecoderLayer: experts wherever i >= first_k_dense_replace
    deepseek_dense = tuple(i for i in range(61) if i < 3 or i % 2)
    assert spec.moe_layer_freq == 2 and spec.dense_ids == deepseek_dense != transformers_dense
    assert cli.main(["--hf-config", path, "--gpus", "64", "--seq", "4096"]) in (0, 1)
    line = capsys.readouterr().out.splitlines()[0]
    assert ("experts on one block in 2 (moe_layer_freq 2, as DeepSeek's modeling code; transformers' "
            "DeepseekV2/V3 ignore it and put experts on every block from first_k_dense_replace)") in line, line
    assert cli.main(["--hf-config", path, "--gpus", "64", "--seq", "4096", "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["inputs"]["model"]["moe_layer_freq"] == 2
    assert cli.main(["--hf-config", _write(tmp_path, DEEPSEEK_V3), "--gpus", "64", "--seq", "4096", "--json"]) in (0, 1)
    plan = json.loads(capsys.readouterr().out)
    assert "moe_layer_freq" not in plan["inputs"]["model"]
    # the activations' assumptions say what an RMSNorm keeps (Note [what a norm keeps])
    assert "an RMSNorm keeps its rows in fp32, the normalised rows and an fp32 rstd" in \
        plan["inputs"]["assumptions"]["activations"]
