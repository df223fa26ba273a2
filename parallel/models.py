"""This rank's Megatron model chunks at a layout: the policy (GPTModel) and the critic (GPTModel with
a value head), their layer spec, and initialisation that is the same at every layout.

``parallel.layout`` says where shards live; this module builds the modules that hold them, from
``model_specs`` (the family's TransformerConfig and GPTModel arguments) and ``parallel.modules``
(the attention variants and the value head).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from model_specs import check_layer_spec
from parallel.cpu import compat as cpu_compat
from parallel.layout import MegatronLayout
from parallel.modules.value_head import ValueHead


def megatron_config(
    hf_config: Mapping[str, Any],
    layout: MegatronLayout,
    params_dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
):
    """megatron's TransformerConfig for an HF config at a layout (no process groups needed). Its
    ``bf16``/``fp16`` flags follow ``params_dtype`` as megatron's ``--bf16``/``--fp16`` set them,
    so what branches on them (the attention's fp32 softmax of half-precision scores) sees the
    model's real precision."""
    from megatron.core.transformer import TransformerConfig

    from model_specs import family_for
    if cpu_compat.needed():
        config_overrides = {**cpu_compat.GLOO_CONFIG_OVERRIDES, **config_overrides}
    family = family_for(hf_config)
    config = TransformerConfig(**{  # overrides win over the family's mapping (e.g. the MoE aux-loss coefficient)
        **family.transformer_config_kwargs(hf_config),
        **layout.transformer_config_kwargs(),
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "fp16": params_dtype == torch.float16,
        "use_cpu_initialization": True,
        **config_overrides,
    })
    # YaRN: megatron-core's GPTModel and attention read these with getattr; they are not
    # TransformerConfig fields (model_specs.base: the RoPE mapping).
    for name, value in family.yarn_config_attributes(hf_config).items():
        setattr(config, name, value)
    return config



RECOMPUTE = ("none", "selective", "full")  # activation recompute settings (``recompute_config``)
MOE_TOKEN_DISPATCHERS = ("allgather", "alltoall")  # megatron's MoE dispatchers megarl builds


def recompute_config(recompute: str) -> dict:
    """megatron's TransformerConfig fields for an activation-recompute setting (training only:
    megatron recomputes nothing in a forward-only pass). "none": every activation kept;
    "selective": megatron's core-attention recompute (the attention's own buffers, such as the
    context-parallel and shared-prefix masks, are rebuilt in the backward instead of kept);
    "full": each layer keeps only its input and is run again in the backward (megatron's
    "uniform" method, one layer per unit)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}; use one of {list(RECOMPUTE)}")
    return {"none": {},
            "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
            "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
            }[recompute]


def _leave_as_allocated(tensor: torch.Tensor) -> None:
    """An init method that draws nothing."""


def no_random_init() -> dict:
    """TransformerConfig fields that skip megatron's random draws (the weights keep what
    ``torch.empty`` allocated), for weights loaded next. Not ``perform_initialization=False``:
    with it megatron's local layers also skip setting their tensor-parallel attributes
    (``tensor_model_parallel``, ``partition_dim``), so at TP > 1 the gradient norm counts every
    shard of a split weight as replicated."""
    return {"init_method": _leave_as_allocated, "output_layer_init_method": _leave_as_allocated,
            "embedding_init_method": _leave_as_allocated}


def common_micro_batch_shape(layout, moe_token_dispatcher: str | None, gloo: bool | None = None) -> bool:
    """Whether every micro-batch of a step, all replicas' included, must take one shape. With
    megatron's allgather MoE dispatcher (``moe_token_dispatcher``; None for a dense model): under
    pipelining (the dispatcher refuses megatron's ``variable_seq_lengths``, so the pipeline's
    receive buffers have one fixed shape) and when an expert-parallel group spans data-parallel
    replicas (ep x etp > tp x cp: its all-gather needs one token count on every member). On
    ``gloo`` (None: when megatron runs on the CPU) under the interleaved schedule (vpp): megatron
    sends the shapes as one batch of sends and receives, which gloo matches to the same peer by
    order (docs/cpu.md), so a shape can arrive as the other direction's and the ranks hang.
    Otherwise each micro-batch keeps its own shape; under pipelining megatron's p2p then sends
    each one's shape ahead of it (``variable_seq_lengths``, set by ``build_model_chunks``)."""
    if moe_token_dispatcher not in (None, *MOE_TOKEN_DISPATCHERS):
        raise ValueError(f"moe_token_dispatcher={moe_token_dispatcher!r}; use one of {list(MOE_TOKEN_DISPATCHERS)}")
    if layout.vpp and (cpu_compat.needed() if gloo is None else gloo):
        return True
    return moe_token_dispatcher == "allgather" and (layout.pp > 1 or layout.ep * layout.etp > layout.tp * layout.cp)


def default_layer_spec(hf_config: Mapping[str, Any] | None = None) -> str:
    """The layer spec (``model_specs.LAYER_SPECS``) a build uses unless told: Transformer Engine's
    ("te": fused norm + linear, TE's attention with native CP and packed rows) when it imports,
    else megatron's local spec ("local": pure torch, what CPUs run); "local" for an MoE model
    (``hf_config`` with experts), whose TE names are not mapped yet."""
    from model_specs import num_experts

    if hf_config is not None and num_experts(hf_config):
        return "local"
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return "local"
    return "te"


def core_attention_kind(layout, packed_sequences: bool = False, shared_prompts: bool = False,
                        layer_spec: str = "local") -> str:
    """Which core attention ``transformer_layer_spec`` builds for these rows at ``layout``
    (anything with a ``cp``), by name: "shared_prefix" (``parallel.modules.shared_prefix``) for
    shared-prompt rows; in the TE spec otherwise "transformer_engine" (TEDotProductAttention);
    in the local spec "context_parallel" (``parallel.modules.context_parallel``) at cp > 1 or for
    packed rows, else "sdpa" (``parallel.modules.sdpa_attention``). The launch plan sizes
    activations by it (``parallel.memory``)."""
    if shared_prompts and (layout.cp > 1 or packed_sequences):
        raise ValueError(f"shared-prompt rows need context parallelism 1 (cp={layout.cp}) and padded rows "
                         f"(packed_sequences={packed_sequences}); turn shared_prompts off")
    if shared_prompts:
        return "shared_prefix"
    if check_layer_spec(layer_spec) == "te":
        return "transformer_engine"
    return "context_parallel" if layout.cp > 1 or packed_sequences else "sdpa"



def transformer_layer_spec(config, layout: MegatronLayout, packed_sequences: bool = False, shared_prompts: bool = False,
                           layer_spec: str = "local"):
    """The transformer-layer spec with the core attention named by ``core_attention_kind``.

    ``layer_spec="local"``: megatron's local spec (pure torch; runs on CPU) with ``SDPAttention``
    (torch's fused attention: flash / memory-efficient kernels on CUDA, no [s, s] score matrix)
    for plain rows, the project's context-parallel attention when ``layout.cp > 1`` or
    ``packed_sequences`` (megatron's local DotProductAttention refuses both CP and
    packed_seq_params), the shared-prefix rows' attention when ``shared_prompts``.
    ``layer_spec="te"``: megatron's Transformer Engine spec (norms fused into linear_qkv /
    linear_fc1, TEDotProductAttention doing CP and packed rows itself), the shared-prefix
    attention in its core-attention slot for shared-prompt rows. The attention has no parameters,
    so all local variants hold the same weights; the TE spec's names differ only in the fused
    norms (``model_specs.megatron_name``), which conversion and resharding map.
    """
    import copy

    from parallel.modules.context_parallel import ContextParallelAttention
    from parallel.modules.sdpa_attention import SDPAttention
    from parallel.modules.shared_prefix import SharedPrefixAttention

    kind = core_attention_kind(layout, packed_sequences, shared_prompts, layer_spec)
    if layer_spec == "te" and config.num_moe_experts:
        raise ValueError("layer_spec='te' is not mapped for MoE models yet (model_specs.gpt_weight_rules); "
                         "use layer_spec='local'")
    if layer_spec == "te":
        try:
            import transformer_engine  # noqa: F401  (megatron's TE spec fails with a NameError without it)
        except ImportError as error:
            raise ValueError(f"layer_spec='te' needs Transformer Engine, which does not import here ({error}); "
                             "install transformer-engine on the GPU machines, or use layer_spec='local'") from error
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = copy.deepcopy(get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm))
        if kind == "shared_prefix":
            spec.submodules.self_attention.submodules.core_attention = SharedPrefixAttention
        return spec
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    attention = {"sdpa": SDPAttention, "context_parallel": ContextParallelAttention,
                 "shared_prefix": SharedPrefixAttention}[kind]
    # MoE: megatron's MoELayer with SequentialMLP experts (grouped GEMM needs TE or CUDA kernels).
    spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                                  qk_layernorm=config.qk_layernorm, normalization="RMSNorm"))
    spec.submodules.self_attention.submodules.core_attention = attention
    return spec



def build_model_chunks(
    hf_config: Mapping[str, Any],
    layout: MegatronLayout,
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    packed_sequences: bool = False,
    shared_prompts: bool = False,
    layer_spec: str | None = None,
    moe_token_dispatcher: str = "allgather",
    recompute: str = "none",
    random_init: bool = True,
    **config_overrides: Any,
) -> list:
    """This rank's GPTModel chunks (one per virtual pipeline stage) for an HF config.

    Weights are initialised on the CPU from the full tensors and then split (megatron's
    ``use_cpu_initialization``), so the same seed gives the same model at every layout;
    ``random_init=False`` draws nothing (``no_random_init``) for a caller that loads every
    element next (an HF or distributed checkpoint).
    ``packed_sequences``: the chunks accept ``packed_seq_params`` (see parallel.modules.packing);
    ``shared_prompts``: shared-prefix rows' segment ids as ``attention_mask`` (parallel.modules.shared_prefix);
    ``layer_spec``: "local" or "te" (``transformer_layer_spec``), None for ``default_layer_spec(hf_config)``;
    ``moe_token_dispatcher``: an MoE model's token dispatcher (``MOE_TOKEN_DISPATCHERS``);
    ``recompute``: activation recompute in training (``recompute_config``). Under pipelining the
    micro-batches may differ in shape unless ``common_micro_batch_shape`` says otherwise.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from model_specs import family_for, num_experts, padded_vocab_size

    family = family_for(hf_config)
    dispatcher = moe_token_dispatcher if num_experts(hf_config) else None
    variable_shapes = layout.pp > 1 and not common_micro_batch_shape(layout, dispatcher)
    config = megatron_config(hf_config, layout, params_dtype, **{
        # a dense model has no dispatcher; megatron refuses variable_seq_lengths with its default, allgather
        "moe_token_dispatcher_type": dispatcher or "alltoall",
        "variable_seq_lengths": variable_shapes,
        **({} if random_init else no_random_init()),
        **recompute_config(recompute),
        **config_overrides,
    })
    model_kwargs = family.gpt_model_kwargs(hf_config)
    model_kwargs["vocab_size"] = padded_vocab_size(model_kwargs["vocab_size"], make_vocab_size_divisible_by, layout.tp)
    spec = transformer_layer_spec(config, layout, packed_sequences, shared_prompts,
                                  default_layer_spec(hf_config) if layer_spec is None else layer_spec)
    llama3_overrides = family.llama3_scaling_overrides(hf_config)
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        vp = vp_stage if layout.vpp else None
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=spec,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                vp_stage=vp,
                **model_kwargs,
            )
        )
        if llama3_overrides:
            _rescale_llama3_rope(chunks[-1].rotary_pos_emb, config.kv_channels, model_kwargs["rotary_base"],
                                 llama3_overrides)
    return place_chunks(chunks)


def place_chunks(chunks: list, device: torch.device | None = None) -> list:
    """What megatron's Float16Module and its ``get_model``'s ``.cuda()`` do to built chunks: every
    floating parameter and buffer in ``config.params_dtype`` (without TE or apex the local spec's
    norms are torch RMSNorms, built in fp32 whatever params_dtype says: a bf16 actor then trained
    fp32 norms, and gathering them for an HF export at TP=2 aborted in gloo), on this process's
    current GPU when there is one (weights are initialised on the CPU: use_cpu_initialization).
    RoPE's ``inv_freq`` is a plain attribute: moved by hand, kept fp32. ``device`` overrides the
    GPU (tests run the real code paths shape-only on ``meta``). Returns ``chunks``."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    for chunk in chunks:
        chunk.to(device=device, dtype=chunk.config.params_dtype)
        rope = getattr(chunk, "rotary_pos_emb", None)
        if device is not None and rope is not None:
            rope.inv_freq = rope.inv_freq.to(device)
    return chunks


def _rescale_llama3_rope(rope, dim: int, rotary_base, overrides: Mapping[str, Any]) -> None:
    """Give a llama3-scaled RotaryEmbedding the checkpoint's low/high frequency factors and original
    context: megatron-core's own ``_apply_scaling`` (HF's formula) hard-codes 1, 4 and 8192 in its
    constructor, so it is re-run here on the unscaled frequencies, computed as the constructor does,
    with the checkpoint's values (model_specs ``llama3_scaling_overrides``). Before any forward:
    the embedding caches its output per sequence length."""
    unscaled = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rope.inv_freq.device) / dim))
    rope.inv_freq = rope._apply_scaling(unscaled, **overrides)



def global_param_name(chunk, name: str) -> str:
    """A chunk parameter's name with its local layer index replaced by megatron's global layer
    number (0-based), so the same parameter has the same name at every TP/PP/VPP layout."""
    parts = name.split(".")
    if "layers" in parts:
        index = parts.index("layers") + 1
        parts[index] = str(chunk.decoder.layers[int(parts[index])].layer_number - 1)
    if parts[-2:] == ["output_layer", "weight"] and chunk.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return ".".join(parts)



def init_params_layout_independent(chunks: list, seed: int, vocab_size: int, std: float = 0.02) -> None:
    """Overwrite every parameter with a shard of a full tensor drawn from (seed, global name).

    Megatron's own initialisation depends on the order in which a rank builds its layers, so
    PP/VPP layouts start from different weights; after this, every layout holds the same model
    and must compute the same losses and gradients (the strongest layout oracle we have).
    Norm weights are 1 + noise and biases small noise, so a misplaced one changes the output.
    Vocab rows past ``vocab_size`` (Megatron's TP-dependent padding) are zero; the gated MLP's
    fused [gate; up] weight is sharded per half, as megatron lays it out per rank.
    """
    import zlib

    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for chunk in chunks:
            if unwrap_model(chunk).config.num_moe_experts:
                raise ValueError("init_params_layout_independent does not place experts (local expert indices, "
                                 "expert TP); give an MoE model the same weights at every layout by loading an HF "
                                 "checkpoint (parallel.checkpoint.convert.load_hf_into_chunks)")
            for name, param in chunk.named_parameters():
                key = global_param_name(chunk, name)
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
                full_shape = list(param.shape)
                partitioned = getattr(param, "tensor_model_parallel", False)
                if partitioned:
                    full_shape[param.partition_dim] *= tp_size
                is_vocab = key in ("embedding.word_embeddings.weight", "output_layer.weight")
                draw_shape = [vocab_size, *full_shape[1:]] if is_vocab else full_shape
                full = torch.randn(draw_shape, generator=generator, dtype=torch.float32)
                if "layernorm" in key or key.endswith("norm.weight"):
                    full = 1.0 + 0.1 * full
                elif key.endswith("bias"):
                    full = 0.1 * full
                else:
                    full = std * full
                if is_vocab:
                    full = torch.cat([full, full.new_zeros(full_shape[0] - vocab_size, *full_shape[1:])])
                if not partitioned:
                    param.copy_(full)
                elif key.endswith("linear_fc1.weight") and chunk.config.gated_linear_unit:
                    gate, up = full.chunk(2, dim=0)
                    param.copy_(torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]]))
                else:
                    param.copy_(full.chunk(tp_size, dim=param.partition_dim)[tp_rank])



def unwrap_model(chunk):
    """The GPTModel inside DDP/Float16 wrappers (wrappers prefix parameter names with 'module.')."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def is_value_chunk(chunk) -> bool:
    """Whether a (possibly DDP-wrapped) chunk's output layer is a ValueHead."""
    model = unwrap_model(chunk)
    return isinstance(getattr(model, "output_layer", None), ValueHead)



def value_heads(chunks: list) -> list[ValueHead]:
    """The value heads of this rank's chunks (one on the last pipeline stage's last chunk, else none)."""
    return [unwrap_model(c).output_layer for c in chunks if is_value_chunk(c)]



def build_value_model_chunks(
    hf_config: Mapping[str, Any],
    layout: MegatronLayout,
    params_dtype: torch.dtype = torch.float32,
    head_seed: int = 0,
    head_std: float | None = None,
    **build_kwargs: Any,
) -> list:
    """This rank's critic chunks (one GPTModel per virtual pipeline stage, like
    ``build_model_chunks``), untied, the last stage's output layer a ``ValueHead`` initialised by
    ``init_value_head(chunks, head_seed, head_std)``. Transformer weights are megatron's init
    until loaded (``load_hf_into_value_chunks`` or a dist checkpoint). ``build_kwargs`` go to
    ``build_model_chunks`` unchanged (TransformerConfig overrides, packed_sequences, ...)."""
    untied = {**hf_config, "tie_word_embeddings": False}
    chunks = build_model_chunks(untied, layout, params_dtype, **build_kwargs)
    for chunk in chunks:
        model = unwrap_model(chunk)
        if model.post_process:
            if model.share_embeddings_and_output_weights:
                raise AssertionError("critic chunk was built with tied embeddings")
            model.output_layer = ValueHead(model.config)
    init_value_head(chunks, head_seed, hf_config.get("initializer_range", 0.02) if head_std is None else head_std)
    return place_chunks(chunks)



def init_value_head(chunks: list, seed: int = 0, std: float = 0.02) -> None:
    """Set every value head to the same N(0, std^2) draw from ``torch.Generator().manual_seed(seed)``
    (identical on every rank and layout; std=0 gives zeros)."""
    for head in value_heads(chunks):
        generator = torch.Generator().manual_seed(seed)
        full = torch.randn(head.weight.shape, generator=generator, dtype=torch.float32) * std
        with torch.no_grad():
            head.weight.copy_(full)



def init_value_params_layout_independent(chunks: list, seed: int, vocab_size: int, std: float = 0.02,
                                         head_seed: int = 0, head_std: float = 0.02) -> None:
    """``init_params_layout_independent`` for critic chunks (it would treat the [1, hidden] head as
    a vocab matrix): every other parameter from (seed, global name), the head by ``init_value_head``."""
    models = [unwrap_model(c) for c in chunks]
    heads = {}
    for index, model in enumerate(models):
        if isinstance(getattr(model, "output_layer", None), ValueHead):
            heads[index] = model.output_layer
            model.output_layer = torch.nn.Module()  # no parameters while the rest is drawn
    try:
        init_params_layout_independent(chunks, seed, vocab_size, std)
    finally:
        for index, head in heads.items():
            models[index].output_layer = head
    init_value_head(chunks, head_seed, head_std)
