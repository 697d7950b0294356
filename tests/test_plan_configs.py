"""Parameter counts of ``--hf-config`` against the published models.

Each dict is the published ``config.json`` of the model (the keys that change the count, plus
``model_type``, ``max_position_embeddings``, ``vocab_size``), as on the Hugging Face Hub.
The expected counts are exact; each comment gives the figure the model's card or paper
publishes and, where useful, how the exact count comes about. Mixtures of experts are checked
twice: every parameter (memory) and the ones a token goes through (compute), against the
cards' "activated" figures. Configs the planner does not count (GPT-J's block, the multimodal
Gemma-3) must be refused naming the field. tests/test_plan_architectures.py
checks the same families against modules built the way transformers builds them."""

import json

import pytest
import torch

from fusedist.plan import PlanError, active_params, count_params, from_hf_config
from fusedist.plan.torch_model import Transformer

LLAMA2_7B = {  # meta-llama/Llama-2-7b-hf
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096, "vocab_size": 32000,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
}
LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192, "vocab_size": 128256,
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
}
LLAMA31_70B = {  # meta-llama/Llama-3.1-70B
    "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
    "num_hidden_layers": 80, "num_key_value_heads": 8, "max_position_embeddings": 131072, "vocab_size": 128256,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "rope_scaling": {"factor": 8.0, "rope_type": "llama3"},
}
MISTRAL_7B = {  # mistralai/Mistral-7B-v0.1 (no tie_word_embeddings key: MistralConfig's default, False)
    "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768, "vocab_size": 32000,
    "sliding_window": 4096,
}
QWEN2_7B = {  # Qwen/Qwen2-7B: Qwen2Attention has biases on q, k, v (none on o)
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072, "vocab_size": 152064,
    "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28,
}
QWEN25_05B = {  # Qwen/Qwen2.5-0.5B: tied embeddings, q/k/v biases
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "max_position_embeddings": 32768, "vocab_size": 151936,
    "tie_word_embeddings": True,
}
GEMMA_2B = {  # google/gemma-2b: no tie_word_embeddings key (GemmaConfig's default: True); head_dim 256
    "model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384, "num_attention_heads": 8,
    "num_hidden_layers": 18, "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 8192,
    "vocab_size": 256000, "hidden_act": "gelu",
}
GEMMA_7B = {  # google/gemma-7b: 16 heads of 256 = 4096, wider than hidden 3072
    "model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 16, "head_dim": 256, "max_position_embeddings": 8192,
    "vocab_size": 256000, "hidden_act": "gelu",
}
GPT2_124M = {  # openai-community/gpt2 (n_inner null: 4 * n_embd; tied; learned positions)
    "model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "n_ctx": 1024,
    "vocab_size": 50257, "n_inner": None,
}
PHI3_MINI = {  # microsoft/Phi-3-mini-4k-instruct
    "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096, "vocab_size": 32064,
    "tie_word_embeddings": False, "sliding_window": 2047,
}

FALCON_7B = {  # tiiuae/falcon-7b: multi-query, attention and MLP side by side through one LayerNorm
    "model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71, "num_hidden_layers": 32,
    "multi_query": True, "parallel_attn": True, "new_decoder_architecture": False, "bias": False,
    "alibi": False, "vocab_size": 65024,
}
FALCON_40B = {  # tiiuae/falcon-40b: 8 key/value heads, a LayerNorm each for attention and MLP
    "model_type": "falcon", "hidden_size": 8192, "num_attention_heads": 128, "num_kv_heads": 8,
    "num_hidden_layers": 60, "new_decoder_architecture": True, "parallel_attn": True, "bias": False,
    "alibi": False, "vocab_size": 65024,
}
FALCON_RW_1B = {  # tiiuae/falcon-rw-1b: every head's k/v, sequential blocks, biases, ALiBi
    "model_type": "falcon", "hidden_size": 2048, "num_attention_heads": 32, "num_hidden_layers": 24,
    "multi_query": False, "parallel_attn": False, "new_decoder_architecture": False, "bias": True,
    "alibi": True, "vocab_size": 50304,
}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3: latent attention, 256 routed experts (8 a token) and a shared one
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "vocab_size": 129280, "tie_word_embeddings": False, "attention_bias": False,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_nextn_predict_layers": 1,
}
DEEPSEEK_V2 = {  # deepseek-ai/DeepSeek-V2
    "model_type": "deepseek_v2", "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 60, "n_routed_experts": 160,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "vocab_size": 102400, "topk_method": "group_limited_greedy",
}
DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite: no query compression (q_lora_rank null)
    "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_attention_heads": 16, "num_hidden_layers": 27, "num_key_value_heads": 16, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "vocab_size": 102400,
}
QWEN3_8B = {  # Qwen/Qwen3-8B: RMSNorm on each head's q and k (head_dim 128)
    "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "vocab_size": 151936, "tie_word_embeddings": False, "attention_bias": False,
}
QWEN3_06B = {  # Qwen/Qwen3-0.6B: tied, 16 heads of 128 = 2048, wider than hidden 1024
    "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "vocab_size": 151936, "tie_word_embeddings": True, "attention_bias": False,
}
GEMMA2_2B = {  # google/gemma-2-2b: four RMSNorms a block; tied (Gemma2Config's default)
    "model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216, "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
    "vocab_size": 256000, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "sliding_window": 4096,
}
GEMMA2_9B = {  # google/gemma-2-9b
    "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
    "num_hidden_layers": 42, "num_key_value_heads": 8, "head_dim": 256, "max_position_embeddings": 8192,
    "vocab_size": 256000, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "sliding_window": 4096,
}
GEMMA2_27B = {  # google/gemma-2-27b: head_dim 128
    "model_type": "gemma2", "hidden_size": 4608, "intermediate_size": 36864, "num_attention_heads": 32,
    "num_hidden_layers": 46, "num_key_value_heads": 16, "head_dim": 128, "max_position_embeddings": 8192,
    "vocab_size": 256000, "query_pre_attn_scalar": 144, "sliding_window": 4096,
}
GEMMA3_1B = {  # google/gemma-3-1b-pt: four norms a block and q/k norms; tied
    "model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912, "num_attention_heads": 4,
    "num_hidden_layers": 26, "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
    "vocab_size": 262144, "sliding_window": 512, "sliding_window_pattern": 6, "final_logit_softcapping": None,
}
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1: 8 experts of 14336 in every block, 2 per token
    **MISTRAL_7B, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
    "tie_word_embeddings": False, "sliding_window": None,
}
MIXTRAL_8X22B = {  # mistralai/Mixtral-8x22B-v0.1
    "model_type": "mixtral", "hidden_size": 6144, "intermediate_size": 16384, "num_attention_heads": 48,
    "num_hidden_layers": 56, "num_key_value_heads": 8, "max_position_embeddings": 65536, "vocab_size": 32000,
    "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False,
}
QWEN15_MOE = {  # Qwen/Qwen1.5-MoE-A2.7B (model_type qwen2_moe): 60 experts, 4 per token, a gated shared one
    "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
    "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "max_position_embeddings": 8192,
    "vocab_size": 151936, "decoder_sparse_step": 1, "tie_word_embeddings": False,
}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B: 128 experts of 768, 8 per token, no shared expert
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "num_attention_heads": 32, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960, "vocab_size": 151936,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
}
QWEN3_235B_A22B = {  # Qwen/Qwen3-235B-A22B
    "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_experts": 128, "num_experts_per_tok": 8, "num_attention_heads": 64, "num_hidden_layers": 94,
    "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960, "vocab_size": 151936,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
}

COUNTS = [
    # Llama 2 paper (arXiv:2307.09288) and model card: 7B; HF "6.74B params"
    (LLAMA2_7B, 6_738_415_616),
    # Llama 3 model card: 8B; HF "8.03B params"
    (LLAMA3_8B, 8_030_261_248),
    # Llama 3.1 model card: 70B; HF "70.6B params"
    (LLAMA31_70B, 70_553_706_496),
    # Mistral 7B paper (arXiv:2310.06825); HF "7.24B params"
    (MISTRAL_7B, 7_241_732_096),
    # Qwen2 technical report (arXiv:2407.10671) and model card: 7.6B, of which 7.07B are not
    # the input embedding; the q/k/v biases are 28 * (3584 + 2 * 512) = 129,024 of them
    (QWEN2_7B, 7_615_616_512),
    # Qwen2.5 model card: 0.49B in all, 0.36B besides the (tied) embedding
    (QWEN25_05B, 494_032_768),
    # Gemma paper (arXiv:2403.08295), Table 2, 2B: 1,981,884,416 non-embedding parameters
    # (exactly ours) and 524,550,144 embedding ones for a 256,128-entry vocabulary; the released
    # config has 256,000 entries: 2048 * 256,000 = 524,288,000, tied. HF: "2.51B params"
    (GEMMA_2B, 2_506_172_416),
    # Gemma paper, Table 2, 7B: 7,751,248,896 non-embedding parameters (exactly ours), the
    # embedding 3072 * 256,000 = 786,432,000 with the released vocabulary; HF: "8.54B params"
    (GEMMA_7B, 8_537_680_896),
    # GPT-2 small: 124M (124,439,808 with the tied output layer counted once)
    (GPT2_124M, 124_439_808),
    # Phi-3 technical report (arXiv:2404.14219): phi-3-mini, 3.8B; HF "3.82B params"
    (PHI3_MINI, 3_821_079_552),
    # Qwen3 model card: 8.2B, 6.95B non-embedding (6,946,075,648: the q/k norms are 36 * 256)
    (QWEN3_8B, 8_190_735_360),
    # Qwen3 model card: 0.6B, 0.44B non-embedding (440,467,456; the embedding 155,582,464, tied)
    (QWEN3_06B, 596_049_920),
    # Gemma 2 paper (arXiv:2408.00118), Table 1, 2B: 2,024,517,888 non-embedding parameters
    # (exactly ours, the four norms a block included) and 590,118,912 embedding ones for a
    # 256,128-entry vocabulary; the released config has 256,000: 589,824,000. HF "2.61B params"
    (GEMMA2_2B, 2_614_341_888),
    # Gemma 2 paper, Table 1, 9B: 8,324,201,984 non-embedding parameters (exactly ours);
    # HF "9.24B params"
    (GEMMA2_9B, 9_241_705_984),
    # Gemma 2 paper, Table 1, 27B: 26,047,480,320 non-embedding parameters (exactly ours);
    # HF "27.2B params"
    (GEMMA2_27B, 27_227_128_320),
    # Gemma 3 technical report (arXiv:2503.19786), Table 1, 1B: 698M non-embedding (697,896,064)
    # and 302M embedding (1152 * 262,144 = 301,989,888) parameters; HF "1,000M"
    (GEMMA3_1B, 999_885_952),
    # Mixtral of Experts paper (arXiv:2401.04088): 47B parameters, 13B active per token
    (MIXTRAL_8X7B, 46_702_792_704),
    # Mixtral-8x22B announcement: 141B parameters, 39B active
    (MIXTRAL_8X22B, 140_620_634_112),
    # Qwen1.5-MoE-A2.7B model card: 14.3B parameters, 2.7B activated (2.0B non-embedding)
    (QWEN15_MOE, 14_315_784_192),
    # Qwen3 model card, 30B-A3B: 30.5B parameters, 3.3B activated, 29.9B non-embedding
    (QWEN3_30B_A3B, 30_532_122_624),
    # Qwen3 model card, 235B-A22B: 235B parameters, 22B activated, 234B non-embedding
    (QWEN3_235B_A22B, 235_093_634_560),
    # Falcon-7B model card: 7B. (HF's "7.22B" counts the tied output layer, which the
    # checkpoint stores, a second time: + 4544 * 65,024 = 7,217,189,760.) Read as llama blocks
    # this config was 11.16B: 71 key/value heads, a SwiGLU MLP, an untied output layer.
    (FALCON_7B, 6_921_720_704),
    # Falcon-40B model card: 40B (HF "41.8B", the output layer again: 41,835,970,560)
    (FALCON_40B, 41_303_293_952),
    # Falcon-RW-1B model card: 1.3B
    (FALCON_RW_1B, 1_311_625_216),
    # DeepSeek-V3 technical report (arXiv:2412.19437): 671B parameters, 37B activated; the
    # checkpoint's 685B add the multi-token-prediction module, which the model does not build,
    # and the router's correction bias is a buffer, not a parameter
    (DEEPSEEK_V3, 671_026_404_352),
    # DeepSeek-V2 paper (arXiv:2405.04434): 236B parameters, 21B activated
    (DEEPSEEK_V2, 235_741_434_880),
    # DeepSeek-V2 paper, V2-Lite: 15.7B parameters, 2.4B activated
    (DEEPSEEK_V2_LITE, 15_706_484_224),
]

# Parameters a token goes through (Note [active parameters] in fusedist/plan/model.py): the
# expert MLPs it is not routed to left out; the cards' "activated" figures above
ACTIVE = [
    (MIXTRAL_8X7B, 12_879_925_248),  # 13B; 46.7B less 32 blocks x 6 experts x 176,160,768
    (MIXTRAL_8X22B, 39_152_031_744),  # 39B
    (QWEN15_MOE, 2_689_173_504),  # 2.7B
    (QWEN3_30B_A3B, 3_353_032_704),  # 3.3B
    (QWEN3_235B_A22B, 22_190_763_520),  # 22B
    (QWEN3_8B, 8_190_735_360),  # dense: all of them
    (DEEPSEEK_V3, 37_552_282_624),  # 37B
    (DEEPSEEK_V2, 21_375_800_320),  # 21B
    # 2.4B: the card leaves out the input embedding (a lookup, 209,715,200): 2,451,435,008
    (DEEPSEEK_V2_LITE, 2_661_150_208),
]


def _write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("cfg,expected", COUNTS, ids=[f"{c['model_type']}-{n}" for c, n in COUNTS])
def test_published_parameter_counts(tmp_path, cfg, expected):
    spec = from_hf_config(_write(tmp_path, cfg))
    assert count_params(spec) == expected
    # and the model --measure builds from the spec holds exactly that many
    with torch.device("meta"):
        model = Transformer(spec)
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize("cfg,expected", ACTIVE, ids=[f"{c['model_type']}-{n}" for c, n in ACTIVE])
def test_active_parameter_counts(tmp_path, cfg, expected):
    assert active_params(from_hf_config(_write(tmp_path, cfg))) == expected


def test_mixture_of_experts_memory_counts_all_compute_the_active(tmp_path, capsys):
    """Qwen3-30B-A3B on 8 GPUs: model states are those of 30.5B parameters, the FLOPs per token
    those of 3.35B less the input embedding (6 x active in products + attention), and the
    report says which is which."""
    from fusedist.plan import Job, build_plan, resolve_hardware
    from fusedist.plan import cli
    from fusedist.plan.model import attention_flops_per_token

    spec = from_hf_config(_write(tmp_path, QWEN3_30B_A3B))
    plan = build_plan(spec, Job(gpus=8, micro_batch=1, seq=4096), resolve_hardware("h100"))
    assert plan["inputs"]["params"] == 30_532_122_624 and plan["inputs"]["active_params"] == 3_353_032_704
    assert plan["memory"]["ddp"]["terms"]["params"] == 2 * 30_532_122_624  # bf16 weights, all experts
    # the untied 151936 x 2048 input embedding is a lookup, not a product (the output layer is one)
    assert plan["inputs"]["matmul_params"] == 3_353_032_704 - 151_936 * 2048
    assert plan["inputs"]["assumptions"]["flops_per_token"] == (6 * (3_353_032_704 - 151_936 * 2048)
                                                                + 3 * attention_flops_per_token(spec, 4096))
    assert cli.main(["--hf-config", _write(tmp_path, QWEN3_30B_A3B), "--gpus", "8", "--seq", "4096",
                     "--recompute", "full"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("model: 30,532,122,624 parameters (30.53B), 3,353,032,704 (3.35B) active per token (compute "
                      "counts these; memory and communication all), llama 48 layers, hidden 2048, 32 heads (4 kv) "
                      "of 128, qk norm, 128 experts of 768 (8 per token), vocab 151936; from hf-config (qwen3_moe)")
    assert "x active params" in "\n".join(out)


def test_qwen_moe_dense_layers(tmp_path):
    """Qwen2/3-MoE's block i is dense (an MLP of intermediate_size) when i is in mlp_only_layers
    or (i + 1) is not a multiple of decoder_sparse_step, as their decoder layers decide."""
    moe = from_hf_config(_write(tmp_path, QWEN3_30B_A3B))
    h = 2048
    expert, dense = 3 * h * 768, 3 * h * 6144
    block_mlp = h * 128 + 128 * expert  # router + experts
    every_other = from_hf_config(_write(tmp_path, {**QWEN3_30B_A3B, "decoder_sparse_step": 2}))
    assert every_other.dense_layers == 24
    assert count_params(every_other) == count_params(moe) - 24 * (block_mlp - dense)
    only = from_hf_config(_write(tmp_path, {**QWEN3_30B_A3B, "mlp_only_layers": [0, 47]}))
    assert only.dense_layers == 2
    assert active_params(only) == active_params(moe) - 2 * (h * 128 + 8 * expert - dense)
    with torch.device("meta"):
        for spec in (every_other, only):
            assert sum(p.numel() for p in Transformer(spec).parameters()) == count_params(spec)


def test_llama_attention_and_mlp_bias(tmp_path):
    """LlamaConfig's attention_bias puts biases on q, k, v and o, mlp_bias on gate, up, down."""
    base = count_params(from_hf_config(_write(tmp_path, LLAMA3_8B)))
    spec = from_hf_config(_write(tmp_path, {**LLAMA3_8B, "attention_bias": True, "mlp_bias": True}))
    per_layer = (4096 + 2 * 1024 + 4096) + (2 * 14336 + 4096)
    assert count_params(spec) == base + 32 * per_layer
    with torch.device("meta"):
        assert sum(p.numel() for p in Transformer(spec).parameters()) == count_params(spec)


# EleutherAI/gpt-j-6b: GPT-2's key names, another block (rotary, no attention biases,
# parallel attention and MLP, an untied output layer with a bias)
GPTJ_6B = {"model_type": "gptj", "n_embd": 4096, "n_layer": 28, "n_head": 16, "n_positions": 2048,
           "vocab_size": 50400, "rotary_dim": 64, "tie_word_embeddings": False}

REFUSED = [
    ({k: v for k, v in DEEPSEEK_V2_LITE.items() if k != "kv_lora_rank"}, "no 'kv_lora_rank'"),
    ({**DEEPSEEK_V3, "first_k_dense_replace": -1}, "'first_k_dense_replace'"),
    ({**QWEN3_8B, "model_type": "gemma3", "text_config": GEMMA3_1B}, "'model_type' 'gemma3': a multimodal config"),
    ({**LLAMA2_7B, "num_experts": 8, "num_experts_per_tok": 2}, "'num_experts'"),
    ({k: v for k, v in QWEN3_8B.items() if k != "head_dim"}, "no 'head_dim'"),
    ({k: v for k, v in QWEN15_MOE.items() if k != "shared_expert_intermediate_size"},
     "no 'shared_expert_intermediate_size'"),
    ({**QWEN3_30B_A3B, "mlp_only_layers": "0,1"}, "'mlp_only_layers'"),
    ({**MIXTRAL_8X7B, "num_experts_per_tok": 9}, "9 routed experts"),
    ({**FALCON_7B, "bias": "no"}, "'bias'"),
    (GPTJ_6B, "'model_type' 'gptj'"),
    ({**LLAMA2_7B, "model_type": "newmodel"}, "'model_type' 'newmodel'"),
    ({k: v for k, v in LLAMA2_7B.items() if k != "model_type"}, "no 'model_type'"),
    ({**LLAMA2_7B, "attention_bias": "yes"}, "'attention_bias'"),
    ({**LLAMA2_7B, "tie_word_embeddings": 1}, "'tie_word_embeddings'"),
    ({**LLAMA2_7B, "intermediate_size": None}, "'intermediate_size'"),
    ({**LLAMA2_7B, "head_dim": 0}, "'head_dim'"),
]


@pytest.mark.parametrize("cfg,field", REFUSED, ids=[f for _, f in REFUSED])
def test_configs_not_counted_are_refused_naming_the_field(tmp_path, cfg, field):
    path = _write(tmp_path, cfg)
    with pytest.raises(PlanError) as info:
        from_hf_config(path)
    assert info.value.flag == "--hf-config" and field in str(info.value), str(info.value)


def test_the_plan_names_what_it_counted(tmp_path, capsys):
    """The model line shows what changes the count: head size, biases, tied embeddings, Gemma's norm
    (its activations)."""
    from fusedist.plan import cli

    assert cli.main(["--hf-config", _write(tmp_path, GEMMA_2B), "--gpus", "8", "--seq", "4096"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line == ("model: 2,506,172,416 parameters (2.51B), llama 18 layers, hidden 2048, 8 heads (1 kv) of 256, "
                    "gemma norm, vocab 256000, tied; from hf-config (gemma)")
    assert cli.main(["--hf-config", _write(tmp_path, QWEN2_7B), "--gpus", "8", "--seq", "4096"]) == 0
    assert ", qkv bias, vocab 152064; from hf-config (qwen2)" in capsys.readouterr().out.splitlines()[0]


def test_zero3_gathers_consecutive_blocks_of_an_alternating_mixture(tmp_path):
    """Qwen3-30B-A3B with decoder_sparse_step 2: blocks 0, 2, ... dense (56.6M parameters),
    1, 3, ... MoE (623.1M). ZeRO-3 gathers the block in use and the next one, and two
    reductions in flight are consecutive units of backward (the blocks last to first, then
    the root): never two MoE blocks. Counting the largest block twice over-predicted the
    temporary bytes by 58% (6.54 GB where 4.13 GB is held; --measure checks the same on a
    tiny alternating model, tests/test_plan_measure.py)."""
    from fusedist.plan import Job, build_plan, resolve_hardware
    from fusedist.plan.model import embedding_params
    from fusedist.plan.param_tensors import block_tensors

    spec = from_hf_config(_write(tmp_path, {**QWEN3_30B_A3B, "decoder_sparse_step": 2}))
    h = 2048
    attn = h * (32 * 128 + 2 * 4 * 128) + 32 * 128 * h + 2 * 128 + 2 * h  # q/k/v, o, q/k norms, two norms
    dense, moe = attn + 3 * h * 6144, attn + h * 128 + 128 * 3 * h * 768
    assert [sum(block_tensors(spec, i)) for i in range(4)] == [dense, moe, dense, moe] == [56_627_456, 623_120_640] * 2
    root = embedding_params(spec)
    assert root == 2 * 151936 * h + h
    n = 8
    gathered = root + moe + dense
    reducing = max((moe + dense) * (1 + 1 / n), (dense + root) * (1 + 1 / n))  # (block 1, block 0) or (0, root)
    plan = build_plan(spec, Job(gpus=n, micro_batch=1, seq=4096, scratch_gb=0), resolve_hardware("h100"))
    assert plan["memory"]["zero3"]["temp_bytes"] == round(2 * (gathered + reducing)) == 4_133_593_216
    # blocks all alike keep the figure they had: two blocks gathered, root and block reducing
    uniform = from_hf_config(_write(tmp_path, QWEN3_30B_A3B))
    plan = build_plan(uniform, Job(gpus=n, micro_batch=1, seq=4096, scratch_gb=0), resolve_hardware("h100"))
    assert moe > root  # the two largest units in flight are two blocks
    assert plan["memory"]["zero3"]["temp_bytes"] == round(2 * (2 * moe + root) + 2 * (1 + 1 / n) * 2 * moe)
