"""Model arithmetic from an HF config dict: parameter counts (total, active per token) and forward
FLOPs. The one place megarl counts a model; the planner (``parallel.memory.ModelShape``) and the
training TFLOP/s metric read it.

Parameters are counted per HF tensor, as ``sum(p.numel() for p in model.parameters())`` of the
HF model built from the config counts them (buffers such as DeepSeek-V3's
``e_score_correction_bias`` are not parameters). Model types: the built families (``llama``,
``qwen2``, ``qwen3``, ``mistral``, ``qwen3_moe``, ``mixtral``) and, for counting only, the shapes
of ``qwen2_moe`` (shared expert with its sigmoid gate) and ``deepseek_v2``/``deepseek_v3``
(multi-latent attention, shared experts, ``first_k_dense_replace`` dense layers first; the
multi-token-prediction module, ``num_nextn_predict_layers``, is not counted: HF does not build it).

Active parameters: what one token passes through: everything but the routed experts it is not
sent to (an MoE layer: its router, its top-k routed experts and its shared experts), the
embedding and the output layer included.

FLOP convention (``forward_flops_per_token``, ``forward_flops``): a matrix product of an [m, k]
by a [k, n] matrix is 2*m*k*n FLOPs; so a token's forward pass through the weights is
2 x its active *matmul* weights: every linear layer's weight (attention projections, the dense
MLP, the router, the top-k experts, the shared experts), the output layer included (tied or
not: it is a product), the embedding excluded (a lookup), norms and biases excluded (elementwise).
Attention scores and values (QK^T and PV) add, per layer and per key a query attends to,
2 * heads * (qk_head_dim + v_head_dim); with causal attention over a sequence of S tokens the
token at position p (0-based) attends p + 1 keys, S (S + 1) / 2 in all, (S + 1) / 2 per token
on average. Sliding windows are not modelled (every key counts). A training step is 3 x the
forward (the backward's input and weight gradients are 2 x): the trainer reports
``3 * forward_flops(...) / update_seconds`` as ``perf/train_tflops_per_s`` (x 1e-12).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from model_specs import FAMILIES
from model_specs.base import classifier_labels


def _qkv_bias(hf: Mapping[str, Any]) -> bool:
    """Whether q/k/v (not o) carry a bias whatever attention_bias says: a built family's
    ``qkv_bias`` (Qwen2), Qwen2-MoE's ``qkv_bias`` field (default True)."""
    family = FAMILIES.get(hf.get("model_type"))
    return family.qkv_bias if family else hf.get("model_type") == "qwen2_moe" and bool(hf.get("qkv_bias", True))


def _qk_norm(hf: Mapping[str, Any]) -> bool:
    """Whether queries and keys get a per-head RMSNorm (a built family's ``qk_norm``: Qwen3)."""
    family = FAMILIES.get(hf.get("model_type"))
    return bool(family and family.qk_norm)


@dataclasses.dataclass(frozen=True)
class LayerParameters:
    """One decoder layer's parameters, by what they are (counts of elements)."""

    attention: int  # attention's projection weights (q, k, v, o; MLA's down/up projections)
    mlp: int  # the dense MLP's weights (gate, up, down); 0 in an MoE layer
    router: int  # an MoE layer's router weight (experts x hidden); 0 in a dense layer
    expert: int  # one routed expert's weights (gate, up, down)
    experts: int  # routed experts (0: a dense layer)
    topk: int  # routed experts per token
    shared_experts: int  # the shared experts' weights (always active), their gate included
    biases: int  # attention and MLP biases (Qwen2's qkv bias, attention_bias, mlp_bias)
    norms: int  # RMSNorm weights: the layer's two, q/k norms (Qwen3), MLA's latent norms
    heads: int  # query heads
    qk_head_dim: int  # a query's and key's size per head (scores)
    v_head_dim: int  # a value's size per head

    @property
    def routed(self) -> int:
        """All routed experts' weights."""
        return self.experts * self.expert

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.router + self.routed + self.shared_experts + self.biases + self.norms

    @property
    def active(self) -> int:
        """Parameters a token passes through: all but the experts it is not routed to."""
        return self.total - (self.experts - self.topk) * self.expert

    @property
    def active_matmul(self) -> int:
        """Weights a token is multiplied by (see the module's FLOP convention)."""
        return self.attention + self.mlp + self.router + self.topk * self.expert + self.shared_experts

    @property
    def attention_flops_per_key(self) -> int:
        """FLOPs of one query against one key: its score and its share of the weighted values."""
        return 2 * self.heads * (self.qk_head_dim + self.v_head_dim)


@dataclasses.dataclass(frozen=True)
class ModelParameters:
    """A decoder-only model's parameters: the embedding, its layers, the final norm and the output
    layer (counts of elements; ``parameter_counts`` builds one from an HF config)."""

    embedding: int  # vocab x hidden
    layers: tuple[LayerParameters, ...]
    final_norm: int
    output_layer: int  # lm_head (0 when tied to the embedding) or a classifier's score head
    output_matmul: int  # the output layer's weights as a product (tied: the embedding's, again)

    @property
    def total(self) -> int:
        """Every parameter, as the HF model's ``numel`` sum reports it."""
        return self.embedding + sum(layer.total for layer in self.layers) + self.final_norm + self.output_layer

    @property
    def active(self) -> int:
        """Parameters one token passes through (MoE: its top-k routed experts only)."""
        return self.embedding + sum(layer.active for layer in self.layers) + self.final_norm + self.output_layer

    @property
    def active_matmul(self) -> int:
        """Weights one token is multiplied by: every layer's ``active_matmul`` and the output layer."""
        return sum(layer.active_matmul for layer in self.layers) + self.output_matmul

    def attention_flops(self, sequence_length: int) -> int:
        """Attention score and value FLOPs of one causal sequence of ``sequence_length`` tokens."""
        keys = sequence_length * (sequence_length + 1) // 2
        return keys * sum(layer.attention_flops_per_key for layer in self.layers)


def routed_experts(hf: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer (``num_experts``, ``num_local_experts`` or DeepSeek's
    ``n_routed_experts``), 0 for a dense model."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0)


def is_moe_layer(hf: Mapping[str, Any], layer: int) -> bool:
    """Whether decoder layer ``layer`` (0-based) has routed experts, as the HF modelling code
    decides: DeepSeek's first ``first_k_dense_replace`` layers are dense (then every
    ``moe_layer_freq``-th), Qwen-MoE's ``mlp_only_layers`` and those off ``decoder_sparse_step``."""
    if not routed_experts(hf):
        return False
    if layer < (hf.get("first_k_dense_replace") or 0) or layer % (hf.get("moe_layer_freq") or 1):
        return False
    return layer not in (hf.get("mlp_only_layers") or ()) and (layer + 1) % (hf.get("decoder_sparse_step") or 1) == 0


def _gated_mlp(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate  # gate, up, down


def _attention(hf: Mapping[str, Any]) -> dict[str, int]:
    """Attention's weights, biases, norms and head sizes: MLA when the config has kv_lora_rank,
    else (grouped-query) multi-head attention."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias"))
    if hf.get("kv_lora_rank"):
        # DeepSeek-V2/V3 multi-latent attention: queries through a q_lora_rank bottleneck (or a plain
        # q_proj without one), keys and values from one kv_lora_rank latent plus a shared RoPE key.
        q_rank, kv_rank = hf.get("q_lora_rank"), hf["kv_lora_rank"]
        nope, rope, v = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
        q_out = heads * (nope + rope)
        q = h * q_rank + q_rank * q_out if q_rank else h * q_out  # q_a_proj, q_b_proj / q_proj
        kv = h * (kv_rank + rope) + kv_rank * heads * (nope + v)  # kv_a_proj_with_mqa, kv_b_proj
        return dict(attention=q + kv + heads * v * h,  # + o_proj
                    biases=((q_rank or 0) + kv_rank + rope + h) if bias else 0,
                    norms=(q_rank or 0) + kv_rank,  # q_a_layernorm, kv_a_layernorm
                    heads=heads, qk_head_dim=nope + rope, v_head_dim=v)
    head_dim = hf.get("head_dim") or h // heads
    q, kv = heads * head_dim, (hf.get("num_key_value_heads") or heads) * head_dim
    return dict(attention=h * (q + 2 * kv) + q * h,
                biases=(q + 2 * kv) if _qkv_bias(hf) else (q + 2 * kv + h) if bias else 0,  # (q, k, v, o)
                norms=2 * head_dim if _qk_norm(hf) else 0,
                heads=heads, qk_head_dim=head_dim, v_head_dim=head_dim)


def layer_parameters(hf: Mapping[str, Any], layer: int) -> LayerParameters:
    """Decoder layer ``layer``'s parameters (see ``is_moe_layer`` for which layers route)."""
    h = hf["hidden_size"]
    attention = _attention(hf)
    attention["norms"] += 2 * h  # input_layernorm, post_attention_layernorm
    if not is_moe_layer(hf, layer):
        mlp_bias = 2 * hf["intermediate_size"] + h if hf.get("mlp_bias") else 0
        return LayerParameters(**dict(attention, biases=attention["biases"] + mlp_bias),
                               mlp=_gated_mlp(h, hf["intermediate_size"]), router=0, expert=0, experts=0, topk=0,
                               shared_experts=0)
    experts = routed_experts(hf)
    expert_ffn = hf.get("moe_intermediate_size") or hf["intermediate_size"]  # Mixtral: the dense size
    if hf.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one shared expert and its sigmoid gate (h -> 1)
        shared = _gated_mlp(h, hf["shared_expert_intermediate_size"]) + h
    else:  # DeepSeek: n_shared_experts experts' worth as one MLP
        shared = _gated_mlp(h, expert_ffn * (hf.get("n_shared_experts") or 0))
    return LayerParameters(**attention, mlp=0, router=experts * h, expert=_gated_mlp(h, expert_ffn), experts=experts,
                           topk=hf["num_experts_per_tok"], shared_experts=shared)


def parameter_counts(hf: Mapping[str, Any]) -> ModelParameters:
    """The parameters of the HF model of config ``hf`` (a causal LM, or a sequence classifier: its
    score head instead of the output layer), per layer and in all."""
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    labels = classifier_labels(hf)
    if labels is not None:
        output, output_matmul = h * labels, h * labels
    else:
        output, output_matmul = (0 if hf.get("tie_word_embeddings") else vocab * h), vocab * h
    return ModelParameters(embedding=vocab * h,
                           layers=tuple(layer_parameters(hf, i) for i in range(hf["num_hidden_layers"])),
                           final_norm=h, output_layer=output, output_matmul=output_matmul)


def total_parameters(hf: Mapping[str, Any]) -> int:
    """Every parameter of the model (what HF's ``sum(p.numel() for p in model.parameters())`` is)."""
    return parameter_counts(hf).total


def active_parameters(hf: Mapping[str, Any]) -> int:
    """Parameters one token passes through (MoE: router, top-k routed and shared experts,
    attention, embedding and output layer; a dense model: all of them)."""
    return parameter_counts(hf).active


def forward_flops_per_token(hf: Mapping[str, Any], sequence_length: int = 0) -> float:
    """Forward FLOPs of one token: 2 x active matmul weights, plus, for ``sequence_length`` > 0,
    attention scores and values averaged over a causal sequence of that length ((S + 1) / 2 keys
    per token); 0 leaves attention out. The module's docstring states the convention."""
    counts = parameter_counts(hf)
    attention = counts.attention_flops(sequence_length) / sequence_length if sequence_length > 0 else 0.0
    return 2.0 * counts.active_matmul + attention


def forward_flops(hf: Mapping[str, Any], sequence_lengths: Iterable[int]) -> float:
    """Forward FLOPs of a batch of causal sequences of these lengths (each attends only to itself,
    as packed or padded rows of megarl's batches do): 2 x active matmul weights per token plus
    each sequence's attention. A training step over them is 3 x this."""
    counts = parameter_counts(hf)
    lengths = list(sequence_lengths)
    return 2.0 * counts.active_matmul * sum(lengths) + float(sum(counts.attention_flops(s) for s in lengths))
