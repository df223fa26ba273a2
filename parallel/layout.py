"""Megatron parallel layouts and their validation (process groups: ``parallel.process_groups``;
the models are built by ``parallel.models``).

A layout is TP x CP x DP x PP (with optional VPP and sequence parallelism) over a world of ranks;
an MoE model's experts are split EP x ETP over the same ranks.
It is validated against the model before any process group or tensor exists, so a bad layout
fails with one message naming the field and the fix.

``MegatronLayout`` is also the run config's layout section (``megarl.config.schema``: ``actor.layout``
and the other roles'), so this module imports neither torch nor pydantic: pydantic reads the
plain-dict ``__pydantic_config__`` and field ``metadata`` below when it validates a config.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

# What pydantic makes of a field's ``metadata`` (``pydantic.Field(strict=True)``): as in the other
# config sections, no string for a number and no 0/1 for a boolean. (Strictness is per field: a
# strict *class* config would also refuse a mapping for the layout itself.)
_STRICT = {"strict": True}


class LayoutError(ValueError):
    """A parallel layout that the world size or the model cannot take."""


@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    """Where a Megatron model's shards live: tensor, pipeline (+virtual), context, data parallel.
    DP is what the world leaves over."""

    # pydantic's config when the run config validates one (unknown keys are refused)
    __pydantic_config__: ClassVar[dict] = {"extra": "forbid"}

    tp: int = dataclasses.field(default=1, metadata=_STRICT)
    pp: int = dataclasses.field(default=1, metadata=_STRICT)
    # virtual pipeline chunks per stage (interleaved 1F1B); None = off
    vpp: int | None = dataclasses.field(default=None, metadata=_STRICT)
    cp: int = dataclasses.field(default=1, metadata=_STRICT)
    sequence_parallel: bool = dataclasses.field(default=False, metadata=_STRICT)
    use_distributed_optimizer: bool = dataclasses.field(default=False, metadata=_STRICT)
    # MoE models: expert parallelism (whole experts split over ep ranks) and expert tensor
    # parallelism (each expert split over etp ranks). The ep*etp expert ranks of a stage are
    # carved from its tp*cp*dp ranks, fastest first (megatron's expert order tp-ep-dp-pp).
    ep: int = dataclasses.field(default=1, metadata=_STRICT)
    etp: int = dataclasses.field(default=1, metadata=_STRICT)

    def __str__(self) -> str:
        """Short form for messages and logs, e.g. ``tp=2 pp=2 cp=1 vpp=2 sp``."""
        extras = ([f"vpp={self.vpp}"] if self.vpp else []) + (["sp"] if self.sequence_parallel else []) + (
            ["dist-opt"] if self.use_distributed_optimizer else []) + (
            [f"ep={self.ep}"] if self.ep > 1 else []) + ([f"etp={self.etp}"] if self.etp > 1 else [])
        return " ".join([f"tp={self.tp} pp={self.pp} cp={self.cp}", *extras])

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
        for field in ("tp", "pp", "cp", "ep", "etp"):
            if getattr(self, field) < 1:
                raise LayoutError(f"layout.{field}={getattr(self, field)} must be >= 1")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise LayoutError(
                f"layout.vpp={self.vpp} needs vpp >= 2 and pp >= 2 (got pp={self.pp}); set vpp to null to disable"
            )
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("layout.sequence_parallel=true needs tp > 1; set it to false for tp=1")
        dp = self.data_parallel_size(world_size)
        if (self.tp * self.cp * dp) % (self.ep * self.etp):
            raise LayoutError(
                f"layout.ep*etp={self.ep}*{self.etp} must divide tp*cp*dp={self.tp}*{self.cp}*{dp} (the expert ranks "
                "of a pipeline stage are its tensor/context/data-parallel ranks); lower ep/etp or add ranks")
        if hf_config is None:
            return
        from model_specs import num_experts

        experts = num_experts(hf_config)
        if (self.ep > 1 or self.etp > 1) and not experts:
            raise LayoutError(f"layout.ep={self.ep}, etp={self.etp} need an MoE model; this model has no experts: set "
                              "ep and etp to 1")
        if experts and self.tp > 1 and not self.sequence_parallel:
            raise LayoutError(f"layout.tp={self.tp} with an MoE model needs layout.sequence_parallel=true (megatron's "
                              "MoE layer refuses to train under TP without it); set sequence_parallel: true")
        if experts and experts % self.ep:
            raise LayoutError(f"layout.ep={self.ep} must divide num_experts={experts}; pick ep from "
                              f"{[e for e in range(1, experts + 1) if experts % e == 0]}")
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
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
        )
