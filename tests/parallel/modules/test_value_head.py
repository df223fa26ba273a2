"""The critic's model (GPTModel + ValueHead) against HF transformers, at every layout.

Oracle: HF transformers' causal LM of the same checkpoint; its last hidden state (after the final
norm) times the head's weight must equal the critic's values (fp32, atol 1e-5), and the
gradients of sum(values * w) (random per-token w) with respect to the head, the embedding, the
final norm and two transformer weights (one on each pipeline stage) must equal HF's autograd
gradients, gathered over TP, after megatron's own schedule, DDP and finalize_model_grads. Models:
a tied one (qwen2, with qkv bias; 2 KV heads so TP=2 is possible) and an untied one (llama).

The rank functions live here (spawn needs importable, module-level targets).
"""

import pytest
import torch

from parallel.spawn import run_on_ranks

# Layouts of one world size run in turn on the same ranks (one launch per world size: starting
# ranks and importing megatron costs far more than the tiny models' work).
LAYOUTS = {
    "tp1": ({}, 1),
    "tp2": ({"tp": 2}, 2),
    "pp2": ({"pp": 2}, 2),
    "tp2_sp": ({"tp": 2, "sequence_parallel": True}, 2),
    "pp2_vpp2": ({"pp": 2, "vpp": 2}, 2),
    "cp2": ({"cp": 2}, 2),
}
MODELS = {  # name -> (preset, overrides); both have hidden 64, 4 layers
    "tiny-qwen2-kv2": ("tiny-qwen2", {"num_key_value_heads": 2}),  # tied embeddings
    "tiny-llama": ("tiny-llama", {}),  # untied, vocab 200 (padded)
}
HEAD_SEED = 5
TOKENS = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
LOSS_WEIGHTS = torch.randn(2, 12, generator=torch.Generator().manual_seed(1))
# megatron global name -> HF name (None: the value head, a leaf of the oracle's graph)
GRAD_PARAMS = {
    "output_layer.weight": None,
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.layers.0.self_attention.linear_proj.weight": "model.layers.0.self_attn.o_proj.weight",  # row, stage 0
    "decoder.layers.3.mlp.linear_fc2.weight": "model.layers.3.mlp.down_proj.weight",  # row, last stage
}


def expected_head(hidden_size, std=0.02, seed=HEAD_SEED):
    return torch.randn((1, hidden_size), generator=torch.Generator().manual_seed(seed)) * std


# ----------------------------------------------------------------------------- rank functions


def _full_grads(chunks, vocab_size):
    """{global name: full (TP-gathered) fp32 grad} of the GRAD_PARAMS this rank holds."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from parallel.models import global_param_name, unwrap_model

    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    grads = {}
    for chunk in chunks:
        model = unwrap_model(chunk)
        for name, param in model.named_parameters():
            key = global_param_name(model, name)
            if key not in GRAD_PARAMS:
                continue
            grad = param.main_grad.detach().float()
            if getattr(param, "tensor_model_parallel", False) and tp > 1:
                parts = [torch.empty_like(grad) for _ in range(tp)]
                dist.all_gather(parts, grad.contiguous(), group=group)
                grad = torch.cat(parts, dim=param.partition_dim)
            if key.startswith("embedding."):
                grad = grad[:vocab_size]
            grads[key] = grad
    return grads


def _value_grads(chunks, layout, vocab_size):
    """One forward/backward of sum(values * LOSS_WEIGHTS) through megatron's schedule on
    DDP-wrapped chunks (finalize_model_grads included); returns the full grads this rank holds."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.training import wrap_ddp
    from parallel.modules.context_parallel import split_for_context_parallel
    from parallel.modules.value_head import values_from_output

    chunks = wrap_ddp(chunks, layout)
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
    for chunk in chunks:
        chunk.zero_grad_buffer()
    # The interleaved schedule needs PP micro-batches; the schedule divides each micro-batch's
    # loss by their number, which the loss multiplies back (the oracle's loss is a plain sum).
    num_micro = layout.pp if len(chunks) > 1 else 1

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        positions = torch.arange(batch["tokens"].shape[1]).unsqueeze(0).expand_as(batch["tokens"])
        local = split_for_context_parallel({**batch, "position_ids": positions})
        output = model(local["tokens"], local["position_ids"], attention_mask=None)

        def loss(output_tensor):
            return (values_from_output(output_tensor) * local["weights"]).sum() * num_micro, {}

        return output, loss

    batches = [{"tokens": t, "weights": w} for t, w in zip(TOKENS.chunk(num_micro), LOSS_WEIGHTS.chunk(num_micro))]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_micro, seq_length=TOKENS.shape[1], micro_batch_size=batches[0]["tokens"].shape[0],
        forward_only=False,
    )
    return _full_grads(chunks, vocab_size)


def critic_on_rank(hf_dirs, layouts, ckpt_root):
    """For each named layout (in turn, on the same ranks) and HF checkpoint: the critic's values,
    head weight and grads. At tp1 also the values with a different head (the negative control);
    at tp2_sp a dist checkpoint round trip and a policy checkpoint refused by critic chunks."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed.checkpoint.api import CheckpointException

    from parallel.checkpoint.convert import load_hf_into_chunks, load_hf_into_value_chunks
    from parallel.checkpoint.dist_ckpt import load_megatron_checkpoint, save_megatron_checkpoint
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.forward import megatron_values
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks, build_value_model_chunks, init_value_head, value_heads
    from parallel.process_groups import initialize_megatron

    per_layout = {}
    for layout_name in layouts:
        layout = MegatronLayout(**LAYOUTS[layout_name][0])
        initialize_megatron(layout)
        results = []
        for index, hf_dir in enumerate(hf_dirs):
            ckpt = HFCheckpoint(hf_dir)
            chunks = build_value_model_chunks(ckpt.config, layout)
            load_hf_into_value_chunks(chunks, ckpt, layout, head_seed=HEAD_SEED)
            heads = value_heads(chunks)
            result = {
                "values": megatron_values(chunks, TOKENS),
                "head": heads[0].weight.detach().clone() if heads else None,
                "head_params": sorted(n for c in chunks for n, _ in c.named_parameters() if n.startswith("output_layer")),
            }
            if layout_name == "tp1":
                init_value_head(chunks, seed=HEAD_SEED + 1)
                result["values_other_head"] = megatron_values(chunks, TOKENS)
                init_value_head(chunks, seed=HEAD_SEED)
            if layout_name == "tp2_sp" and index == 0:
                target = f"{ckpt_root}/critic"
                save_megatron_checkpoint(chunks, target, ckpt.config, layout)
                fresh = build_value_model_chunks(ckpt.config, layout, head_seed=HEAD_SEED + 7)
                load_megatron_checkpoint(fresh, target)
                result["reloaded_values"] = megatron_values(fresh, TOKENS)
                policy = build_model_chunks(ckpt.config, layout)
                load_hf_into_chunks(policy, ckpt, layout)
                save_megatron_checkpoint(policy, f"{ckpt_root}/policy", ckpt.config, layout)
                try:
                    load_megatron_checkpoint(build_value_model_chunks(ckpt.config, layout), f"{ckpt_root}/policy")
                    result["policy_into_critic"] = "loaded"
                except (Exception, CheckpointException) as error:  # noqa: BLE001 - the test inspects it
                    result["policy_into_critic"] = f"{type(error).__name__}: {error}"
                dist.barrier()
            result["grads"] = _value_grads(chunks, layout, ckpt.config["vocab_size"])
            results.append(result)
        per_layout[layout_name] = results
    parallel_state.destroy_model_parallel()
    return per_layout


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def sources(tiny_hf_model):
    """model -> (HF dir, HF values oracle [b, s], HF grads oracle {megatron name: grad})."""
    from transformers import AutoModelForCausalLM

    made = {}
    for model, (preset, overrides) in MODELS.items():
        path = tiny_hf_model(preset, seed=11, **overrides)
        hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        head = expected_head(hf_model.config.hidden_size).requires_grad_(True)
        out = hf_model(TOKENS, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        # The last hidden state is after the final norm: the LM head of it gives HF's logits.
        torch.testing.assert_close(hf_model.lm_head(hidden), out.logits)
        values = (hidden @ head.t()).squeeze(-1)
        (values * LOSS_WEIGHTS).sum().backward()
        hf_params = dict(hf_model.named_parameters())
        grads = {name: (head.grad if hf is None else hf_params[hf].grad).detach().clone()
                 for name, hf in GRAD_PARAMS.items()}
        made[model] = (path, values.detach(), grads)
    return made


@pytest.fixture(scope="module")
def runs(sources, tmp_path_factory):
    """layout -> per-rank results; one launch per world size, on first use."""
    cache = {}

    def get(layout):
        if layout not in cache:
            world = LAYOUTS[layout][1]
            names = [name for name, (_, w) in LAYOUTS.items() if w == world]
            dirs = [str(sources[m][0]) for m in MODELS]
            ckpt_root = str(tmp_path_factory.mktemp(f"dist_ckpt_world{world}"))
            per_rank = run_on_ranks(critic_on_rank, world, dirs, names, ckpt_root, timeout_s=300)
            cache.update({name: [rank[name] for rank in per_rank] for name in names})
        return cache[layout]

    return get


def _last_stage(per_rank, index, key):
    found = [rank[index][key] for rank in per_rank if rank[index][key] is not None]
    assert found, f"no rank returned {key}"
    for other in found[1:]:  # every TP (and CP) rank of the last stage holds the same values
        assert torch.equal(other, found[0]), key
    return found[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_values_and_grads_match_hf(sources, runs, layout):
    per_rank = runs(layout)
    for index, model in enumerate(MODELS):
        _, hf_values, hf_grads = sources[model]
        values = _last_stage(per_rank, index, "values")
        head = _last_stage(per_rank, index, "head")
        assert torch.equal(head, expected_head(head.shape[1])), model
        assert all(r[index]["head_params"] in ([], ["output_layer.weight"]) for r in per_rank), model
        torch.testing.assert_close(values, hf_values, atol=1e-5, rtol=0, msg=lambda m: f"{model} {layout}: {m}")
        assert values.abs().max() > 0.05, "values are trivially small: the oracle would not discriminate"
        grads = {}
        for rank in per_rank:
            for name, grad in rank[index]["grads"].items():
                if name in grads:  # replicas (TP ranks) must agree bit for bit after finalize_model_grads
                    assert torch.equal(grads[name], grad), f"{model} {layout}: TP replicas of {name}'s grad differ"
                grads[name] = grad
        assert sorted(grads) == sorted(GRAD_PARAMS), f"{model} {layout}"
        for name, grad in grads.items():
            torch.testing.assert_close(grad, hf_grads[name], atol=2e-5, rtol=1e-4,
                                       msg=lambda m: f"{model} {layout} grad of {name}: {m}")
        if layout == "tp1":  # negative control: a different head must fail the same oracle
            other = _last_stage(per_rank, index, "values_other_head")
            with pytest.raises(AssertionError):
                torch.testing.assert_close(other, hf_values, atol=1e-5, rtol=0)
        if layout == "tp2_sp" and index == 0:
            reloaded = _last_stage(per_rank, index, "reloaded_values")
            assert torch.equal(reloaded, values), "dist checkpoint round trip changed the critic"
            refused = [r[index]["policy_into_critic"] for r in per_rank]
            assert all(msg != "loaded" for msg in refused), "a policy checkpoint loaded into critic chunks"
            assert all("value_head_weight" in msg for msg in refused), refused
