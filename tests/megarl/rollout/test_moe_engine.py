"""A real SGLang CPU engine serving an MoE model with expert parallelism (TP2, EP2: each rank holds
half the experts, through megarl's expert-parallel patch of SGLang's torch-native expert path), the
experts it routes each token to, and megarl's weight sync into its fused experts. Oracles: HF
transformers' greedy tokens, log-probs and router top-k, and SGLang's own loaders (checksums of
every parameter of every rank)."""

from __future__ import annotations

import pytest
import torch

from megarl.rollout import SGLangEngine, weight_checksum
from model_specs.presets import PRESETS
from parallel.checkpoint.hf_io import HFCheckpoint
from parallel.layout import MegatronLayout
from parallel.reshard.plan import execute_plan_in_memory, megatron_device_positions, plan_megatron_to_sglang
from parallel.reshard.shards import megatron_shards
from tests.megarl.rollout.test_engine import NEW_TOKENS, _engine_leftovers, _hf_greedy, _prompts
from tests.parallel.reshard.test_plan import materialise
from tests.sglang_oracle import sglang_all_rank_parameters, sglang_oracle_batch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-path tests")

PRESET, TP, EP = "tiny-qwen3-moe", 2, 2
# SGLang's CPU engine pads the experts' intermediate size to a multiple of 32 * tp (64 here), a
# layout megarl refuses to sync into (parallel.reshard.shards.sglang_expert_problem): the preset's
# 32 would be padded.
FFN = {"moe_intermediate_size": 64}


@pytest.fixture(scope="module")
def checkpoints(tiny_hf_model):
    first, second = tiny_hf_model(PRESET, **FFN), tiny_hf_model(PRESET, seed=1, **FFN)
    sglang_oracle_batch([(first, TP, EP), (second, TP, EP)])  # one oracle process
    return first, second


@pytest.fixture(scope="module")
def engine(checkpoints):
    with SGLangEngine(checkpoints[0], tp_size=TP, ep_size=EP, startup_timeout_s=240, call_timeout_s=120,
                      enable_return_routed_experts=True) as eng:
        yield eng
    assert _engine_leftovers(eng.pid) == []


def _assert_greedy_matches_hf(engine, model_dir):
    prompts = _prompts(PRESETS[PRESET]["vocab_size"])
    outs = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
                           return_logprob=True)
    for prompt, out, (hf_ids, hf_logps) in zip(prompts, outs, _hf_greedy(model_dir, prompts)):
        assert out["output_ids"] == hf_ids, f"prompt {prompt}"
        assert out["output_logprobs"] == pytest.approx(hf_logps, abs=1e-4)


def _checksums(per_rank):
    return [{name: weight_checksum(t) for name, t in rank.items()} for rank in per_rank]


@pytest.mark.timeout(300)
def test_expert_parallel_engine_generates_what_hf_generates(engine, checkpoints):
    assert engine.rank_parameter_checksums() == _checksums(sglang_all_rank_parameters(checkpoints[0], TP, EP))
    _assert_greedy_matches_hf(engine, checkpoints[0])


@pytest.mark.timeout(300)
def test_routed_experts_are_hf_routers_top_k_at_every_position_and_layer(engine, checkpoints):
    """What rollout routing replay records: for every position SGLang ran (prompt and output but
    the last token), every layer's top-k expert ids, global ids under EP, as HF's router picks them."""
    from transformers import AutoModelForCausalLM

    prompts = _prompts(PRESETS[PRESET]["vocab_size"])
    outs = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
                           return_routed_experts=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoints[0], dtype=torch.float32).eval()
    layers, topk = PRESETS[PRESET]["num_hidden_layers"], PRESETS[PRESET]["num_experts_per_tok"]
    for prompt, out in zip(prompts, outs):
        sequence = prompt + out["output_ids"][:-1]
        with torch.no_grad():
            logits = model(torch.tensor([sequence]), output_router_logits=True).router_logits
        want = torch.stack([layer.reshape(len(sequence), -1).topk(topk, dim=-1).indices for layer in logits], 1)
        routes = out["routed_experts"]
        assert routes.shape == (len(sequence), layers, topk)
        assert torch.equal(routes.long().sort(-1).values, want.sort(-1).values), f"prompt {prompt}"


@pytest.mark.timeout(300)
def test_megatron_ep2_shards_synced_into_fused_experts_serve_the_new_model(engine, checkpoints):
    """The plan from a Megatron EP2 x TP2 actor into SGLang TP2 x EP2, executed from the actor's
    shards of the second checkpoint and delivered in place: every parameter of every rank equals
    SGLang's own loading of that checkpoint, and generation follows it."""
    ckpt = HFCheckpoint(checkpoints[1])
    hf, hf_tensors = ckpt.config, ckpt.read_all()
    layout, world = MegatronLayout(tp=2, ep=2, sequence_parallel=True), 2
    plan = plan_megatron_to_sglang(hf, layout, world, TP, rollout_ep=EP)
    plan.check()
    shards = megatron_shards(hf, layout)
    sources = {device: {(i, name): tensor for i, chunk in enumerate(shards[position])
                        for name, tensor in materialise(chunk, hf_tensors).items()}
               for device, position in megatron_device_positions(layout, world).items()}
    buffers = {device: {name: torch.full(t.shape, float("nan")) for name, t in tensors.items()}
               for device, tensors in plan.destinations.items()}
    execute_plan_in_memory(plan, sources, buffers)
    with engine.weight_update():
        engine.update_weights_direct([buffers[rank] for rank in range(TP)])
    assert engine.rank_parameter_checksums() == _checksums(sglang_all_rank_parameters(checkpoints[1], TP, EP))
    _assert_greedy_matches_hf(engine, checkpoints[1])
