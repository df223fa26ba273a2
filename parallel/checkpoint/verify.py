"""Compare any two checkpoints (HF safetensors or megarl Megatron, any saved layout) tensor by
tensor: the checks every conversion runs, usable on their own (``megarl verify``).

Each side is read as a stream of full HF-named tensors (an HF checkpoint from its files, a
Megatron checkpoint from its files through ``parallel.checkpoint.stream``), so the comparison holds at
most one tensor per side in memory; only the logits build the model (megatron's own load at the
verification layout). Reported: configs that differ, tensors
missing on either side, tensors that differ (with their max abs difference), recorded checksums
that no longer match the data, and the max logit difference on the conversion's probe prompt
(``convert.probe_tokens``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parallel.checkpoint.convert import probe_tokens
from parallel.checkpoint.dist_ckpt import METADATA_FILE, load_megatron_checkpoint, read_checkpoint_metadata
from parallel.checkpoint.errors import CheckpointError
from parallel.checkpoint.hf_io import CHECKSUMS_FILE, HFCheckpoint, tensor_checksum
from parallel.checkpoint.stream import read_hf_tensors
from parallel.forward import prompt_logits
from parallel.layout import MegatronLayout
from parallel.models import build_model_chunks
from parallel.shards import hf_tensor_shapes

# config.json fields that describe the file, not the model.
_NOT_MODEL_FIELDS = {"transformers_version", "architectures", "dtype", "torch_dtype", "_name_or_path"}


class _Side:
    """One checkpoint as a stream of HF tensors plus its recorded checksums and config."""

    def __init__(self, path: str, layout: MegatronLayout):
        self.path = Path(path)
        self.is_megatron = (self.path / METADATA_FILE).is_file()
        if self.is_megatron:
            metadata = read_checkpoint_metadata(self.path)
            self.config, self.recorded = metadata["hf_config"], metadata.get("checksums") or {}
            self.layout = layout
        else:
            self.hf = HFCheckpoint(self.path)
            self.config = self.hf.config
            file = self.path / CHECKSUMS_FILE
            self.recorded = json.loads(file.read_text()) if file.is_file() else {}

    def tensors(self):
        if self.is_megatron:  # streamed from the files, one tensor at a time (collective)
            stream = read_hf_tensors(self.path, self.config, self.layout)
            yield from stream if stream is not None else ((name, None) for name in hf_tensor_shapes(self.config))
        else:
            for name in hf_tensor_shapes(self.config):
                yield name, self.hf.read(name) if dist.get_rank() == 0 else None

    def logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Logits on ``tokens`` on the last rank (None elsewhere)."""
        if self.is_megatron:  # megatron's own load into this layout's model
            chunks = build_model_chunks(self.config, self.layout)
            load_megatron_checkpoint(chunks, self.path)
            logits = prompt_logits(chunks, tokens)
            return None if logits is None else logits[..., : self.config["vocab_size"]].float()
        if dist.get_rank() != dist.get_world_size() - 1:
            return None
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=torch.float32).eval()
        with torch.no_grad():
            return model(tokens).logits


def _model_fields(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in _NOT_MODEL_FIELDS}


def verify_pair(path_a: str, path_b: str, layout: MegatronLayout) -> dict[str, Any]:
    """Collective: compare two checkpoints; returns the report (complete on rank 0)."""
    a, b = _Side(path_a, layout), _Side(path_b, layout)
    report: dict[str, Any] = {"config_differences": {}, "different_tensors": {}, "checksum_mismatches": [],
                              "tensors": 0}
    config_a, config_b = _model_fields(a.config), _model_fields(b.config)
    for key in sorted(set(config_a) | set(config_b)):
        if config_a.get(key) != config_b.get(key):
            report["config_differences"][key] = (config_a.get(key), config_b.get(key))
    if report["config_differences"]:
        raise CheckpointError(f"{path_a} and {path_b} are different models: {report['config_differences']}")
    for (name, ta), (_, tb) in zip(a.tensors(), b.tensors()):
        if ta is None:
            continue
        report["tensors"] += 1
        for side, tensor in ((a, ta), (b, tb)):
            if name in side.recorded and side.recorded[name] != tensor_checksum(tensor):
                report["checksum_mismatches"].append(f"{side.path}: {name}")
        if ta.shape != tb.shape or not torch.equal(ta.float(), tb.float()):
            diff = float((ta.float() - tb.float()).abs().max()) if ta.shape == tb.shape else float("inf")
            report["different_tensors"][name] = diff
    tokens = probe_tokens(a.config)  # the conversion's probe prompt (256 positions, or the context)
    la, lb = a.logits(tokens), b.logits(tokens)
    # The last global rank is on the last pipeline stage, where both sides have logits.
    last = dist.get_rank() == dist.get_world_size() - 1
    diff = torch.tensor([float((la - lb).abs().max()) if last else 0.0], dtype=torch.float64)
    dist.all_reduce(diff)
    report["max_logit_diff"] = float(diff)
    report["identical"] = not report["different_tensors"] and not report["checksum_mismatches"]
    return report


def verify_on_rank(path_a: str, path_b: str, layout: MegatronLayout) -> dict[str, Any]:
    """Entry point of one verification rank (torch.distributed initialised)."""
    from megatron.core import parallel_state

    from parallel.process_groups import initialize_megatron

    initialize_megatron(layout)
    try:
        return verify_pair(path_a, path_b, layout)
    finally:
        parallel_state.destroy_model_parallel()
