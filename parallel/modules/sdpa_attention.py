"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` for megatron's local spec.

megatron's local ``DotProductAttention`` materialises the [b, heads/tp, s, s] score matrix and
keeps its softmax for the backward: memory quadratic in the sequence per layer. ``SDPAttention``
has its constructor and forward signature (so it drops into the layer spec's ``core_attention``
slot, ``parallel.models.transformer_layer_spec``'s default for plain rows) and computes the same function with
PyTorch's fused attention: on CUDA the flash (or cuDNN) kernel for causal attention, whose memory
is linear in the sequence, or the memory-efficient one when a mask is given (it keeps the mask as
a bias, not a score matrix per head); on CPU the math kernel.

Same semantics as DotProductAttention: with no ``attention_mask`` a causal ``attn_mask_type`` gives
the causal mask and any other gives none; a given mask (bool, True = masked out, broadcastable to
[b, heads, sq, sk]) is used alone, as megatron does. One difference: a query whose keys are all
masked gets a zero context here (SDPA) and the mean of all values there (megatron fills -10000);
such a query is padding, and both give it no gradient. Context parallelism, packed sequences,
attention biases, sliding windows and softmax variants are refused (transformer_layer_spec picks
``parallel.modules.context_parallel.ContextParallelAttention`` for CP and packed rows).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.module import MegatronModule


class SDPAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron's local spec: DotProductAttention's function on
    ``scaled_dot_product_attention`` (GQA without copies, no score matrix on CUDA)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        from megatron.core.transformer.utils import is_layer_window_attention

        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(f"SDPAttention: context_parallel_size={config.context_parallel_size}; it attends whole "
                             "sequences only. parallel.models.transformer_layer_spec builds ContextParallelAttention at cp > 1")
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"SDPAttention: softmax_type={config.softmax_type!r} is not supported; "
                                      "use softmax_type='vanilla'")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError(f"SDPAttention: no sliding-window attention (window_size={config.window_size}); "
                                      "set window_size=None")
        self.config = config
        self.attn_mask_type = attn_mask_type
        # DotProductAttention's default; apply_query_key_layer_scaling divides the scale and multiplies
        # the scores back before the softmax (a no-op in exact arithmetic), so it is left out.
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """q [sq, b, np, hn], k/v [sk, b, ng, hn] (np a multiple of ng) -> context [sq, b, np*hn]."""
        from megatron.core.transformer.enums import AttnMaskType
        from torch.nn.functional import scaled_dot_product_attention

        if packed_seq_params is not None:
            raise NotImplementedError("SDPAttention: packed_seq_params (thd rows) are not supported; build the model "
                                      "with packed_sequences=True (ContextParallelAttention)")
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention: attention_bias is not supported (DotProductAttention refuses it too)")
        sq, batch, heads, _ = query.shape
        sk, groups = key.shape[0], key.shape[2]
        causal = attention_mask is None and self.attn_mask_type == AttnMaskType.causal and sq > 1
        if causal and sq != sk:
            raise ValueError(f"SDPAttention: the causal mask is for self-attention; got {sq} queries and {sk} keys")
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise ValueError(f"SDPAttention: attention_mask must be bool (True = masked out, megatron's convention), "
                             f"got {attention_mask.dtype}")
        dropout_p = self.dropout_p if self.training else 0.0
        # [s, b, n, hn] -> [b, n, s, hn]: views; SDPA reads them in place
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        with self.dropout_rng(dropout_p):
            context = scaled_dot_product_attention(
                q, k, v, attn_mask=None if attention_mask is None else ~attention_mask, dropout_p=dropout_p,
                is_causal=causal, scale=self.softmax_scale, enable_gqa=groups != heads)
        return context.permute(2, 0, 1, 3).reshape(sq, batch, -1)

    def dropout_rng(self, dropout_p: float):
        """Where attention dropout draws its randoms: megatron's model-parallel RNG (a fork of the
        tracker) without sequence parallelism, as DotProductAttention does; else the default one."""
        from megatron.core import tensor_parallel

        if dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()
