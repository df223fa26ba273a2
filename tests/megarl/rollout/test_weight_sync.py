"""End to end: a Megatron actor (TP=2) trains one step, the resharding plan syncs the trained
weights into running SGLang engines (TP=2 and TP=1), and the engines then generate exactly what
HF transformers generates with the trained weights (greedy tokens equal, log-probs within 1e-4).
The parity probe catches a corrupted shard and names it."""

import pytest
import torch

from megarl.rollout import SGLangEngine
from megarl.rollout.weight_sync import WeightSyncError, check_parity, logprob_probe, shard_checksums, sync_weights
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
@pytest.mark.parametrize("rollout_tp", [2, 1])
def test_synced_engine_generates_like_hf_with_trained_weights(trained, rollout_tp):
    source, trained_dir, per_rank = trained
    with SGLangEngine(str(source), tp_size=rollout_tp, startup_timeout_s=300, call_timeout_s=120) as engine:
        before = engine.generate([PROMPTS[0]], {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})
        # Small buckets: several update calls, each a subset of the parameters on every rank.
        stats = sync_weights(engine, per_rank[rollout_tp], bucket_bytes=64 << 10)  # + checksum parity probe
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

        if rollout_tp == 2:  # one flipped bit of one element in one rank's parameter is caught and named
            expected = shard_checksums(per_rank[2])
            corrupted = {"model.layers.1.mlp.down_proj.weight": per_rank[2][1]["model.layers.1.mlp.down_proj.weight"].clone()}
            corrupted["model.layers.1.mlp.down_proj.weight"].view(torch.int32)[3, 7] ^= 1
            with engine.weight_update():
                engine.update_weights_direct([{}, corrupted])
            with pytest.raises(WeightSyncError, match="TP rank 1 holds model.layers.1.mlp.down_proj.weight"):
                check_parity(engine, expected)
