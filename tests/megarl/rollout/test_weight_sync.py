"""End to end: a Megatron actor (TP=2) trains one step, the resharding plan syncs the trained
weights into running SGLang engines (TP=1 started from the checkpoint; TP=2 as a run starts and
colocates it: dummy weights, its memory released as while Megatron trains), and the engines then
generate exactly what HF transformers generates with the trained weights (greedy tokens equal,
log-probs within 1e-4). The parity probe catches a corrupted shard and names it."""

import pytest
import torch

from megarl.rollout import SGLangEngine
from megarl.rollout.engine_worker import RolloutWorker
from megarl.rollout.sglang.transport import FlatLayout, flat_views
from megarl.rollout.weight_sync import (
    RankShards,
    WeightSyncError,
    allocate_flats,
    check_parity,
    logprob_probe,
    pack_rank_shards,
    shard_checksums,
    sync_weights,
)
from model_specs.presets import save_tiny_hf_model
from parallel.spawn import run_on_ranks
from tests.megarl.rollout import rank_fns

PROMPTS = [[3, 17, 42, 8], [100, 5, 77]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(initial HF dir, trained HF export dir, {rollout_tp: per-SGLang-rank buffers})."""
    root = tmp_path_factory.mktemp("sync")
    source = save_tiny_hf_model("tiny-llama", root / "initial", seed=4)
    per_device = run_on_ranks(rank_fns.train_one_step_then_reshard, 2, str(source), {"tp": 2}, [2, 1],
                              str(root / "trained"), timeout_s=300)
    per_rank = {2: [per_device[0][2], per_device[1][2]], 1: [per_device[0][1]]}
    return source, root / "trained", per_rank


def rank_shards(tensors: dict) -> RankShards:
    """``tensors`` as one flat bucket of host memory, as a trainer rank sends them."""
    layouts = [FlatLayout.of({name: (t.shape, t.dtype) for name, t in tensors.items()})]
    flats = allocate_flats(layouts, torch.device("cpu"))
    for name, view in flat_views(flats[0], layouts[0]).items():
        view.copy_(tensors[name])
    return pack_rank_shards(layouts, flats, named=False)


def hf_greedy(path, prompt, steps):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt):].tolist()
    logprobs = torch.stack([torch.log_softmax(step[0].float(), -1)[tok] for step, tok in zip(out.logits, ids)])
    return ids, logprobs


@pytest.mark.timeout(600)
def test_synced_engine_generates_like_hf_with_trained_weights(trained):
    source, trained_dir, per_rank = trained
    with SGLangEngine(str(source), tp_size=1, startup_timeout_s=300, call_timeout_s=120) as engine:
        before = engine.generate([PROMPTS[0]], {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})
        # Small buckets: several update calls, each a subset of the parameters on every rank.
        stats = sync_weights(engine, per_rank[1], bucket_bytes=64 << 10)  # + checksum parity probe
        assert stats["bytes"] > 0 and stats["buckets"] > 3
        for prompt in PROMPTS:
            ids, logprobs = hf_greedy(trained_dir, prompt, 8)
            assert logprob_probe(engine, prompt, ids, logprobs, atol=1e-4) <= 1e-4
        # Before the sync the engine served the initial weights, and the training step moved the
        # model far more than the probe's tolerance (so the agreement above is not vacuous).
        initial_ids, initial_logprobs = hf_greedy(source, PROMPTS[0], 8)
        assert before[0]["output_ids"] == initial_ids
        trained_ids, trained_logprobs = hf_greedy(trained_dir, PROMPTS[0], 8)
        assert trained_ids != initial_ids or (trained_logprobs - initial_logprobs).abs().max() > 1e-2


@pytest.mark.timeout(600)
def test_dummy_started_released_engine_serves_exactly_the_synced_weights(trained):
    """A run's engine (RolloutWorker, TP=2): started from dummy weights, its memory released by
    SGLang's own release of every tagged type, generation refused until the next sync; the sync
    refuses to leave a parameter out, takes the weights' memory back, writes every parameter,
    then takes the KV cache and CUDA graphs back; the engine then generates what HF does with the
    trained weights. (On CPU SGLang's memory saver frees nothing; the calls and their order are
    SGLang's real ones.)"""
    source, trained_dir, per_rank = trained
    greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    worker = RolloutWorker(str(source), 2, "float32", {"load_format": "dummy", "startup_timeout_s": 300,
                                                       "call_timeout_s": 120})
    try:
        engine = worker.engine
        assert (engine.engine_kwargs["load_format"], engine.call_timeout_s) == ("dummy", 120)
        dummy = engine.generate([PROMPTS[0]], greedy, return_logprob=True)[0]
        initial_ids, initial_logprobs = hf_greedy(source, PROMPTS[0], 8)
        assert dummy["output_ids"] != initial_ids or \
            (torch.tensor(dummy["output_logprobs"]) - initial_logprobs).abs().max() > 1e-2  # not the checkpoint

        worker.release_memory()
        with pytest.raises(RuntimeError, match="weights.*are released"):
            worker.generate([PROMPTS[0]], [greedy], seed=3)
        shards = [rank_shards(tensors) for tensors in per_rank[2]]
        one_short = [rank_shards({k: v for k, v in per_rank[2][0].items() if k != "model.norm.weight"}), shards[1]]
        with pytest.raises(ValueError, match=r"engine rank 0 would keep its own values of \['model.norm.weight'\]"):
            worker.update_weights(*one_short)
        assert engine.memory_released
        stats = worker.update_weights(*shards)  # + checksum parity probe
        assert stats["bytes"] > 0 and not engine.memory_released
        for prompt in PROMPTS:
            ids, logprobs = hf_greedy(trained_dir, prompt, 8)
            out = worker.generate([prompt], [greedy], seed=None)[0]
            assert out["output_ids"] == ids
            assert torch.tensor(out["output_logprobs"]) == pytest.approx(logprobs, abs=1e-4)

        # one flipped bit of one element in one rank's parameter is caught and named
        expected = shard_checksums(per_rank[2])
        corrupted = {"model.layers.1.mlp.down_proj.weight": per_rank[2][1]["model.layers.1.mlp.down_proj.weight"].clone()}
        corrupted["model.layers.1.mlp.down_proj.weight"].view(torch.int32)[3, 7] ^= 1
        with engine.weight_update():
            engine.update_weights_direct([{}, corrupted])
        with pytest.raises(WeightSyncError, match="TP rank 1 holds model.layers.1.mlp.down_proj.weight"):
            check_parity(engine, expected)
    finally:
        worker.shutdown()

