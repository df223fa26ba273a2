"""Functions that run on each rank of a multi-process test here (``parallel.spawn.run_on_ranks``
imports them by module path in every rank)."""


import torch
import torch.distributed as dist


def megatron_device_calls():
    """What megatron-style CUDA calls produce on a rank after the CPU layer is applied."""
    a = torch.empty(3, device=torch.cuda.current_device())
    b = torch.zeros(2, device="cuda").cuda()
    c = torch.ones(2).to("cuda:0", non_blocking=True)
    return [str(t.device) for t in (a, b, c)]


def first_step_grad_norm(layout_kwargs, untag_sequence_parallel_norms=False, config_overrides=None):
    """Grad norm of one training step of the tiny model from the layout-independent init, and
    the norm of the RMSNorm weights' gradients alone (replicated across TP, so per-rank)."""
    from megarl.config.schema import OptimSettings
    from megarl.data.synthetic import arithmetic_sequence_batches
    from megarl.training import build_optimizer, train_step, wrap_ddp
    from model_specs.presets import hf_config_dict
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks, init_params_layout_independent
    from parallel.process_groups import initialize_megatron

    layout = MegatronLayout(**layout_kwargs)
    hf = hf_config_dict("tiny-llama")
    initialize_megatron(layout)
    chunks = build_model_chunks(hf, layout, **(config_overrides or {}))
    init_params_layout_independent(chunks, seed=7, vocab_size=hf["vocab_size"])
    if untag_sequence_parallel_norms:
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if "layernorm" in name:
                    param.sequence_parallel = False
    chunks = wrap_ddp(chunks, layout)
    # What this returns are the step's gradients: the grad norm is taken before the update and the
    # update reads the grads without writing them (no clipping under a norm of 1e9, no weight
    # decay), so the learning rate does not enter.
    optimizer = build_optimizer(chunks, OptimSettings(weight_decay=0.0, clip_grad=1e9), layout)
    batches = arithmetic_sequence_batches(hf["vocab_size"], 4, 2, 16, seed=3)
    grad_norm = train_step(chunks, optimizer, batches, 16)["grad_norm"]
    norm_grads = [p.main_grad for c in chunks for n, p in c.module.named_parameters() if "layernorm" in n]
    return {"grad_norm": grad_norm, "norm_grad_norm": float(torch.stack([g.norm() for g in norm_grads]).norm())}


def compat_patches_in_isolation():
    """Exercise each CPU patch (and the local spec's device-agnostic fixes) and report what
    megatron would observe."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from parallel.cpu import compat as cpu_compat
    from parallel.modules import local_spec

    out = {"applied": cpu_compat.apply()}
    local_spec.apply()  # the local spec's SP norm and TE-less MoE router, on every device

    class AllocatesInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad + torch.zeros(grad.shape, device=torch.cuda.current_device())

    x = torch.ones(3, requires_grad=True)
    AllocatesInBackward.apply(x).sum().backward()
    out["backward_grad"] = x.grad.tolist()
    out["pinned"] = torch.empty(2, pin_memory=True).is_pinned()

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda.current_stream().wait_stream(stream)
    event = torch.cuda.Event()
    event.record()
    torch.cuda.synchronize()
    out["runtime"] = (torch.cuda.current_device(), torch.cuda.memory_allocated(), event.query())

    tensor_parallel.random.initialize_rng_tracker(force_reset=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(5)
    tracker.add("model-parallel-rng", 99)
    before = torch.get_rng_state()
    with tracker.fork():
        forked = torch.rand(3)
    out["rng_default_untouched"] = torch.equal(before, torch.get_rng_state())
    out["rng_fork_is_seed_99"] = torch.equal(forked, torch.rand(3, generator=torch.Generator().manual_seed(99)))

    out["types"] = (torch.ones(1).type(), torch.ones(1, dtype=torch.bfloat16).type(),
                    torch.ones(1).type(torch.float64).dtype == torch.float64)

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                               tensor_model_parallel_size=2, sequence_parallel=True)
    norm = WrappedTorchNorm(config, 8)
    out["sp_norm"] = (type(norm).__name__, all(p.sequence_parallel for p in norm.parameters()),
                      config.sequence_parallel)

    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    inputs, weight = torch.randn(3, 8), torch.randn(4, 8)
    out["router_gemm"] = torch.equal(router_gating_linear(inputs, weight, None, torch.float32), inputs @ weight.t())
    return out


def megatron_linear_pair(x, col_weight, col_bias, row_weight, grad_out, frozen):
    """``row(col(x))`` through megatron's ColumnParallelLinear (bias, output kept split) and
    RowParallelLinear (TP = world size, each rank holding its slice of the full weights), then
    the backward of sum(grad_out * output). Returns the output, the input gradient, this rank's
    weight/bias gradient slices and the autograd node names of the two layers' outputs.
    ``frozen``: the column layer's weight and bias need no gradient (megatron's frozen-weight
    path)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    from parallel.layout import MegatronLayout
    from parallel.process_groups import initialize_megatron

    tp, rank = dist.get_world_size(), dist.get_rank()
    initialize_megatron(MegatronLayout(tp=tp))
    config = ModelParallelConfig(tensor_model_parallel_size=tp, params_dtype=torch.float32,
                                 use_cpu_initialization=True)
    out_features, in_features = col_weight.shape
    col = tensor_parallel.ColumnParallelLinear(in_features, out_features, config=config, bias=True,
                                               gather_output=False, init_method=torch.nn.init.zeros_)
    row = tensor_parallel.RowParallelLinear(out_features, in_features, config=config, bias=False,
                                            input_is_parallel=True, skip_bias_add=False,
                                            init_method=torch.nn.init.zeros_)
    local = out_features // tp
    mine = slice(rank * local, (rank + 1) * local)
    with torch.no_grad():
        col.weight.copy_(col_weight[mine])
        col.bias.copy_(col_bias[mine])
        row.weight.copy_(row_weight[:, mine])
    col.weight.requires_grad_(not frozen)
    col.bias.requires_grad_(not frozen)
    x = x.clone().requires_grad_(True)
    hidden, _ = col(x)
    output, _ = row(hidden)
    (output * grad_out).sum().backward()
    parallel_state.destroy_model_parallel()
    row_node = output.grad_fn.next_functions[0][0]  # the all-reduce of the partial sums is last
    return {"output": output.detach(), "x_grad": x.grad, "row_weight_grad": row.weight.grad,
            "col_weight_grad": col.weight.grad, "col_bias_grad": col.bias.grad,
            "nodes": (hidden.grad_fn.name(), row_node.name())}
