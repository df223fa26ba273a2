"""Forward-only passes of a model at any TP/PP/VPP/CP layout: logits and values in global token
order on the last pipeline stage, through megatron's own schedule (the conversion's logit probe,
the layout tests and the critic's checks use them)."""

from __future__ import annotations

from typing import Callable

import torch

from parallel.models import unwrap_model
from parallel.modules.context_parallel import split_for_context_parallel, undo_context_parallel_split
from parallel.modules.value_head import values_from_output


def prompt_logits(chunks: list, prompt: torch.Tensor) -> torch.Tensor | None:
    """Logits [1, seq, vocab] of one prompt ([1, seq]) at any layout (last pipeline stage, else
    None): the interleaved schedule needs one micro-batch per pipeline stage, so the prompt is
    repeated that many times and the first copy kept."""
    from megatron.core import parallel_state

    copies = parallel_state.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1
    logits = megatron_logits(chunks, prompt.expand(copies, -1).contiguous())
    return None if logits is None else logits[:1]



def forward_only_outputs(chunks: list, tokens: torch.Tensor, keep: Callable, what: str = "sequences") -> torch.Tensor | None:
    """``keep(output_tensor, local_position_ids)`` of every micro-batch of ``tokens`` through
    megatron's forward-only schedule at any TP/PP/VPP/CP layout, concatenated over the batch on
    the last pipeline stage (None elsewhere)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    collected = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        positions = torch.arange(batch.shape[1], device=batch.device).unsqueeze(0).expand_as(batch)
        local = split_for_context_parallel({"tokens": batch, "position_ids": positions})
        output = model(local["tokens"], local["position_ids"], attention_mask=None)

        def collect(output_tensor):
            collected.append(keep(output_tensor, local["position_ids"]))
            return output_tensor.sum() * 0.0, {}

        return output, collect

    # The interleaved schedule needs at least PP micro-batches: split the batch into PP of them.
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    num_micro = pp if len(chunks) > 1 else 1
    if tokens.shape[0] % num_micro:
        raise ValueError(f"batch of {tokens.shape[0]} {what} cannot be split into {num_micro} micro-batches "
                         f"(interleaved pipeline needs PP={pp}); use a multiple of {num_micro}")
    micro_batches = list(tokens.chunk(num_micro))
    iterators = [iter(micro_batches) for _ in chunks]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_micro, seq_length=tokens.shape[1], micro_batch_size=micro_batches[0].shape[0],
        forward_only=True,
    )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat(collected).detach()



def megatron_logits(chunks: list, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab (padded) logits [batch, seq, vocab] of ``tokens`` through megatron's forward-only
    schedule at any TP/PP/VPP/CP layout; returned on the last pipeline stage, None elsewhere."""
    from megatron.core import tensor_parallel

    def keep(output_tensor, positions):
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(output_tensor)
        return undo_context_parallel_split(logits, positions)

    return forward_only_outputs(chunks, tokens, keep, what="prompts")


def megatron_values(chunks: list, tokens: torch.Tensor) -> torch.Tensor | None:
    """Values [batch, seq] (fp32) of ``tokens`` through megatron's forward-only schedule at any
    TP/PP/VPP/CP/SP layout; returned on the last pipeline stage (every TP/CP rank), None elsewhere.
    With VPP the batch must split into PP micro-batches (as in ``megatron_logits``)."""
    def keep(output_tensor, positions):
        return values_from_output(undo_context_parallel_split(output_tensor, positions))

    was_training = [unwrap_model(c).training for c in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        return forward_only_outputs(chunks, tokens, keep)
    finally:
        for chunk, training in zip(chunks, was_training):
            chunk.train(training)
