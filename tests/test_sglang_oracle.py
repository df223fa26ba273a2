"""The SGLang oracle (tests/sglang_oracle.py) against facts that need none of megarl's code.

The oracle is SGLang's own model class loading an HF checkpoint as TP rank r; these checks pin
what it returns to the HF tensors by plain torch slicing: fused QKV and gate/up are
concatenations, row/column-parallel weights are slices, vocab rows are padded with zeros, KV heads
are replicated when TP exceeds them, tied embeddings have no separate lm_head.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from model_specs.presets import PRESETS
from tests.sglang_oracle import sglang_all_rank_parameters, sglang_oracle_batch, sglang_rank_parameters

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-path tests")

LAYERS = PRESETS["tiny-llama"]["num_hidden_layers"]
HEAD_DIM = PRESETS["tiny-llama"]["head_dim"]


@pytest.fixture(scope="module")
def model_dirs(tiny_hf_model):
    dirs = {p: tiny_hf_model(p) for p in ("tiny-llama", "tiny-qwen2", "tiny-qwen3")}
    sglang_oracle_batch([(d, tp) for d in dirs.values() for tp in (1, 2)])  # one SGLang process for all tests
    return dirs


def _hf(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(f"{model_dir}/model.safetensors")


def _layer(i: int, name: str) -> str:
    return f"model.layers.{i}.{name}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_tp1_fusions_and_padding(model_dirs, preset):
    hf, cfg = _hf(model_dirs[preset]), PRESETS[preset]
    params = sglang_rank_parameters(model_dirs[preset], 1, 0)
    vocab = cfg["vocab_size"]
    suffixes = ["weight"] + (["bias"] if preset == "tiny-qwen2" else [])
    for i in range(LAYERS):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for s in suffixes:
            assert torch.equal(params[f"{attn}.qkv_proj.{s}"],
                               torch.cat([hf[f"{attn}.{p}_proj.{s}"] for p in "qkv"]))
        assert torch.equal(params[f"{mlp}.gate_up_proj.weight"],
                           torch.cat([hf[f"{mlp}.gate_proj.weight"], hf[f"{mlp}.up_proj.weight"]]))
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                     "post_attention_layernorm.weight"):
            assert torch.equal(params[_layer(i, name)], hf[_layer(i, name)])
        if preset == "tiny-qwen3":
            for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                assert torch.equal(params[_layer(i, name)], hf[_layer(i, name)])
    assert torch.equal(params["model.norm.weight"], hf["model.norm.weight"])
    heads = ["model.embed_tokens.weight"] + ([] if cfg["tie_word_embeddings"] else ["lm_head.weight"])
    assert ("lm_head.weight" in params) == (not cfg["tie_word_embeddings"])
    for name in heads:
        padded = params[name]
        assert padded.shape[0] >= vocab and padded.shape[0] % 64 == 0, padded.shape
        assert torch.equal(padded[:vocab], hf[name])
        assert not padded[vocab:].any()
    # Every parameter is accounted for above (nothing SGLang holds goes unchecked).
    per_layer = 5 + len(suffixes) + (2 if preset == "tiny-qwen3" else 0)
    assert len(params) == LAYERS * per_layer + 1 + len(heads)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_tp2_row_parallel_slices_and_vocab_rows(model_dirs, preset):
    hf, cfg = _hf(model_dirs[preset]), PRESETS[preset]
    ranks = sglang_all_rank_parameters(model_dirs[preset], 2)
    assert [set(r) for r in ranks] == [set(ranks[0])] * 2  # same names on both ranks
    for i in range(LAYERS):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):  # input dim split
            assert torch.equal(torch.cat([r[_layer(i, name)] for r in ranks], dim=1), hf[_layer(i, name)])
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):  # replicated
            assert all(torch.equal(r[_layer(i, name)], hf[_layer(i, name)]) for r in ranks)
        gate_up = [r[_layer(i, "mlp.gate_up_proj.weight")] for r in ranks]
        ffn = cfg["intermediate_size"] // 2
        assert torch.equal(torch.cat([g[:ffn] for g in gate_up]), hf[_layer(i, "mlp.gate_proj.weight")])
        assert torch.equal(torch.cat([g[ffn:] for g in gate_up]), hf[_layer(i, "mlp.up_proj.weight")])
    vocab = cfg["vocab_size"]
    for name in ["model.embed_tokens.weight"] + ([] if cfg["tie_word_embeddings"] else ["lm_head.weight"]):
        full = torch.cat([r[name] for r in ranks])
        assert full.shape[0] % 64 == 0 and full.shape[0] >= vocab
        assert torch.equal(full[:vocab], hf[name]) and not full[vocab:].any()
    assert ("lm_head.weight" in ranks[0]) == (not cfg["tie_word_embeddings"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_tp2_qkv_heads(model_dirs, preset):
    """4 query heads: each of 2 ranks holds 2 of them, then its K and V head(s). tiny-llama has 2
    KV heads (rank r holds KV head r); tiny-qwen2 has 1 (both ranks hold it: replication, biases
    too)."""
    hf, cfg = _hf(model_dirs[preset]), PRESETS[preset]
    kv_heads = cfg["num_key_value_heads"]
    ranks = sglang_all_rank_parameters(model_dirs[preset], 2)
    q_rows = cfg["num_attention_heads"] // 2 * HEAD_DIM
    for i in range(LAYERS):
        for s in ("weight", "bias") if preset == "tiny-qwen2" else ("weight",):
            q, k, v = (hf[_layer(i, f"self_attn.{p}_proj.{s}")] for p in "qkv")
            for rank, r in enumerate(ranks):
                t = r[_layer(i, f"self_attn.qkv_proj.{s}")]
                kv_head = rank * kv_heads // 2  # the one KV head of this rank (kv_heads <= 2)
                kv = slice(kv_head * HEAD_DIM, (kv_head + 1) * HEAD_DIM)
                assert t.shape[0] == q_rows + 2 * HEAD_DIM
                assert torch.equal(t[:q_rows], q[rank * q_rows:(rank + 1) * q_rows])
                assert torch.equal(t[q_rows:q_rows + HEAD_DIM], k[kv])
                assert torch.equal(t[q_rows + HEAD_DIM:], v[kv])
    if kv_heads == 1:  # replicated: both ranks hold the same K/V rows
        name = _layer(0, "self_attn.qkv_proj.weight")
        assert torch.equal(ranks[0][name][q_rows:], ranks[1][name][q_rows:])
