"""What exists only because there is no GPU: ``compat`` maps megatron-core's CUDA-only calls to the
CPU (gloo), ``linear`` runs fp32 linears through oneDNN or MKL (the faster here), ``sglang_stubs`` stands in for the CUDA-only
modules SGLang imports. Nothing here is applied when a CUDA device is present."""
