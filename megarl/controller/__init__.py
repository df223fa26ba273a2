"""The single controller of a run: one driver process that owns no model weights.

Components, each in its own module, composed by the two trainers:

- ``worker_group``: Ray, the Megatron ranks of each pool, every call to them with a deadline
  (``RunError``, ``gather``)
- ``model_roles``: the ``ModelSpec`` of each Megatron role the run builds
- ``rollout_manager``: the SGLang engines, generation (sync, streaming, partial, multi-turn) and
  the weight sync
- ``placement``: which GPUs of a node each colocated engine uses (``base_gpu_id``)
- ``checkpointer``: atomic checkpoints, resume (damaged-skip, elastic), HF export
- ``step_metrics``: phase times, rewards, lags, throughput, TFLOP/s
- ``dynamic_sampling``: DAPO's refill of a batch with informative groups
- ``run``: what every run has (model, workers, checkpointer) and the step loop
- ``rl`` (``RLTrainer``) and ``sft`` (``SFTTrainer``): the trainers ``megarl train`` and
  ``megarl sft`` run
"""
