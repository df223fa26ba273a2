"""The critic's model: megatron's GPTModel with the LM head replaced by a scalar value head.

PPO's critic is the policy's transformer (loaded from the policy's HF causal-LM checkpoint) with
``output_layer`` (hidden -> vocab) replaced by ``ValueHead`` (hidden -> 1, no bias): one value
per token. Everything else (layer spec, TP/PP/VPP/CP/SP, DDP, optimizer, dist checkpoints) is
the policy's machinery unchanged.

Design:

- Tied embeddings: the critic never ties. Its chunks are built from the HF config with
  ``tie_word_embeddings=False``, so GPTModel neither passes the embedding as the output weight
  nor keeps a copy of the embedding on the last pipeline stage (and finalize_model_grads does
  not all-reduce embedding grads between the first and last stage). The lm_head / tied
  embedding is simply not used by the critic; the embedding itself is loaded as usual.
- The head's weight ``[1, hidden]`` is replicated over TP (never split; there is nothing to
  split). Without sequence parallelism every TP rank holds the full hidden states (the last
  row-parallel layer all-reduces them), so each TP rank computes all values, and the head's
  grad and the hidden states' grad are complete and identical on every TP rank: no reduction.
- Sequence parallelism: the hidden states reaching the head are this TP rank's slice of the
  sequence. The head runs on the slice and the [s/tp, b, 1] values (not the [s/tp, b, hidden]
  hidden states: 1/hidden of the traffic and activation memory) are all-gathered with megatron's
  ``gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)``: every TP rank
  holds all values, the loss is computed identically on every TP rank, and the backward keeps
  each rank's slice of the (identical) value gradient. The head's weight grad is then a partial
  sum over this rank's tokens, so the weight is tagged ``sequence_parallel=True``: megatron's
  ``finalize_model_grads`` sums such grads over TP, exactly as it does for the RMSNorm weights
  under sequence parallelism (so any training path that is right for the policy's norms under
  SP is right for the head).
- Dist checkpoints: the head's ShardedTensor is replicated over TP and DP and stored under the
  key ``output_layer.value_head_weight``, not ``output_layer.weight``: loading a policy checkpoint
  into critic chunks (or the reverse) fails on the missing key instead of silently reading one
  row of the lm_head (megatron marks the output layer ``allow_shape_mismatch``).
- Initialisation: a fresh critic's head is drawn from N(0, std^2) with a ``torch.Generator``
  seeded by ``head_seed`` (std = the config's ``initializer_range``, 0.02 for the presets), the
  same full tensor on every rank of every layout. ``head_std=0`` gives the zero head that many
  PPO critics start from (values 0 at step 0); the seeded normal is the default so that values,
  and the tests that compare them, are not trivially zero.

GPTModel still allocates (and initialises) its vocab-sized output layer before it is replaced:
a transient [vocab/tp, hidden] tensor on the last stage at build time, freed right after.
"""

from __future__ import annotations

import torch

HEAD_CHECKPOINT_SUFFIX = "value_head_weight"


class ValueHead(torch.nn.Module):
    """Drop-in replacement for GPTModel.output_layer: hidden states [s, b, h] -> values [s, b, 1].

    Called by GPTModel as ``output_layer(hidden, weight=None, runtime_gather_output=...)`` and
    returns ``(values, None)`` like megatron's ColumnParallelLinear; GPTModel then returns
    ``[b, s, 1]``. Under sequence parallelism the values are gathered over TP (see the module
    docstring); ``sequence_parallel`` is an attribute GPTModel may toggle for inference, as it
    does on its own output layer.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.sequence_parallel = bool(config.sequence_parallel)
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))
        # Replicated over TP (no `tensor_model_parallel` attribute). Under SP each TP rank's grad
        # covers its own tokens only; finalize_model_grads sums grads tagged `sequence_parallel`.
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        # What megatron sets on every output layer (decoupled LR / no-wd groups key on it).
        self.weight.is_embedding_or_output_parameter = True

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if weight is not None:
            raise ValueError("ValueHead got an output weight from GPTModel: the critic must be built with "
                             "share_embeddings_and_output_weights=False (build_value_model_chunks does)")
        values = torch.matmul(hidden_states, self.weight.t())
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """One ShardedTensor, replicated over TP and DP x CP, under a key no policy model has."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
        from megatron.core.utils import make_sharded_tensor_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return {
            f"{prefix}weight": make_sharded_tensor_for_checkpoint(
                self.weight, f"{prefix}{HEAD_CHECKPOINT_SUFFIX}", sharded_offsets,
                tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"],
            )
        }


def values_from_output(output: torch.Tensor) -> torch.Tensor:
    """GPTModel's critic output [b, s, 1] -> values [b, s] (fp32)."""
    if output.dim() != 3 or output.shape[-1] != 1:
        raise ValueError(f"expected critic output [b, s, 1], got {list(output.shape)}: is this a value model?")
    return output.squeeze(-1).float()


