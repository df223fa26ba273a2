"""Per-GPU memory of a model at a layout: closed forms from the HF config, before any GPU exists.

Everything here is arithmetic over the model's shape (``ModelShape.from_hf``, the same HF config
dict ``model_specs`` reads) and a layout (anything with ``tp pp vpp cp sequence_parallel
use_distributed_optimizer`` attributes: ``parallel.layout.MegatronLayout``, also the run config's
layouts). Numbers are bytes on the busiest rank. What is assumed, and why:

Parameters (exact, megatron's local GPT spec = the HF model's tensors): counted per tensor by
``model_specs.arithmetic`` (``parameter_counts``: per layer attention q h*nh*d, k and v h*nkv*d
each, o nh*d*h, gate/up/down 3*h*f, two RMSNorms 2h, plus qkv bias (nh+2nkv)*d (Qwen2) and q/k
norms 2d (Qwen3); an MoE layer (Qwen3-MoE, Mixtral) has instead of gate/up/down a router E*h and
E experts of 3*h*f_e; once embedding V*h, final norm h, untied output layer V*h), which
``ModelShape`` groups by how a rank holds them.
  On a Megatron rank: linear weights / tp, norms and the router replicated, experts / (ep*etp)
  (E/ep whole experts, each split over etp), the vocab padded to a multiple of
  128*tp (megatron's padding) and split over tp; layers / pp per pipeline rank (VPP only
  interleaves them); the embedding on the first stage, final norm + output layer on the last
  (a tied model with pp > 1 keeps a copy there too). A critic's output layer is a value head (h).

Training states, bytes per parameter of the rank (megatron mixed precision, megarl's settings):
  params  dtype size (2 for bf16);
  grads   4: gradients accumulate and are reduced in fp32 (``grad_reduce_in_fp32=True`` in
          megarl/training.py);
  optimizer (Adam) 4 (fp32 master copy, only when params are not fp32) + 4 + 4 (two moments);
          divided by dp*cp with ``use_distributed_optimizer`` (megatron shards it over the
          data-parallel group including context-parallel ranks); the experts' states by their
          expert-data-parallel size tp*cp*dp / (ep*etp) instead.
  bf16 + distributed optimizer: 6 + 12/(dp*cp) bytes per parameter (megatron's own table).

Activations (rough; after Korthikanti et al. 2022, "Reducing Activation Recomputation",
rewritten for Llama-style layers with GQA, SwiGLU and no dropout). Saved for the backward, per
token per layer, in elements:
  4h                    inputs of the two RMSNorms and of the two linears they feed
                        (/tp with sequence parallelism, else replicated on every TP rank)
  2*nh*d + 2*nkv*d      q, k, v kept by the attention and its output (input of o_proj)  (/tp)
  3f                    gate and up outputs (SwiGLU's inputs) and SwiGLU's output       (/tp)
                        MoE: k * (3*f_e/etp + 2h) for the k experts a token is routed to (their
                        SwiGLU as above, plus the token's dispatched and combined copies)
                        and the router's E logits, assuming balanced routing (each rank
                        computes k expert copies per token of its share; a skewed router
                        puts more on the busiest rank)
  times the activation dtype size; softmax statistics are ignored. Tokens per micro-batch are
  micro_batch_size * (max prompt + max response) (padded batches: the worst case) or the token
  budget, / cp. What the core attention keeps besides depends on which one the run builds
  (``parallel.models.core_attention_kind``); S = max prompt + max response keys per sequence
  (exact for padded rows, a bound for packed and shared-prefix ones):
  sdpa,                 nothing (torch's flash kernel on CUDA, which takes the KV heads as they
  transformer_engine    are; TE's fused attention, CP and packed rows included)
  context_parallel,     SDPA with a boolean mask ([S/cp, S] causal on global positions; [branches,
  shared_prefix         L, P + L] per branch), which runs torch's memory-efficient kernel on CUDA
                        (both allow no other there): no score matrix, but
                        - the mask as an additive bias in the activation dtype, shared by the
                          heads, its keys padded to a multiple of 16: ceil16(S) * dtype size
                          bytes per query token;
                        - the keys and values with the query's heads (that kernel has no GQA):
                          2 * nh*d/tp elements per key instead of the 2 * nkv*d/tp counted above;
                          a CP rank keeps all S keys of its sequences (cp times its tokens), a
                          shared-prefix row n * (P + L) keys (the prefix once per branch), the
                          tokens of n padded rows;
                        - SDPA's own copy of its output, nh*d/tp per token (the output
                          projection keeps the rearranged one counted above).
                        A shared-prefix row's prefix attention (its P keys once more) fits in
                        the (n - 1) * P query tokens it saves over n padded rows (n > 1). The
                        memory-efficient kernel needs head_dim a multiple of 8 in 16-bit dtypes
                        (4 in fp32): the plan refuses others for shared-prefix rows (a
                        ValueError that names the fix); a context-parallel call the kernel
                        refuses raises when it runs.
  Recompute (``parallel.models.recompute_config``): full keeps only each layer's input (h
  elements, /tp with SP) plus one layer's full set while it is recomputed; selective (the core
  attention) keeps everything but the core attention's per-key entries above, plus one layer's
  of them while it is recomputed.
  Pipeline (1F1B): stage s holds min(pp - s, micro-batches) micro-batches in flight (the first
  stage pp of them, the last one); interleaving (VPP) multiplies by 1 + (pp-1)/(pp*vpp).
  The last stage also holds the logits of one micro-batch: tokens * V_padded/tp * (dtype size +
  8) (the logits, plus fp32 upcast and softmax kept for the log-prob backward).
  Forward-only passes (reference, old log-probs) keep one layer's working set and the logits.

Rollout (SGLang, one engine per ``rollout.tp`` GPUs):
  weights on a rank: linears / tp, KV heads max(nkv/tp, 1) (replicated when tp > nkv), norms
  and router whole, experts / tp (E/ep experts, each split over tp/ep: whatever the engine's
  ep, a rank holds 1/tp of them), vocab padded to a multiple of 64 and split over tp.
  KV cache per token on a rank: 2 (K and V) * layers * max(nkv/tp, 1) * d * dtype size.
  SGLang reserves ``mem_fraction_static`` of the memory that is free when it starts (what a
  colocated trainer already holds is not free) for weights + KV pool: KV pool = f * free - weights
  (sglang's kv_cache_configurator). Beyond that, CUDA graphs and sampling need a little more
  (``RUNTIME_RESERVE_BYTES``).

Everywhere, a constant ``RUNTIME_RESERVE_BYTES`` stands for the CUDA context, NCCL buffers and
allocator fragmentation.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from model_specs.arithmetic import LayerParameters, ModelParameters

GiB = 1 << 30
# CUDA context (~0.5 GiB), NCCL communicators and buffers, allocator fragmentation: a flat
# allowance per GPU on top of what the tensors need.
RUNTIME_RESERVE_BYTES = 3 * GiB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MEGATRON_VOCAB_DIVISIBLE_BY = 128  # parallel.models.build_model_chunks' default
SGLANG_VOCAB_DIVISIBLE_BY = 64  # sglang's VocabParallelEmbedding padding
# parallel.models.core_attention_kind's names
ATTENTION_KINDS = ("sdpa", "transformer_engine", "context_parallel", "shared_prefix")


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory of a decoder-only model depends on, read from its HF config."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    counts: ModelParameters  # model_specs.arithmetic's per-tensor counts
    qkv_bias: bool = False
    experts: int = 0  # MoE: routed experts per layer (every layer; 0: dense)
    topk: int = 0  # experts per token
    expert_ffn: int = 0  # an expert's intermediate size

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelShape":
        from model_specs import family_for
        from model_specs.arithmetic import parameter_counts

        family = family_for(hf)  # a built family: every layer alike (validation refuses anything else)
        counts = parameter_counts(hf)
        layer = counts.layers[0]
        heads = hf["num_attention_heads"]
        moe = {} if family.moe is None else dict(experts=layer.experts, topk=layer.topk,
                                                 expert_ffn=hf[family.moe.ffn_field])
        return cls(hidden=hf["hidden_size"], ffn=hf["intermediate_size"], layers=hf["num_hidden_layers"],
                   heads=heads, kv_heads=hf.get("num_key_value_heads") or heads,
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, vocab=hf["vocab_size"],
                   tied=bool(hf.get("tie_word_embeddings", False)), counts=counts, qkv_bias=family.qkv_bias, **moe)

    @property
    def layer(self) -> LayerParameters:
        """One decoder layer's parameters (all layers are alike)."""
        return self.counts.layers[0]

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_split_params(self) -> int:
        """Parameters of one layer that tensor parallelism splits (attention's weights and biases;
        the dense MLP, which an MoE layer does not have; shared experts, which no built family has)."""
        return self.layer.attention + self.layer.biases + self.layer.mlp + self.layer.shared_experts

    def layer_replicated_params(self) -> int:
        """Parameters of one layer every TP rank holds whole (the norms, an MoE layer's router)."""
        return self.layer.norms + self.layer.router

    def layer_expert_params(self) -> int:
        """An MoE layer's experts (split over ep*etp ranks); 0 for a dense model."""
        return self.layer.routed

    def total_params(self) -> int:
        """Every parameter of the HF model (no padding), the number HF's ``numel`` reports."""
        return self.counts.total

    def active_params(self) -> int:
        """Parameters a token passes through: all but the experts it is not routed to."""
        return self.counts.active

    def attention_elements_per_token(self, tp: int) -> float:
        """q, k, v and the attention's output, per token on one TP rank (see module doc)."""
        return (2 * self.q_dim + 2 * self.kv_dim) / tp

    def activation_elements_per_token(self, tp: int, sequence_parallel: bool, etp: int = 1) -> float:
        """Elements one layer saves for its backward per token on one TP rank (see module doc)."""
        replicated = 4 * self.hidden
        split = self.attention_elements_per_token(1)
        if not self.experts:
            return replicated / (tp if sequence_parallel else 1) + (split + 3 * self.ffn) / tp
        experts = self.topk * (3 * self.expert_ffn / etp + 2 * self.hidden) + self.experts
        return replicated / (tp if sequence_parallel else 1) + split / tp + experts

    def core_attention_bytes(self, attention: str, *, tp: int, cp: int, dtype_size: int, tokens: float,
                             sequence_length: int | None) -> float:
        """Bytes one layer's core attention keeps for its backward on one TP rank beyond q/k/v and
        its output (``attention_elements_per_token``), for ``tokens`` tokens of the rank and
        sequences of ``sequence_length`` keys (see module doc), for a
        ``parallel.models.core_attention_kind`` name."""
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention={attention!r}; use one of {ATTENTION_KINDS}")
        if attention in ("sdpa", "transformer_engine"):
            return 0
        if sequence_length is None:
            raise ValueError(f"attention={attention!r} keeps a mask entry per key: pass sequence_length")
        multiple = 8 if dtype_size == 2 else 4  # torch's check_head_dim_size_mem_efficient (Ampere on)
        if attention == "shared_prefix" and self.head_dim % multiple:
            raise ValueError(f"shared-prompt rows run torch's memory-efficient attention, which needs a head_dim "
                             f"that is a multiple of {multiple} in {8 * dtype_size}-bit; this model's head_dim is "
                             f"{self.head_dim}: set actor.shared_prompts=false")
        bias = tokens * _ceil_to(sequence_length, 16) * dtype_size
        keys = tokens * (cp if attention == "context_parallel" else 1)
        # K and V with the query's heads instead of the KV heads counted per token, SDPA's output
        kept = 2 * keys * self.q_dim - 2 * tokens * self.kv_dim + tokens * self.q_dim
        return bias + kept / tp * dtype_size


def megatron_stage_expert_params(shape: ModelShape, layout) -> int:
    """Expert parameters on one rank of a pipeline stage: E/ep experts of its layers, / etp."""
    return shape.layers // layout.pp * shape.layer_expert_params() // (layout.ep * layout.etp)


def megatron_stage_params(shape: ModelShape, layout, stage: int, *, value_head: bool = False) -> int:
    """Parameters on one TP rank of pipeline stage ``stage`` (all its virtual chunks), experts
    (``megatron_stage_expert_params``) included."""
    tp, pp = layout.tp, layout.pp
    vocab = _ceil_to(shape.vocab, MEGATRON_VOCAB_DIVISIBLE_BY * tp)
    per_layer = shape.layer_split_params() // tp + shape.layer_replicated_params()
    params = shape.layers // pp * per_layer + megatron_stage_expert_params(shape, layout)
    if stage == 0:
        params += vocab * shape.hidden // tp
    if stage == pp - 1:
        params += shape.hidden  # final norm
        if value_head:
            params += shape.hidden
        elif not shape.tied or pp > 1:
            params += vocab * shape.hidden // tp
    return params


@dataclasses.dataclass
class MemoryEstimate:
    """Bytes per GPU by component (of the busiest rank), with the assumptions that produced them."""

    role: str
    components: dict[str, int]
    notes: list[str] = dataclasses.field(default_factory=list)
    expert_params: int = 0  # of the params on the rank, an MoE model's experts (in "params" too)

    @property
    def total(self) -> int:
        return sum(self.components.values())

    def gib(self, component: str | None = None) -> float:
        return (self.total if component is None else self.components[component]) / GiB


def training_memory(hf: Mapping[str, Any], layout, *, dp: int, dtype: str = "bfloat16",
                    tokens_per_micro_batch: int, micro_batches: int, trainable: bool = True,
                    value_head: bool = False, recompute: str = "none", role: str = "actor",
                    attention: str = "sdpa", sequence_length: int | None = None) -> MemoryEstimate:
    """A Megatron model's memory on its busiest rank: states, activations and logits.

    ``tokens_per_micro_batch``: samples x padded length (or the token budget) of one micro-batch;
    ``micro_batches``: micro-batches per optimizer step and data-parallel rank (bounds the
    pipeline's in-flight count). ``trainable=False``: forward only (reference): params only and
    one layer's working set. ``recompute``: "none", "selective" or "full". ``attention``: the core attention
    (``parallel.models.core_attention_kind``); one that keeps a mask needs ``sequence_length``,
    the keys of the longest sequence (max prompt + max response). A ValueError names what a
    model cannot run with (``ModelShape.core_attention_bytes``).
    """
    from parallel.models import RECOMPUTE

    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}; use one of {list(RECOMPUTE)}")
    shape = ModelShape.from_hf(hf)
    size = DTYPE_BYTES[dtype]
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    tokens = tokens_per_micro_batch / cp
    attention_bytes = shape.core_attention_bytes(attention, tp=tp, cp=cp, dtype_size=size, tokens=tokens,
                                                 sequence_length=sequence_length)  # per layer
    per_layer = shape.activation_elements_per_token(tp, layout.sequence_parallel, layout.etp) * tokens * size \
        + attention_bytes
    layer_input = shape.hidden / (tp if layout.sequence_parallel else 1) * tokens * size
    vocab = _ceil_to(shape.vocab, MEGATRON_VOCAB_DIVISIBLE_BY * tp)
    logits = 0 if value_head else tokens * vocab / tp * (size + 8)
    interleave = 1 + (pp - 1) / (pp * layout.vpp) if layout.vpp else 1.0
    layers_per_stage = shape.layers // pp
    best: tuple[float, dict[str, int]] | None = None
    expert_params = megatron_stage_expert_params(shape, layout)
    for stage in range(pp):
        params = megatron_stage_params(shape, layout, stage, value_head=value_head)
        parts = {"params": params * size}
        if trainable:
            shards, expert_shards = ((dp * cp, tp * cp * dp // (layout.ep * layout.etp))
                                     if layout.use_distributed_optimizer else (1, 1))
            master = 0 if dtype == "float32" else 4
            parts["grads"] = params * 4
            parts["optimizer"] = int((params - expert_params) * (master + 8) / shards
                                     + expert_params * (master + 8) / expert_shards)
            in_flight = min(pp - stage, max(1, micro_batches)) * interleave
            if recompute == "full":
                acts = layers_per_stage * in_flight * layer_input + per_layer
            elif recompute == "selective":
                acts = layers_per_stage * in_flight * (per_layer - attention_bytes) + attention_bytes
            else:
                acts = layers_per_stage * in_flight * per_layer
        else:
            acts = per_layer  # one layer's working set; nothing is kept for a backward
        parts["activations"] = int(acts)
        parts["logits"] = int(logits) if stage == pp - 1 else 0
        total = sum(parts.values())
        if best is None or total > best[0]:
            best = (total, parts)
    notes = [f"{shape.total_params():,} parameters; busiest rank holds {best[1]['params'] // size:,} ({dtype}); "
             f"{tokens_per_micro_batch} tokens per micro-batch"]
    if shape.experts:
        notes.append(f"experts: {shape.experts // layout.ep} of {shape.experts} per layer on a rank (ep={layout.ep}), "
                     f"each 1/{layout.etp} (etp): {expert_params:,} parameters; top-{shape.topk} routing assumed "
                     "balanced for the activations")
    notes.append(f"core attention {attention}: {attention_bytes / GiB:.3f} GiB per layer beyond q/k/v")
    if trainable:
        notes.append("grads fp32; Adam " + ("fp32 master + " if dtype != "float32" else "") + "2 moments"
                     + (f" sharded over dp*cp={dp * cp}" if layout.use_distributed_optimizer else " (not sharded)")
                     + (f" (experts over their data-parallel {tp * cp * dp // (layout.ep * layout.etp)})"
                        if layout.use_distributed_optimizer and shape.experts else "")
                     + f"; recompute={recompute}")
    return MemoryEstimate(role, best[1], notes, expert_params)


def sglang_rank_weight_params(shape: ModelShape, tp: int) -> int:
    """Parameters one SGLang TP rank holds (KV heads replicated when tp > num_key_value_heads)."""
    h = shape.hidden
    kv_dim = max(shape.kv_heads // tp, 1) * shape.head_dim
    q_dim = shape.q_dim // tp
    mlp = shape.layer_expert_params() // tp if shape.experts else 3 * h * shape.ffn // tp
    per_layer = (h * (q_dim + 2 * kv_dim) + q_dim * h + mlp
                 + ((q_dim + 2 * kv_dim) if shape.qkv_bias else 0) + shape.layer_replicated_params())
    vocab = _ceil_to(shape.vocab, SGLANG_VOCAB_DIVISIBLE_BY) // tp
    return shape.layers * per_layer + vocab * h * (1 if shape.tied else 2) + h


def kv_bytes_per_token(shape: ModelShape, tp: int, dtype: str = "bfloat16") -> int:
    """KV cache bytes one SGLang TP rank needs per cached token."""
    return 2 * shape.layers * max(shape.kv_heads // tp, 1) * shape.head_dim * DTYPE_BYTES[dtype]


@dataclasses.dataclass
class RolloutMemory:
    """An SGLang rank's memory: what it reserves, and whether the rollout batch fits its KV pool."""

    weights: int
    reserved: int  # mem_fraction_static * the memory free at engine start (weights + KV pool)
    kv_pool: int
    kv_per_token: int
    tokens_needed: int  # every sequence of a step on this engine at full length, cached at once

    @property
    def kv_capacity_tokens(self) -> int:
        return max(self.kv_pool, 0) // self.kv_per_token

    @property
    def concurrency_fraction(self) -> float:
        """Share of the step's sequences that fit in the KV pool at once (1.0: all of them)."""
        return min(1.0, self.kv_capacity_tokens / self.tokens_needed) if self.tokens_needed else 1.0


def rollout_memory(hf: Mapping[str, Any], tp: int, *, dtype: str = "bfloat16", free_bytes: int,
                   mem_fraction_static: float, sequences_per_engine: int, tokens_per_sequence: int) -> RolloutMemory:
    """SGLang's static reservation on one rank of an engine of ``tp`` GPUs, started with
    ``free_bytes`` free (the GPU minus what a colocated trainer already holds)."""
    shape = ModelShape.from_hf(hf)
    weights = sglang_rank_weight_params(shape, tp) * DTYPE_BYTES[dtype]
    reserved = int(mem_fraction_static * free_bytes)
    return RolloutMemory(weights=weights, reserved=max(reserved, weights), kv_pool=reserved - weights,
                         kv_per_token=kv_bytes_per_token(shape, tp, dtype),
                         tokens_needed=sequences_per_engine * tokens_per_sequence)
