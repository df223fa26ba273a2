"""Prompt datasets, synthetic tasks and micro-batching.

* ``synthetic``: token sequences made locally for smoke runs and benchmarks.
* ``io``: read/write prompt rows as JSON lines or parquet; dotted field access.
* ``dataset``: ``PromptDataset`` (files -> templated, tokenised, length-filtered prompts) and
  ``PromptLoader`` (per-epoch shuffled batches with a resumable ``(epoch, index)`` position).
* ``micro_batching``: ``balanced_micro_batches``, token-budget micro-batches balanced across
  data-parallel ranks.
* ``prepare``: GSM8K / MATH / synthetic-arithmetic files into the prompt format
  (the logic behind ``tools/prepare_data.py``).
"""
