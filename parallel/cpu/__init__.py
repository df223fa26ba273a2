"""megatron-core on a CPU, what exists only because there is no GPU: ``compat`` maps megatron-core's
CUDA-only calls to the CPU (gloo), ``linear`` runs fp32 linears through oneDNN or MKL (the faster
here). Nothing here is applied when a CUDA device is present. (SGLang on a CPU is
``megarl.rollout.sglang.cpu``.)"""
