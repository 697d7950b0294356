"""A BERT-style encoder's config.json: the refusal gives the shape that counts it, checked
against the parameters of the same encoder built of torch modules."""

import json
import re
import shlex

import pytest
import torch
from torch import nn

from fusedist.plan.cli import model_spec, parser
from fusedist.plan.errors import PlanError
from fusedist.plan.hf_config import from_hf_config
from fusedist.plan.model import count_params


def _bert_like(layers, hidden, heads, ffn, vocab, seq, types):
    """BertModel's modules: word, position and token-type embeddings with a LayerNorm, post-LN
    blocks (torch's encoder layer has BertLayer's very tensors), and the pooler."""
    return nn.ModuleDict({
        "words": nn.Embedding(vocab, hidden), "positions": nn.Embedding(seq, hidden),
        "types": nn.Embedding(types, hidden), "norm": nn.LayerNorm(hidden),
        "blocks": nn.ModuleList(nn.TransformerEncoderLayer(hidden, heads, ffn, batch_first=True)
                                for _ in range(layers)),
        "pooler": nn.Linear(hidden, hidden)})


def _numel(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_encoder_refusal_gives_the_gpt_shape_and_what_it_leaves_out(tmp_path, model_type):
    g = torch.Generator().manual_seed({"bert": 11, "roberta": 12}[model_type])
    layers, heads = (int(x) for x in torch.randint(1, 5, (2,), generator=g))
    hidden = heads * 8 * int(torch.randint(1, 4, (1,), generator=g))
    ffn, vocab, seq = (int(x) for x in torch.randint(16, 300, (3,), generator=g))
    types = 1 if model_type == "roberta" else 2
    cfg = {"model_type": model_type, "num_hidden_layers": layers, "hidden_size": hidden,
           "num_attention_heads": heads, "intermediate_size": ffn, "vocab_size": vocab,
           "max_position_embeddings": seq}
    if model_type == "roberta":
        cfg["type_vocab_size"] = types  # bert's left out: BertConfig's 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(PlanError) as err:
        from_hf_config(str(path))
    msg = str(err.value)
    assert err.value.flag == "--hf-config" and "'model_type'" in msg and "--arch llama" not in msg
    reference = _bert_like(layers, hidden, heads, ffn, vocab, seq, types)
    flags = shlex.split(re.search(r"(--arch gpt [^.]*)\.", msg).group(1))
    counted = count_params(model_spec(parser().parse_args(flags)))
    # the shape counts everything but the token-type embeddings and the pooler, exactly
    assert counted == _numel(reference) - _numel(reference["types"]) - _numel(reference["pooler"])
    assert f"{counted:,} parameters" in msg
    assert f"{_numel(reference):,} in all" in msg and f"--params {_numel(reference)} " in msg


def test_encoder_config_missing_a_size_names_the_key(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 64,
                                "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 32}))
    with pytest.raises(PlanError, match="has no 'intermediate_size'"):
        from_hf_config(str(path))
