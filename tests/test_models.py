"""Presets, config.json models from several families, and the synthetic data."""

import json
import math

import pytest
import torch

from helpers.core.models import (
    PRESETS,
    ModelSpecError,
    build_model,
    count_params,
    decoder_layers,
    resolve_model,
    synthetic_batch,
)

SIZES = {"tiny": (0.4e6, 0.8e6), "small": (10e6, 30e6), "medium": (100e6, 250e6)}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_sizes(name):
    with torch.device("meta"):
        model = build_model(resolve_model(name), torch.float32, seed=0, device="meta")
    lo, hi = SIZES[name]
    assert lo < count_params(model) < hi


@pytest.mark.parametrize("family", [
    {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4, "vocab_size": 200},
    {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 200},
    {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 200},
    {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 200},
])
def test_config_json_families_build_and_train_one_step(tmp_path, family):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(family))
    model = build_model(resolve_model(str(path)), torch.float32, seed=0)
    assert len(decoder_layers(model)) == 2
    ids = synthetic_batch(0, seed=0, rank=0, world_size=1, micro_batch=2, seq_len=16, vocab_size=200)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    # a fresh model (weights ~ N(0, 0.02)) predicts nearly uniformly: the loss is close to ln(vocab)
    assert loss.item() == pytest.approx(math.log(200), abs=0.3)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if "wpe" not in n), [n for n, p in model.named_parameters() if p.grad is None]


def test_same_seed_same_model():
    a = build_model(resolve_model("tiny"), torch.float32, seed=3)
    b = build_model(resolve_model("tiny"), torch.float32, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    c = build_model(resolve_model("tiny"), torch.float32, seed=4)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)  # the seed, not a fixed state, decides


def test_bad_model_spec_names_the_value():
    with pytest.raises(ModelSpecError, match="'huge'.*tiny, small, medium"):
        resolve_model("huge")


def test_rank_slices_tile_the_global_batch():
    kw = dict(seed=1, micro_batch=3, seq_len=10, vocab_size=1000)
    whole = synthetic_batch(5, rank=0, world_size=1, **{**kw, "micro_batch": 12})
    parts = [synthetic_batch(5, rank=r, world_size=2, grad_accum=2, micro_step=m, **kw)
             for m in range(2) for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)
    assert not torch.equal(parts[0], parts[1])


def test_data_is_learnable_progressions():
    ids = synthetic_batch(0, seed=0, rank=0, world_size=1, micro_batch=4, seq_len=12, vocab_size=1000)
    d1, d2 = (ids[:, 1] - ids[:, 0]) % 97, (ids[:, 2] - ids[:, 1]) % 97
    assert torch.equal(d1, d2) and ids.max() < 97 and 1 <= d1.min() and d1.max() <= 8
