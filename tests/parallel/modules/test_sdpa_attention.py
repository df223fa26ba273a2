"""SDPAttention (torch's scaled_dot_product_attention) computes megatron's DotProductAttention.

Oracle: megatron's own DotProductAttention, fp32 on CPU, on the same random q/k/v and output
gradient. At TP=2 (two ranks, each with its share of the heads) outputs and q/k/v gradients must
agree to 5e-6 (fp32 rounding; measured: outputs 4e-7, gradients 1.7e-6) for MHA and GQA, with
causal attention, causal with right padding, a bidirectional key-padding mask, and left padding
(queries whose keys are all masked are compared where a query has a key; SDPA gives those a zero
context). Negative control: the masked cases differ clearly from plain causal attention, so the
masks are really applied. Dropout: off in eval, unbiased in training. Whole model: a tiny GPTModel
from ``build_model_chunks`` (SDPA by default) gives the logits and gradients it gives with every
layer's core attention swapped for DotProductAttention (TP=2 with sequence parallelism): logits
to 1e-5 absolute (measured 2e-7), parameter gradients to 1e-5 of their largest (measured 2e-7).
"""

import types

import pytest
import torch

from parallel.layout import MegatronLayout
from parallel.spawn import run_on_ranks

TP = 2
CASES = [  # (name, heads, query groups) of the whole model; each TP rank holds 1/TP of them
    ("mha", 4, 4),
    ("gqa", 4, 2),
    ("gqa_one_group_per_rank", 8, 2),
]
MASKS = ["causal", "causal_right_padding", "key_padding", "causal_left_padding"]


def _mask(kind: str, seq: int, batch: int):
    """(attention_mask, attn_mask_type, query rows that have a key [b, seq]) in megatron's
    convention (bool, True = masked out); rows 0 and 1 of the batch are padded differently."""
    from megatron.core.transformer.enums import AttnMaskType

    position = torch.arange(seq)
    future = position[None, :] > position[:, None]  # [sq, sk]
    pad = torch.tensor([3, 5])[:batch, None]  # padding tokens per row
    real = torch.ones(batch, seq, dtype=torch.bool)
    if kind == "causal":
        return None, AttnMaskType.causal, real
    if kind == "causal_right_padding":
        return (future | (position >= seq - pad)[:, None, :])[:, None], AttnMaskType.causal, real
    if kind == "key_padding":  # bidirectional, [b, 1, 1, sk]
        return (position >= seq - pad)[:, None, None, :], AttnMaskType.padding, real
    assert kind == "causal_left_padding"
    return (future | (position < pad)[:, None, :])[:, None], AttnMaskType.causal, position[None, :] >= pad


def sdpa_vs_megatron(tp: int, seed: int = 0) -> dict:
    """On each TP rank: max abs differences of SDPAttention vs DotProductAttention per case and
    mask, the masks' distance from plain causal attention, and the whole-model comparison."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from parallel.modules.sdpa_attention import SDPAttention
    from parallel.process_groups import initialize_megatron

    initialize_megatron(MegatronLayout(tp=tp))
    rank = parallel_state.get_tensor_model_parallel_rank()
    seq, batch, head_dim = 12, 2, 8
    kernels = {}
    for name, heads, groups in CASES:
        generator = torch.Generator().manual_seed(seed + 100 * rank + heads + groups)
        q, dout = (torch.randn(seq, batch, heads // tp, head_dim, generator=generator) for _ in range(2))
        k, v = (torch.randn(seq, batch, groups // tp, head_dim, generator=generator) for _ in range(2))
        config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                                   num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0,
                                   tensor_model_parallel_size=tp, masked_softmax_fusion=False,
                                   use_cpu_initialization=True)
        outputs = {}
        for kind in MASKS:
            mask, mask_type, has_key = _mask(kind, seq, batch)
            # padding queries get no gradient (a loss mask's zeros), as in training
            grad = (dout * has_key.t()[:, :, None, None]).view(seq, batch, -1)
            results = []
            for attention in (DotProductAttention(config, 1, mask_type, "self"), SDPAttention(config, 1, mask_type, "self")):
                inputs = [t.clone().requires_grad_() for t in (q, k, v)]
                out = attention(*inputs, mask)
                out.backward(grad)
                results.append((out.detach() * has_key.t()[:, :, None], [t.grad for t in inputs]))
            (ref_out, ref_grads), (out, grads) = results
            outputs[kind] = out
            kernels[(name, kind)] = {"out": float((out - ref_out).abs().max()),
                                     "grads": [float((g - r).abs().max()) for g, r in zip(grads, ref_grads)],
                                     "finite": all(bool(g.isfinite().all()) for g in grads)}
        for kind in MASKS[1:]:
            kernels[(name, kind)]["from_causal"] = float((outputs[kind] - outputs["causal"]).abs().max())
    result = {"kernels": kernels, "dropout": _dropout(config, q, k, v),
              "model": _model_vs_megatron(MegatronLayout(tp=tp, sequence_parallel=True), seed)}
    parallel_state.destroy_model_parallel()
    return result


def _dropout(config, q, k, v) -> dict:
    """Attention dropout 0.5: off in eval, random in training, unbiased over 1000 draws."""
    import dataclasses

    from megatron.core.transformer.enums import AttnMaskType

    from parallel.modules.sdpa_attention import SDPAttention

    attention = SDPAttention(dataclasses.replace(config, attention_dropout=0.5), 1, AttnMaskType.causal, "self")
    plain = attention.eval()(q, k, v, None)
    no_dropout = SDPAttention(config, 1, AttnMaskType.causal, "self").train()(q, k, v, None)
    attention.train()
    draws = torch.stack([attention(q, k, v, None) for _ in range(1000)])
    return {"eval_is_plain": torch.equal(plain, no_dropout), "draws_differ": not torch.equal(draws[0], draws[1]),
            "draw_from_plain": float((draws[0] - plain).abs().max()),
            # the mean's distance from the plain output in standard errors of the mean
            "mean_z": float(((draws.mean(0) - plain).abs() / (draws.std(0) / len(draws) ** 0.5 + 1e-6)).max())}


def _model_vs_megatron(layout: MegatronLayout, seed: int) -> dict:
    """A tiny GQA GPTModel's logits and gradients with its SDPA core attention, and with every
    layer's swapped for DotProductAttention (the attention holds no parameters)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from model_specs.presets import hf_config_dict
    from parallel.models import build_model_chunks, init_params_layout_independent
    from parallel.modules.sdpa_attention import SDPAttention

    hf = hf_config_dict("tiny-llama")
    (chunk,) = build_model_chunks(hf, layout)
    init_params_layout_independent([chunk], seed=seed, vocab_size=hf["vocab_size"])
    layers = chunk.decoder.layers
    built = all(isinstance(layer.self_attention.core_attention, SDPAttention) for layer in layers)
    tokens = torch.randint(0, hf["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(16).expand(2, 16)

    def run():
        chunk.zero_grad()
        logits = chunk(tokens, positions, attention_mask=None)
        logits.float().pow(2).sum().backward()
        return logits.detach(), {name: p.grad.clone() for name, p in chunk.named_parameters()}

    logits, grads = run()
    for layer in layers:
        layer.self_attention.core_attention = DotProductAttention(chunk.config, layer.layer_number,
                                                                  AttnMaskType.causal, "self")
    ref_logits, ref_grads = run()
    return {"built_sdpa": built, "logits": float((logits - ref_logits).abs().max()),
            "logit_scale": float(ref_logits.abs().max()),
            "grads": max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads),
            "grad_scale": max(float(g.abs().max()) for g in ref_grads.values())}


@pytest.fixture(scope="module")
def per_rank():
    return run_on_ranks(sdpa_vs_megatron, TP, TP, timeout_s=240)


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_equals_dot_product_attention(per_rank, case, kind):
    for rank, result in enumerate(per_rank):
        r = result["kernels"][(case, kind)]
        where = f"tp={TP} rank={rank} {case} {kind}"
        assert r["finite"], (where, r)
        assert r["out"] < 5e-6, (where, r)
        assert max(r["grads"]) < 5e-6, (where, r)
        if kind != "causal":  # the mask changes the result, or the comparison proves little
            assert r["from_causal"] > 1e-2, (where, r)


def test_model_logits_and_grads_equal_dot_product_attention(per_rank):
    for rank, result in enumerate(per_rank):
        m = result["model"]
        assert m["built_sdpa"], rank
        assert m["logit_scale"] > 0.1 and m["logits"] < 1e-5, (rank, m)
        assert m["grad_scale"] > 0.1 and m["grads"] < 1e-5 * m["grad_scale"], (rank, m)


def _module(**overrides):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from parallel.modules.sdpa_attention import SDPAttention

    kwargs = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                  use_cpu_initialization=True)
    return SDPAttention(TransformerConfig(**{**kwargs, **overrides}), 1, AttnMaskType.causal, "self")


def test_dropout_only_in_training_and_unbiased(per_rank):
    for rank, result in enumerate(per_rank):
        d = result["dropout"]
        assert d["eval_is_plain"] and d["draws_differ"], (rank, d)
        # inverted dropout: the mean of the draws is the plain output, within 5 standard errors
        assert d["mean_z"] < 5 and d["draw_from_plain"] > 0.5, (rank, d)


def test_refusals_name_the_setting():
    q = torch.randn(4, 1, 4, 8)
    k = torch.randn(4, 1, 2, 8)
    attention = _module()
    with pytest.raises(NotImplementedError, match="packed_seq_params.*packed_sequences=True"):
        attention(q, k, k, None, packed_seq_params=object())
    with pytest.raises(NotImplementedError, match="attention_bias"):
        attention(q, k, k, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="attention_mask must be bool"):
        attention(q, k, k, torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="self-attention; got 4 queries and 6 keys"):
        attention(q, torch.randn(6, 1, 2, 8), torch.randn(6, 1, 2, 8), None)
    with pytest.raises(ValueError, match="context_parallel_size=2.*ContextParallelAttention"):
        _module(context_parallel_size=2)
    with pytest.raises(NotImplementedError, match="window_size"):
        _module(window_size=(4, 0))


def test_layer_spec_attention_follows_core_attention_kind():
    from parallel.memory import ATTENTION_KINDS
    from parallel.models import core_attention_kind, default_layer_spec, transformer_layer_spec
    from parallel.modules.context_parallel import ContextParallelAttention
    from parallel.modules.sdpa_attention import SDPAttention
    from parallel.modules.shared_prefix import SharedPrefixAttention

    config = types.SimpleNamespace(qk_layernorm=False, num_moe_experts=None)
    cases = [
        (MegatronLayout(), False, False, "sdpa", SDPAttention),
        (MegatronLayout(tp=2, pp=2), False, False, "sdpa", SDPAttention),
        (MegatronLayout(cp=2), False, False, "context_parallel", ContextParallelAttention),
        (MegatronLayout(), True, False, "context_parallel", ContextParallelAttention),
        (MegatronLayout(), False, True, "shared_prefix", SharedPrefixAttention),
    ]
    for layout, packed, shared, kind, cls in cases:
        assert core_attention_kind(layout, packed, shared) == kind
        spec = transformer_layer_spec(config, layout, packed, shared)
        assert spec.submodules.self_attention.submodules.core_attention is cls
    # Transformer Engine's spec: its own attention (CP and packed rows included), shared-prefix rows ours
    te_cases = [(MegatronLayout(cp=2), True, False, "transformer_engine"), (MegatronLayout(), False, True, "shared_prefix")]
    for layout, packed, shared, kind in te_cases:
        assert core_attention_kind(layout, packed, shared, layer_spec="te") == kind
    # the names the launch plan sizes memory by (parallel.memory) are exactly these
    assert {kind for *_, kind, _ in cases} | {kind for *_, kind in te_cases} == set(ATTENTION_KINDS)
    with pytest.raises(ValueError, match=r"layer_spec='tex' is not a layer spec megarl maps; use one of \['local', 'te'\]"):
        core_attention_kind(MegatronLayout(), layer_spec="tex")
    # no Transformer Engine on this machine: local by default, and asking for TE says what is missing
    assert default_layer_spec() == "local"
    with pytest.raises(ValueError, match="layer_spec='te' needs Transformer Engine, which does not import here"):
        transformer_layer_spec(config, MegatronLayout(), layer_spec="te")
    with pytest.raises(ValueError, match="shared-prompt rows need context parallelism 1"):
        core_attention_kind(MegatronLayout(cp=2), shared_prompts=True)
