"""mbridge (pip ``mbridge==0.15.1``, a test oracle only) driven on megarl's Megatron chunks.

mbridge is an independent HF <-> Megatron-core converter. Its loader (``Bridge.load_weights``)
and exporter (``Bridge.export_weights`` / ``save_weights``) work on any list of GPTModel chunks,
but it assumes the Transformer Engine layer spec, which megarl does not use on CPU. Two small
overrides, kept here (test code) and not in the library, make it work on megatron's local spec:

1. Norm names. The TE spec fuses the pre-attention / pre-MLP RMSNorms into the following linear
   (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``); the
   local spec has separate ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight``. The bridge
   maps the local names to the TE names before its own HF-name lookup.
2. Vocab sizes. mbridge sets its ``vocab_size`` / ``padded_vocab_size`` inside its own model
   provider (which hard-codes the TE spec, and reads ``hf_config.rope_theta``, gone in
   transformers 5); the chunks here are built by ``parallel.models.build_model_chunks``, so the
   two sizes are set from the HF config and Megatron's padding rule (multiple of 128 * TP).

A third override works around an mbridge bug rather than the spec: Qwen2's bridge ties the
output layer to ``embed_tokens`` by mutating the class-level ``_DIRECT_MAPPING`` dict, so every
later bridge in the process (an untied Qwen2 too) maps ``output_layer`` to ``embed_tokens``.
Each bridge here gets its own copy of the mapping, taken before any bridge was created.

Everything else (the QKV interleave by query group, gate/up stacking, TP splits and merges,
vocab padding rows, PP broadcasts, tied embeddings for Qwen2) is mbridge's own code.

On chunks in TE-spec structure (``te_stand_in.to_te_structure``; ``layer_spec="te"``) mbridge
needs no name override: its mapping tables are spelled in TE's names. Overrides 2 and 3 stay.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from model_specs import padded_vocab_size
from parallel.layout import MegatronLayout

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # megarl's default (parallel.models.build_model_chunks)

# megatron local-spec parameter suffix -> the TE-spec name mbridge's mapping tables know.
LOCAL_TO_TE_NORM_NAMES = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


def te_name(mcore_name: str) -> str:
    for local, te in LOCAL_TO_TE_NORM_NAMES.items():
        if mcore_name.endswith(local):
            return mcore_name[: -len(local)] + te
    return mcore_name


_PRISTINE_DIRECT_MAPPING: dict[type, dict[str, str]] = {}


def local_spec_bridge(hf_dir: str, layout: MegatronLayout, dtype: torch.dtype = torch.float32):
    """``bridge_for`` chunks of megatron's local spec."""
    return bridge_for(hf_dir, layout, dtype, layer_spec="local")


def bridge_for(hf_dir: str, layout: MegatronLayout, dtype: torch.dtype = torch.float32, layer_spec: str = "local",
               parallel_states=None):
    """An mbridge bridge for the HF checkpoint at ``hf_dir``, for chunks built at ``layout`` by
    ``build_model_chunks`` (``layer_spec="local"``) or rearranged by ``te_stand_in.to_te_structure``
    (``"te"``). Call after ``initialize_megatron`` (mbridge reads the process groups when it is
    created), or give mbridge's ``ParallelStates`` for its pure mapping functions only."""
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    base = _MODEL_REGISTRY[hf_config.model_type]
    pristine = _PRISTINE_DIRECT_MAPPING.setdefault(base, dict(base._DIRECT_MAPPING))
    rename = te_name if layer_spec == "local" else (lambda name: name)

    class LocalSpecBridge(base):
        def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
            # override 1 (local spec only): local-spec norm names
            return super()._weight_name_mapping_mcore_to_hf(rename(mcore_weights_name))

        def _adjust_mapping_for_shared_weights(self):
            # mbridge bug workaround: tie on this bridge's own copy, not the class's dict
            self._DIRECT_MAPPING = dict(pristine)
            super()._adjust_mapping_for_shared_weights()

    divisible_by = MAKE_VOCAB_SIZE_DIVISIBLE_BY * layout.tp
    bridge = LocalSpecBridge(hf_config, dtype=dtype, parallel_states=parallel_states,
                             make_vocab_size_divisible_by=divisible_by)
    # override 2: the vocab sizes mbridge's (TE-only) model provider would have set
    bridge.vocab_size = hf_config.vocab_size
    bridge.padded_vocab_size = padded_vocab_size(hf_config.vocab_size, MAKE_VOCAB_SIZE_DIVISIBLE_BY, layout.tp)
    return bridge


def fill_with_nan(chunks: list) -> None:
    """Poison every parameter so an element a loader forgets to write cannot compare equal."""
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                param.fill_(float("nan"))


def compare_loads_and_exports(jobs: list[tuple[str, str, str, bool]], layouts: list[Mapping[str, Any]],
                              layer_spec: str = "local") -> dict:
    """Rank function. For every layout and every (hf_dir, ours_dir, theirs_dir, pp1_only) job
    (``pp1_only``: skipped at PP > 1): load the HF
    checkpoint into one set of chunks with megarl's loader and into another with mbridge's, and
    compare every local parameter bit for bit (padding rows included: both must write zeros);
    then export each set with its own exporter, megarl's to ``ours_dir/<layout>`` and mbridge's
    to ``theirs_dir/<layout>``, for the caller to compare file by file. ``layer_spec="te"``: both
    sets of chunks are in TE-spec structure (``te_stand_in.to_te_structure``).

    Returns this rank's {layout name: {hf_dir: {"params": n compared, "mismatches": [...]}}}.
    """
    import warnings

    import torch.distributed as dist
    from megatron.core import parallel_state

    from parallel.checkpoint.convert import export_hf_checkpoint, load_hf_into_chunks
    from parallel.checkpoint.hf_io import HFCheckpoint, chunks_layer_spec
    from parallel.models import build_model_chunks
    from parallel.process_groups import initialize_megatron

    # mbridge writes no index for single-file checkpoints and says so; nothing is missing.
    warnings.filterwarnings("ignore", message="No index file found")
    report: dict = {}
    for layout_kwargs in layouts:
        layout = MegatronLayout(**layout_kwargs)
        name = layout_name(layout_kwargs)
        initialize_megatron(layout)
        per_model = report.setdefault(name, {})
        for hf_dir, ours_dir, theirs_dir, pp1_only in jobs:
            if pp1_only and layout.pp > 1:
                continue
            ckpt = HFCheckpoint(hf_dir)
            ours = build_model_chunks(ckpt.config, layout)
            theirs = build_model_chunks(ckpt.config, layout)
            if layer_spec == "te":
                from tests.parallel.checkpoint.te_stand_in import to_te_structure

                to_te_structure(ours)
                to_te_structure(theirs)
            fill_with_nan(ours)
            fill_with_nan(theirs)
            load_hf_into_chunks(ours, ckpt, layout)
            bridge = bridge_for(hf_dir, layout, layer_spec=layer_spec)
            with torch.no_grad():
                bridge.load_weights(theirs, hf_dir)
            mismatches, count = [], 0
            for index, (a, b) in enumerate(zip(ours, theirs)):
                params_a, params_b = dict(a.named_parameters()), dict(b.named_parameters())
                if set(params_a) != set(params_b):
                    mismatches.append(f"chunk {index}: parameter names differ")
                for param_name, param in params_a.items():
                    count += 1
                    if not torch.equal(param, params_b[param_name]):
                        mismatches.append(f"chunk {index} {param_name}")
            export_hf_checkpoint(ours, ckpt.config, layout, f"{ours_dir}/{name}")
            bridge.save_weights(theirs, f"{theirs_dir}/{name}")
            dist.barrier()
            per_model[hf_dir] = {"params": count, "mismatches": mismatches, "layer_spec": chunks_layer_spec(ours)}
    parallel_state.destroy_model_parallel()
    return report


def layout_name(layout_kwargs: Mapping[str, Any]) -> str:
    return "_".join(f"{key}{value}" for key, value in sorted(layout_kwargs.items())) or "tp1"
