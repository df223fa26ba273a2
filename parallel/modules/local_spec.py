"""What megatron-core 0.16's local (non-Transformer-Engine) layer spec needs to run, on any device.

Applied by ``parallel.process_groups.initialize_megatron`` before any model is built, on CPUs and
GPUs alike: without TE (every CPU, and a GPU node where TE does not import) megatron builds the
local spec, whose norms and MoE router have these two gaps whatever the device.

- ``sequence_parallel_norm``: the local spec's ``WrappedTorchNorm`` (megatron's only RMSNorm
  without TE or apex) refuses sequence parallelism. A norm works per token, so it is correct under
  SP as long as its parameters are tagged ``sequence_parallel = True``: megatron then all-reduces
  their gradients over TP, as it does for the fused norms. The patch builds the norm and adds the
  tag; without the tag the norm gradients are wrong (tests/parallel/cpu/test_compat.py checks both).
  MoE at TP > 1 needs SP, so an MoE model without TE needs this on a GPU too.
- ``moe_without_te``: the MoE router GEMM (``moe_utils.router_gating_linear``) tests
  ``te_general_gemm is not None``, a name its module only defines when TE imports; without TE that
  is a NameError. The patch defines it as None, which selects the function's own torch GEMM.
"""

from __future__ import annotations

_APPLIED = False


def apply() -> None:
    """Install both fixes (once per process)."""
    global _APPLIED
    if not _APPLIED:
        _patch_sequence_parallel_norm()
        _patch_moe_without_te()
        _APPLIED = True


def _patch_sequence_parallel_norm() -> None:
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        # Build the same norm with SP switched off for the assert only, then tag the parameters
        # so megatron all-reduces their gradients across the TP group.
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def _patch_moe_without_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
