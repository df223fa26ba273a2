"""Torch modules and functions used inside a Megatron forward pass: the core attentions (SDPA,
context-parallel, shared-prefix), sequence packing, vocab-parallel log-probs and the critic's value head."""
