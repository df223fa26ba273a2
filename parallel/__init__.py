"""Layouts, model building, resharding and checkpoint IO for Megatron models; knows bytes, not RL.

Layers inside (imports point downwards only; ``tests/test_architecture.py`` enforces it):

- ``checkpoint/``  HF safetensors IO, Megatron dist checkpoints, streamed conversion, verification
- ``reshard/``     plans that move shards from one layout to another, and their executor
                   (``checkpoint/`` and ``reshard/`` are independent: neither imports the other)
- ``shards``       where every shard lives, as boxes of the HF tensors (both of the above read it)
- ``forward``      forward-only passes at any layout (logits, values)
- ``models``       this rank's model chunks (policy, critic) and layout-independent initialisation
- ``process_groups`` megatron's process groups and RNG seeds for a layout (beside ``models``)
- ``layout``       a Megatron layout and its validation (no torch)
- ``modules/``     torch modules and functions used inside a forward: attention variants, packing,
                   vocab-parallel log-probs, the value head
- ``cpu/``         megatron-core on a CPU: its patches, CPU linears (oneDNN or MKL)

Beside them, on no layer of their own: ``memory`` (closed-form memory per GPU), ``preflight``
(a multi-node allocation check) and ``spawn`` (N local torch.distributed ranks).
"""
