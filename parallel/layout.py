"""Megatron parallel layouts: validation, process-group setup and building the model chunks.

A layout is TP x CP x DP x PP (with optional VPP and sequence parallelism) over a world of ranks.
It is validated against the model before any process group or tensor exists, so a bad layout
fails with one message naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch


class LayoutError(ValueError):
    """A parallel layout that the world size or the model cannot take."""


@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    """Where a Megatron model's shards live: tensor, pipeline (+virtual), context, data parallel."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline chunks per stage (interleaved schedule); None = off
    cp: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False

    def data_parallel_size(self, world_size: int) -> int:
        """DP implied by the world size; raises if the world is not a multiple of TP*PP*CP."""
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise LayoutError(
                f"world_size={world_size} is not divisible by tp*pp*cp={self.tp}*{self.pp}*{self.cp}"
                f"={model_parallel}; choose a world size that is a multiple of it"
            )
        return world_size // model_parallel

    def validate(self, world_size: int, hf_config: Mapping[str, Any] | None = None) -> None:
        """Check the layout against the world size and (if given) the model, before any work."""
        for field in ("tp", "pp", "cp"):
            if getattr(self, field) < 1:
                raise LayoutError(f"layout.{field}={getattr(self, field)} must be >= 1")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise LayoutError(
                f"layout.vpp={self.vpp} needs vpp >= 2 and pp >= 2 (got pp={self.pp}); set vpp to null to disable"
            )
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("layout.sequence_parallel=true needs tp > 1; set it to false for tp=1")
        self.data_parallel_size(world_size)
        if hf_config is None:
            return
        heads = hf_config["num_attention_heads"]
        kv_heads = hf_config.get("num_key_value_heads") or heads
        if heads % self.tp or kv_heads % self.tp:
            raise LayoutError(
                f"layout.tp={self.tp} must divide num_attention_heads={heads} and "
                f"num_key_value_heads={kv_heads}; pick tp from "
                f"{[t for t in range(1, kv_heads + 1) if heads % t == 0 and kv_heads % t == 0]}"
            )
        chunks = self.pp * (self.vpp or 1)
        layers = hf_config["num_hidden_layers"]
        if layers % chunks:
            raise LayoutError(
                f"num_hidden_layers={layers} is not divisible by pp*vpp={chunks}; choose pp/vpp so it is"
            )

    def sequence_length_multiple(self) -> int:
        """What every micro-batch's sequence length must be a multiple of: 2*cp for the zig-zag
        context-parallel split, and each CP rank's share divisible by tp under sequence parallel."""
        multiple = 2 * self.cp if self.cp > 1 else 1
        if self.sequence_parallel:
            multiple = math.lcm(multiple, self.cp * self.tp)
        return multiple

    def validate_sequence_length(self, seq_length: int, field: str = "seq_length") -> None:
        """Check a (padded) sequence length against the layout before any work."""
        multiple = self.sequence_length_multiple()
        if seq_length < 1 or seq_length % multiple:
            why = []
            if self.cp > 1:
                why.append(f"2*cp={2 * self.cp} (context-parallel zig-zag split)")
            if self.sequence_parallel:
                why.append(f"cp*tp={self.cp * self.tp} (sequence parallel)")
            raise LayoutError(
                f"{field}={seq_length} must be a positive multiple of {multiple} for this layout "
                f"({' and '.join(why)}); pad sequences to a multiple of {multiple}"
            )

    def transformer_config_kwargs(self) -> dict:
        """The parallel part of megatron's TransformerConfig."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
            context_parallel_size=self.cp,
            sequence_parallel=self.sequence_parallel,
        )


def initialize_megatron(layout: MegatronLayout, seed: int = 1234) -> None:
    """Create megatron's process groups for ``layout`` (torch.distributed must be initialised)
    and seed its model-parallel RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from parallel import cpu_compat

    cpu_compat.apply()
    layout.validate(dist.get_world_size())
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def megatron_config(
    hf_config: Mapping[str, Any],
    layout: MegatronLayout,
    params_dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
):
    """megatron's TransformerConfig for an HF config at a layout (no process groups needed)."""
    from megatron.core.transformer import TransformerConfig

    from model_specs import family_for
    from parallel import cpu_compat

    if cpu_compat.needed():
        config_overrides = {**cpu_compat.GLOO_CONFIG_OVERRIDES, **config_overrides}
    return TransformerConfig(
        **family_for(hf_config).transformer_config_kwargs(hf_config),
        **layout.transformer_config_kwargs(),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=True,
        **config_overrides,
    )


def layer_spec(config, layout: MegatronLayout, packed_sequences: bool = False, shared_prompts: bool = False):
    """The transformer-layer spec: megatron's local spec (pure torch; runs on CPU), with the core
    attention replaced by the project's context-parallel attention when ``layout.cp > 1`` or
    ``packed_sequences`` (megatron's local DotProductAttention refuses both CP and
    packed_seq_params; only Transformer Engine's does them), or by the shared-prefix rows'
    attention when ``shared_prompts`` (``parallel.shared_prefix``). The attention has no
    parameters, so all specs hold the same weights and checkpoints.

    Branch point for GPUs: with Transformer Engine installed, megatron's
    ``get_gpt_layer_with_transformer_engine_spec`` (TEDotProductAttention does CP natively, with
    ring/all-gather/all-to-all ``cp_comm_type``, and packed sequences) is the right spec; it is
    not used yet because TE-fused parameter names differ from the local spec's.
    """
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    if shared_prompts and (layout.cp > 1 or packed_sequences):
        raise ValueError(f"shared-prompt rows need context parallelism 1 (cp={layout.cp}) and padded rows "
                         f"(packed_sequences={packed_sequences}); turn shared_prompts off")
    if layout.cp > 1 or packed_sequences or shared_prompts:
        from parallel.context_parallel import ContextParallelAttention
        from parallel.shared_prefix import SharedPrefixAttention

        spec = copy.deepcopy(spec)
        attention = SharedPrefixAttention if shared_prompts else ContextParallelAttention
        spec.submodules.self_attention.submodules.core_attention = attention
    return spec


def build_model_chunks(
    hf_config: Mapping[str, Any],
    layout: MegatronLayout,
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    packed_sequences: bool = False,
    shared_prompts: bool = False,
    **config_overrides: Any,
) -> list:
    """This rank's GPTModel chunks (one per virtual pipeline stage) for an HF config.

    Weights are initialised on the CPU from the full tensors and then split (megatron's
    ``use_cpu_initialization``), so the same seed gives the same model at every layout.
    ``packed_sequences``: the chunks accept ``packed_seq_params`` (see parallel.packing);
    ``shared_prompts``: shared-prefix rows' segment ids as ``attention_mask`` (parallel.shared_prefix).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from model_specs import family_for, padded_vocab_size

    family = family_for(hf_config)
    config = megatron_config(hf_config, layout, params_dtype, **config_overrides)
    model_kwargs = family.gpt_model_kwargs(hf_config)
    model_kwargs["vocab_size"] = padded_vocab_size(model_kwargs["vocab_size"], make_vocab_size_divisible_by, layout.tp)
    spec = layer_spec(config, layout, packed_sequences, shared_prompts)
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
    return chunks


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
