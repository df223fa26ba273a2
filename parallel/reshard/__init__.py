"""Resharding, from Megatron's layout to SGLang's: ``plan`` intersects two descriptions of where
every shard lives (``parallel.shards``) into the copies that move weights from one layout to
another and checks them; ``execute`` runs a plan's copies in place, locally and over
torch.distributed. How the resharded tensors then reach an engine rank is
``megarl.rollout.sglang.transport``."""
