"""Synthetic token data made locally (no downloads) for smoke runs, tests and benchmarks."""

from __future__ import annotations

import torch


def arithmetic_sequence_batches(
    vocab_size: int, num_micro_batches: int, micro_batch_size: int, seq_length: int, seed: int
) -> list[dict]:
    """Micro-batches of token sequences t_i = (start + i * step) mod vocab_size.

    Each sequence's next token is a simple function of the two before it, so a model learns the
    task within a few optimizer steps: a clear, deterministic signal that training works.
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    positions = torch.arange(seq_length + 1)
    for _ in range(num_micro_batches):
        start = torch.randint(0, vocab_size, (micro_batch_size, 1), generator=generator)
        step = torch.randint(1, 3, (micro_batch_size, 1), generator=generator)
        sequence = (start + step * positions) % vocab_size
        batches.append(
            {
                "tokens": sequence[:, :-1].contiguous(),
                "labels": sequence[:, 1:].contiguous(),
                "loss_mask": torch.ones(micro_batch_size, seq_length),
            }
        )
    return batches
