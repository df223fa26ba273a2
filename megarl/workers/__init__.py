"""Per-rank workers of a run: Megatron models (actor, reference, critic) and rollout engines."""
