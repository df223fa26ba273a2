"""A tiny Megatron LM training run on N local ranks: the smoke test of the whole Megatron stack."""

from __future__ import annotations

import dataclasses

from megarl.config.schema import OptimSettings
from megarl.data.synthetic import arithmetic_sequence_batches
from megarl.training import build_optimizer, train_step, wrap_ddp
from model_specs.presets import hf_config_dict
from parallel.checkpoint.convert import load_hf_into_chunks
from parallel.checkpoint.hf_io import HFCheckpoint
from parallel.layout import MegatronLayout
from parallel.models import build_model_chunks, init_params_layout_independent
from parallel.process_groups import initialize_megatron


@dataclasses.dataclass
class DemoRun:
    """What to train: a model preset, a layout, and how many steps of which batch shape."""

    preset: str = "tiny-llama"
    layout: MegatronLayout = dataclasses.field(default_factory=MegatronLayout)
    steps: int = 8
    micro_batches: int = 4
    micro_batch_size: int = 2
    seq_length: int = 32
    seed: int = 1234
    loss_mask_prefix: int = 0  # the first N tokens of every sequence carry no loss (like a prompt)
    optim: OptimSettings = dataclasses.field(default_factory=lambda: OptimSettings(lr=1e-2, weight_decay=0.0))
    # Start from this HF checkpoint's weights (its config, not the preset's) instead of the
    # layout-independent random init: the same model at every layout for MoE models too.
    hf_dir: str | None = None


def train_on_rank(run: DemoRun) -> list[dict]:
    """Per-rank body (torch.distributed already initialised): returns per-step metrics."""
    from megatron.core import parallel_state

    ckpt = HFCheckpoint(run.hf_dir) if run.hf_dir else None
    hf_config = ckpt.config if ckpt else hf_config_dict(run.preset)
    run.layout.validate_sequence_length(run.seq_length, field="DemoRun.seq_length")
    initialize_megatron(run.layout, seed=run.seed)
    chunks = build_model_chunks(hf_config, run.layout)
    if ckpt:
        load_hf_into_chunks(chunks, ckpt, run.layout)
    else:
        init_params_layout_independent(chunks, run.seed, hf_config["vocab_size"])
    chunks = wrap_ddp(chunks, run.layout)
    optimizer = build_optimizer(chunks, run.optim, run.layout)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    if run.micro_batches % dp_size:
        raise ValueError(
            f"micro_batches={run.micro_batches} is not divisible by the data-parallel size {dp_size}; "
            "use a multiple of it"
        )
    history = []
    for step in range(run.steps):
        # The same global batch at every layout; each data-parallel rank takes its share (and
        # the context-parallel ranks of a DP rank all get it; the forward step splits it).
        global_batch = arithmetic_sequence_batches(
            hf_config["vocab_size"], run.micro_batches, run.micro_batch_size, run.seq_length,
            seed=run.seed + step,
        )
        for micro_batch in global_batch:
            micro_batch["loss_mask"][:, : run.loss_mask_prefix] = 0
        history.append(train_step(chunks, optimizer, global_batch[dp_rank::dp_size], run.seq_length))
    parallel_state.destroy_model_parallel()
    return history
