"""Module-level functions run on spawned ranks by the tests (spawn needs importable targets)."""

import os
import subprocess
import time

import psutil
import torch
import torch.distributed as dist


def all_reduce_rank(scale):
    """Sum of (rank+1)*scale over all ranks, plus who this rank is and the caller's marker variable."""
    value = torch.tensor([float(dist.get_rank() + 1) * scale])
    dist.all_reduce(value)
    return {"rank": dist.get_rank(), "sum": float(value), "threads": torch.get_num_threads(),
            "marker": os.environ.get("MEGARL_TEST_MARKER")}


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank one")
    dist.barrier()  # rank 0 waits for a peer that never comes: the harness must not hang
    return "unreachable"


def start_grandchild_then_hang(pid_file):
    """Start a helper process (like the dist-checkpoint writer), record its pid, then hang."""
    child = subprocess.Popen(["sleep", "600"])
    with open(f"{pid_file}.{os.getpid()}", "w") as handle:
        handle.write(str(child.pid))
    time.sleep(600)


def megatron_device_calls():
    """What megatron-style CUDA calls produce on a rank after the CPU layer is applied."""
    a = torch.empty(3, device=torch.cuda.current_device())
    b = torch.zeros(2, device="cuda").cuda()
    c = torch.ones(2).to("cuda:0", non_blocking=True)
    return [str(t.device) for t in (a, b, c)]


def first_step_grad_norm(layout_kwargs, untag_sequence_parallel_norms=False, config_overrides=None):
    """Grad norm of one training step of the tiny model from the layout-independent init, and
    the norm of the RMSNorm weights' gradients alone (replicated across TP, so per-rank)."""
    from megarl.data.synthetic import arithmetic_sequence_batches
    from megarl.training import OptimConfig, build_optimizer, train_step, wrap_ddp
    from model_specs.presets import hf_config_dict
    from parallel.layout import MegatronLayout, initialize_megatron
    from parallel.models import build_model_chunks, init_params_layout_independent

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
    optimizer = build_optimizer(chunks, OptimConfig(lr=0.0, clip_grad=1e9), layout)
    batches = arithmetic_sequence_batches(hf["vocab_size"], 4, 2, 16, seed=3)
    grad_norm = train_step(chunks, optimizer, batches, 16)["grad_norm"]
    norm_grads = [p.main_grad for c in chunks for n, p in c.module.named_parameters() if "layernorm" in n]
    return {"grad_norm": grad_norm, "norm_grad_norm": float(torch.stack([g.norm() for g in norm_grads]).norm())}


def compat_patches_in_isolation():
    """Exercise each CPU patch and report what megatron would observe."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from parallel.cpu import compat as cpu_compat

    out = {"applied": cpu_compat.apply()}

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
    return out


def convert_roundtrip(jobs, layout_kwargs, tokens):
    """For each (hf_dir, export_dir): HF -> Megatron (this rank's shards) -> logits on ``tokens``
    -> HF export at ``export_dir``. Returns the logits per job (last pipeline stage, else None)."""
    from megatron.core import parallel_state

    from parallel.checkpoint.convert import export_hf_checkpoint, load_hf_into_chunks
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.forward import megatron_logits
    from parallel.layout import MegatronLayout, initialize_megatron
    from parallel.models import build_model_chunks

    layout = MegatronLayout(**layout_kwargs)
    initialize_megatron(layout)
    results = []
    for hf_dir, export_dir in jobs:
        ckpt = HFCheckpoint(hf_dir)
        chunks = build_model_chunks(ckpt.config, layout)
        for chunk in chunks:
            chunk.eval()
        load_hf_into_chunks(chunks, ckpt, layout)
        logits = megatron_logits(chunks, tokens)
        export_hf_checkpoint(chunks, ckpt.config, layout, export_dir)
        results.append(None if logits is None else logits[..., : ckpt.config["vocab_size"]])
    parallel_state.destroy_model_parallel()
    return results


def checkpoint_logits(hf_dir, ckpt_dir, layout_kwargs, tokens):
    """Load weights (from HF if ``hf_dir`` else from the Megatron checkpoint ``ckpt_dir``) at a
    layout, save them to ``ckpt_dir`` when coming from HF, and return the logits on ``tokens``."""
    from megatron.core import parallel_state

    from parallel.checkpoint.convert import load_hf_into_chunks
    from parallel.checkpoint.dist_ckpt import load_megatron_checkpoint, read_checkpoint_metadata, save_megatron_checkpoint
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.forward import megatron_logits
    from parallel.layout import MegatronLayout, initialize_megatron
    from parallel.models import build_model_chunks

    layout = MegatronLayout(**layout_kwargs)
    initialize_megatron(layout)
    if hf_dir:
        ckpt = HFCheckpoint(hf_dir)
        chunks = build_model_chunks(ckpt.config, layout)
        load_hf_into_chunks(chunks, ckpt, layout)
        save_megatron_checkpoint(chunks, ckpt_dir, ckpt.config, layout)
        helpers = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
        assert helpers == [], f"the save left helper processes (they would outlive a SIGKILLed saver): {helpers}"
    else:
        chunks = build_model_chunks(read_checkpoint_metadata(ckpt_dir)["hf_config"], layout)
        load_megatron_checkpoint(chunks, ckpt_dir)
    logits = megatron_logits(chunks, tokens)
    parallel_state.destroy_model_parallel()
    return logits


def reshard_megatron_to_sglang(hf_dir, layout_kwargs, rollout_tp, bucket_bytes):
    """Load HF weights into real Megatron chunks at a layout, run this rank's part of the
    Megatron -> SGLang plan over gloo, and return (this device's SGLang tensors, traffic stats)."""
    from megatron.core import parallel_state

    from parallel.checkpoint.convert import load_hf_into_chunks
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.layout import MegatronLayout, initialize_megatron
    from parallel.models import build_model_chunks
    from parallel.reshard.plan import execute_plan, plan_megatron_to_sglang

    layout = MegatronLayout(**layout_kwargs)
    ckpt = HFCheckpoint(hf_dir)
    initialize_megatron(layout)
    chunks = build_model_chunks(ckpt.config, layout)
    load_hf_into_chunks(chunks, ckpt, layout)
    plan = plan_megatron_to_sglang(ckpt.config, layout, dist.get_world_size(), rollout_tp)
    plan.check()
    device = dist.get_rank()
    sources = {(i, name): p.data for i, chunk in enumerate(chunks) for name, p in chunk.named_parameters()}
    buffers = {name: torch.full(t.shape, float("nan")) for name, t in plan.destinations.get(device, {}).items()}
    stats = execute_plan(plan, device, sources, buffers, bucket_bytes=bucket_bytes)
    parallel_state.destroy_model_parallel()
    return buffers, stats, plan.network_bytes


def train_one_step_then_reshard(hf_dir, layout_kwargs, rollout_tps, export_dir):
    """A Megatron actor loads an HF checkpoint, trains one optimizer step, exports the trained
    weights as HF (rank 0) and reshards them for SGLang engines of each TP in ``rollout_tps``.
    Returns {rollout_tp: this device's SGLang buffers}."""
    from megatron.core import parallel_state

    from megarl.data.synthetic import arithmetic_sequence_batches
    from megarl.training import OptimConfig, build_optimizer, train_step, wrap_ddp
    from parallel.checkpoint.convert import export_hf_checkpoint, load_hf_into_chunks
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.layout import MegatronLayout, initialize_megatron
    from parallel.models import build_model_chunks
    from parallel.reshard.plan import execute_plan, plan_megatron_to_sglang

    layout = MegatronLayout(**layout_kwargs)
    ckpt = HFCheckpoint(hf_dir)
    initialize_megatron(layout)
    chunks = build_model_chunks(ckpt.config, layout)
    load_hf_into_chunks(chunks, ckpt, layout)
    chunks = wrap_ddp(chunks, layout)
    optimizer = build_optimizer(chunks, OptimConfig(lr=1e-2), layout)
    batches = arithmetic_sequence_batches(ckpt.config["vocab_size"], 2, 2, 16, seed=9)
    train_step(chunks, optimizer, batches, 16)
    export_hf_checkpoint(chunks, ckpt.config, layout, export_dir)
    device = dist.get_rank()
    sources = {(i, name): p.data for i, chunk in enumerate(chunks) for name, p in chunk.module.named_parameters()}
    buffers = {}
    for rollout_tp in rollout_tps:
        plan = plan_megatron_to_sglang(ckpt.config, layout, dist.get_world_size(), rollout_tp)
        plan.check()
        mine = {name: torch.empty(t.shape) for name, t in plan.destinations.get(device, {}).items()}
        execute_plan(plan, device, sources, mine)
        buffers[rollout_tp] = mine
    parallel_state.destroy_model_parallel()
    return buffers


def _row_logits(chunk, inputs, local_positions, seq_length):
    """Full-vocab (padded) logits [1, seq_length, vocab] of one row through megatron's forward-only
    schedule (one chunk per stage), gathered over TP and CP; None off the last pipeline stage."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from parallel.modules.context_parallel import undo_context_parallel_split

    collected = []

    def forward_step(data_iterator, model):
        output = model(**next(data_iterator))

        def keep(output_tensor):
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(output_tensor)
            collected.append(undo_context_parallel_split(logits, local_positions.unsqueeze(0)))
            return output_tensor.sum() * 0.0, {}

        return output, keep

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([inputs]), model=chunk,
                                num_microbatches=1, seq_length=seq_length, micro_batch_size=1, forward_only=True)
    return collected[0].detach() if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None


def _next_token_logprobs(logits, labels, vocab_size):
    return torch.log_softmax(logits[..., :vocab_size].float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def packed_logprobs(layouts, lengths, seed):
    """Per layout: each sequence's next-token log-probs from ONE packed row ("packed"), from the
    same row without packed_seq_params ("control", CP=1 only), and, at TP=PP=CP=1, from each
    sequence run alone through megatron's own local attention ("alone", the oracle). None off the
    last pipeline stage."""
    from megatron.core import parallel_state

    from model_specs.presets import hf_config_dict
    from parallel.layout import MegatronLayout, initialize_megatron
    from parallel.models import build_model_chunks, init_params_layout_independent
    from parallel.modules.packing import pack_sequences, unpack

    hf = hf_config_dict("tiny-qwen2")
    vocab = hf["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]
    results = []
    for layout_kwargs in layouts:
        layout = MegatronLayout(**layout_kwargs)
        initialize_megatron(layout)

        def model(packed_sequences):
            (chunk,) = build_model_chunks(hf, layout, packed_sequences=packed_sequences)
            init_params_layout_independent([chunk], seed=7, vocab_size=vocab)
            return chunk.eval()

        chunk = model(packed_sequences=True)
        batch = pack_sequences(sequences, pad_to_multiple=layout.sequence_length_multiple())
        labels, _ = batch.next_token_targets()
        row = batch.tokens.shape[1]

        def per_sequence(logits):
            if logits is None:
                return None
            return [lp[: n - 1] for lp, n in zip(unpack(_next_token_logprobs(logits, labels, vocab), batch), lengths)]

        result = {"layout": layout_kwargs, "packed": per_sequence(_row_logits(chunk, batch.model_inputs(),
                                                                              batch.local_positions(), row))}
        if layout.cp == 1:
            plain = dict(input_ids=batch.tokens, position_ids=batch.position_ids, attention_mask=None)
            result["control"] = per_sequence(_row_logits(chunk, plain, torch.arange(row), row))
        if layout == MegatronLayout():
            reference = model(packed_sequences=False)
            alone = []
            for tokens in sequences:
                inputs = dict(input_ids=tokens[None], position_ids=torch.arange(len(tokens))[None], attention_mask=None)
                logits = _row_logits(reference, inputs, torch.arange(len(tokens)), len(tokens))
                alone.append(None if logits is None else _next_token_logprobs(logits, tokens[1:][None], vocab)[0])
            result["alone"] = alone
        results.append(result)
        parallel_state.destroy_model_parallel()
    return results


def packed_loss_grads(lengths, seed):
    """TP=1: gradients of a weighted next-token log-prob loss on ONE packed row and of the sum of
    the same losses on each sequence alone (megatron's own attention), for two parameters."""
    from megatron.core import parallel_state

    from model_specs.presets import hf_config_dict
    from parallel.layout import MegatronLayout, initialize_megatron
    from parallel.models import build_model_chunks, init_params_layout_independent
    from parallel.modules.packing import pack_sequences, unpack

    hf = hf_config_dict("tiny-qwen2")
    vocab = hf["vocab_size"]
    initialize_megatron(MegatronLayout())
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]
    weights = [torch.rand(n - 1, generator=generator) for n in lengths]
    names = ("embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight")

    def grads(packed_sequences):
        (chunk,) = build_model_chunks(hf, MegatronLayout(), packed_sequences=packed_sequences)
        init_params_layout_independent([chunk], seed=7, vocab_size=vocab)
        if packed_sequences:
            batch = pack_sequences(sequences, pad_to_multiple=4)
            labels, _ = batch.next_token_targets()
            logprobs = unpack(_next_token_logprobs(chunk(**batch.model_inputs()), labels, vocab), batch)
            loss = sum((lp[: len(w)] * w).sum() for lp, w in zip(logprobs, weights))
        else:
            loss = 0.0
            for tokens, w in zip(sequences, weights):
                logits = chunk(tokens[None], torch.arange(len(tokens))[None], None)
                loss = loss + (_next_token_logprobs(logits, tokens[1:][None], vocab)[0] * w).sum()
        loss.backward()
        params = dict(chunk.named_parameters())
        return float(loss), {name: params[name].grad.clone() for name in names}

    result = {"packed": grads(True), "separate": grads(False)}
    parallel_state.destroy_model_parallel()
    return result


def worker_logprobs_and_updates(hf_dir, layout_kwargs, batch, steps, lr, micro_batch_size, batching=None):
    """A MegatronWorker (actor + reference) at a layout: the reference's log-probs/entropy of
    ``batch``, then ``steps`` PPO updates of the actor on it and the actor's log-probs after.
    ``batching``: MicroBatching options, e.g. {"packed": True} (thd rows) or {"shared_prompts": True}."""
    from megarl.config.schema import OptimSettings
    from megarl.workers.batch import MicroBatching, response_mask
    from megarl.workers.megatron_worker import LossSettings, MegatronWorker, ModelSpec
    from parallel.layout import MegatronLayout

    layout = MegatronLayout(**layout_kwargs)
    worker = MegatronWorker()
    batching = MicroBatching(micro_batch_size=micro_batch_size, **(batching or {}))
    loss = LossSettings(loss_agg_mode="seq-mean-token-mean", entropy_coef=0.01, kl_coef=0.1)
    worker.setup(ModelSpec("ref", hf_dir, layout, batching), seed=7)
    worker.setup(ModelSpec("actor", hf_dir, layout, batching, OptimSettings(lr=lr, weight_decay=0.0),
                           total_optimizer_steps=steps, loss=loss), seed=7)
    ref = worker.forward("ref", batch, with_entropy=True)
    mask = response_mask(batch)
    counts = {"tokens": float(mask.sum()), "sequences": float((mask.sum(-1) > 0).sum())}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ref)  # what the controller does: collect the output ranks'
    parts = [part for part in everyone if part is not None]
    order = torch.cat([part["rows"] for part in parts]).argsort()
    batch = dict(batch, ref_logp=torch.cat([part["logp"] for part in parts])[order])
    metrics = []
    for _ in range(steps):
        metrics.append(worker.update("actor", batch, counts))
    after = worker.forward("actor", batch)
    worker.shutdown()
    return {"ref": ref, "metrics": metrics, "after": after}


def worker_reward_values(rm_dir, layout_kwargs, batch, micro_batch_size, batching=None):
    """A MegatronWorker running a reward model at a layout: its per-response-token values of
    ``batch`` (the score of a sample is the value at its last token); ``batching`` as above."""
    from megarl.workers.batch import MicroBatching
    from megarl.workers.megatron_worker import MegatronWorker, ModelSpec
    from parallel.layout import MegatronLayout

    worker = MegatronWorker()
    worker.setup(ModelSpec("reward_model", rm_dir, MegatronLayout(**layout_kwargs),
                           MicroBatching(micro_batch_size=micro_batch_size, **(batching or {}))), seed=7)
    values = worker.forward("reward_model", batch)
    worker.shutdown()
    return {"scores": values}


def packed_oracle_tp1(lengths, seed):
    """The single-rank checks in one process (megatron's import dominates a rank's start-up)."""
    return {"logprobs": packed_logprobs([{}], lengths, seed)[0], "grads": packed_loss_grads(lengths, seed + 1)}


def vocab_parallel_slice_outputs(logits, targets, vocab_size, grad_logp, grad_entropy):
    """This TP rank's slice of full ``logits`` through ``vocab_parallel_log_probs`` (TP = world
    size): log-probs, entropy, and the gradient of sum(grad_logp * logp + grad_entropy * H)
    with respect to the slice."""
    from megatron.core import parallel_state

    from parallel.layout import MegatronLayout, initialize_megatron
    from parallel.modules.vocab_parallel import vocab_parallel_log_probs

    initialize_megatron(MegatronLayout(tp=dist.get_world_size()))
    local = logits.shape[-1] // dist.get_world_size()
    mine = logits[..., dist.get_rank() * local:(dist.get_rank() + 1) * local].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_log_probs(mine, targets, vocab_size)
    ((logp * grad_logp).sum() + (entropy * grad_entropy).sum()).backward()
    parallel_state.destroy_model_parallel()
    return {"logp": logp.detach(), "entropy": entropy.detach(), "grad": mine.grad}


def megatron_linear_pair(x, col_weight, col_bias, row_weight, grad_out, frozen):
    """``row(col(x))`` through megatron's ColumnParallelLinear (bias, output kept split) and
    RowParallelLinear (TP = world size, each rank holding its slice of the full weights), then
    the backward of sum(grad_out * output). Returns the output, the input gradient, this rank's
    weight/bias gradient slices and the autograd node names of the two layers' outputs.
    ``frozen``: the column layer's weight and bias need no gradient (megatron's frozen-weight
    path)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    from parallel.layout import MegatronLayout, initialize_megatron

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
