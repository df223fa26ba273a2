"""Resharding: ``shards`` describes where every shard of every parameter lives (Megatron TP/PP/VPP,
SGLang TP) as boxes of the HF tensors; ``plan`` intersects two such descriptions into the copies
that move weights from one layout to another, checks them, and executes them in place;
``transport`` hands a rank's resharded tensors to an SGLang engine rank in another process (bytes
inline, or named in shared memory)."""
