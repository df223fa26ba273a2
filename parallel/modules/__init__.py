"""Torch modules and functions used inside a Megatron forward pass: context-parallel and
shared-prefix attention, sequence packing, vocab-parallel log-probs and the critic's value head."""
