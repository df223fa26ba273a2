"""SGLang's engine on a CPU: ``stubs`` stand in for the CUDA-only modules SGLang imports, and the
CPU path's slow spots are replaced: ``batched_attention`` (the torch-native attention backend),
``inverse_cdf_sampling`` (the pytorch sampler), ``linear`` (unquantized linears through
:mod:`parallel.cpu.linear`). Installed in the engine's processes by
:func:`megarl.rollout.sglang.patches.install_scheduler_patch`; see docs/cpu.md."""
