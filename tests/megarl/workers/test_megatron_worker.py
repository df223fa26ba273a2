"""The Megatron worker: log-probs equal HF transformers' at every layout, padded, packed
(sequences in one thd row) or with shared prompts (one row per prompt, its samples as branches),
the same PPO updates give the same losses at every layout (the update is a function of the batch
only), and a reward model scores like HF's sequence classifier."""

import pytest
import torch

from model_specs.presets import save_tiny_hf_model
from parallel.spawn import run_on_ranks
from tests.megarl.workers.rank_fns import worker_logprobs_and_updates, worker_reward_values, worker_routing_replay

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]
RESPONSES = [[20, 21, 22, 23], [24], [25, 26, 27], [28, 29]]


def rollout_batch(vocab_size: int) -> dict:
    """Eight samples (each prompt twice in a row, the second time with a shorter response, as a
    rollout with n=2 orders them), right-padded; the loss mask leaves out the second token of
    the longer responses (a tool output inside a multi-turn trajectory)."""
    prompts = [p for p in PROMPTS for _ in range(2)]
    responses = [r for full in RESPONSES for r in (full, full[:1])]
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
    longest = max(len(r) for r in responses)
    generator = torch.Generator().manual_seed(3)
    return {
        "input_ids": ids % vocab_size,
        "prompt_lengths": torch.tensor([len(p) for p in prompts]),
        "response_lengths": torch.tensor([len(r) for r in responses]),
        "advantages": torch.randn(len(prompts), longest, generator=generator),
        "loss_mask": torch.tensor([[0.0 if j == 1 and len(r) >= 3 else 1.0 for j in range(longest)] for r in responses]),
    }


def hf_response_logprobs(hf_dir: str, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: HF transformers' log-probs and entropies of each response token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    width = int(batch["response_lengths"].max())
    logp = torch.zeros(len(batch["input_ids"]), width)
    entropy = torch.zeros_like(logp)
    with torch.no_grad():
        for i, ids in enumerate(batch["input_ids"]):
            p, r = int(batch["prompt_lengths"][i]), int(batch["response_lengths"][i])
            logits = model(ids[: p + r].unsqueeze(0)).logits[0].log_softmax(-1)
            logp[i, :r] = logits[p - 1 : p + r - 1].gather(-1, ids[p : p + r].unsqueeze(-1)).squeeze(-1)
            entropy[i, :r] = -(logits.exp() * logits).sum(-1)[p - 1 : p + r - 1]
    return logp, entropy


def _collect(results: list, key: str, rows: int) -> dict[str, torch.Tensor]:
    """Reassemble the per-replica outputs of the output ranks into full-batch tensors."""
    parts = [r[key] for r in results if r[key] is not None]
    order = torch.cat([p["rows"] for p in parts])
    assert sorted(order.tolist()) == list(range(rows))
    return {name: torch.cat([p[name] for p in parts])[order.argsort()] for name in parts[0] if name != "rows"}


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model):
    # tiny-llama: vocab 200 padded to 256 by megatron, so the padded-vocab masking is exercised.
    return tiny_hf_model("tiny-llama", seed=1)


PACKED, SHARED = {"packed": True}, {"shared_prompts": True}
# name -> (layout, world size, MicroBatching options: padded rows unless packed/shared prompts)
LAYOUTS = {
    "tp1_dp2": (dict(tp=1), 2, {}),
    "tp2": (dict(tp=2), 2, {}),
    "pp2": (dict(pp=2), 2, {}),
    "cp2": (dict(cp=2), 2, {}),
    "tp2_sp": (dict(tp=2, sequence_parallel=True), 2, {}),
    "packed_pp2": (dict(pp=2), 2, PACKED),
    "packed_cp2": (dict(cp=2), 2, PACKED),
    "packed_tp2_sp": (dict(tp=2, sequence_parallel=True), 2, PACKED),
    "shared_tp1_dp2": (dict(tp=1), 2, SHARED),
    "shared_pp2": (dict(pp=2), 2, SHARED),
    "shared_tp2_sp": (dict(tp=2, sequence_parallel=True), 2, SHARED),
}


@pytest.fixture(scope="module")
def results(hf_dir):
    batch = rollout_batch(200)
    out = {}
    for name, (layout, world, batching) in LAYOUTS.items():
        out[name] = run_on_ranks(worker_logprobs_and_updates, world, hf_dir, layout, batch, 2, 1e-3, 2, batching,
                                 timeout_s=240)
    return batch, out


def test_logprobs_and_entropy_equal_hf_at_every_layout(hf_dir, results):
    batch, out = results
    want_logp, want_entropy = hf_response_logprobs(hf_dir, batch)
    from megarl.workers.batch import response_mask

    mask = response_mask(batch).bool()
    for name, per_rank in out.items():
        got = _collect(per_rank, "ref", len(batch["input_ids"]))
        torch.testing.assert_close(got["logp"][mask], want_logp[mask], atol=2e-5, rtol=0, msg=name)
        torch.testing.assert_close(got["entropy"][mask], want_entropy[mask], atol=2e-5, rtol=0, msg=name)


def test_same_updates_at_every_layout(results):
    batch, out = results
    reference = next(m for m in out["tp1_dp2"] if m["after"] is not None)["metrics"]
    assert reference[0]["actor/loss"] != reference[1]["actor/loss"]  # the first step changed the model
    for name, per_rank in out.items():
        for step, (want, got) in enumerate(zip(reference, per_rank[0]["metrics"])):
            # Step 1 runs on weights after one Adam step, which turns rounding-level gradient
            # differences into weight differences of up to lr (see below): a looser relative bound.
            rel = 1e-4 if step == 0 else 5e-4
            for key in ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
                assert got[key] == pytest.approx(want[key], abs=1e-5, rel=rel), (name, step, key)
    after = {name: _collect(r, "after", len(batch["input_ids"]))["logp"] for name, r in out.items()}
    before = _collect(out["tp1_dp2"], "ref", len(batch["input_ids"]))["logp"]
    assert (after["tp1_dp2"] - before).abs().max() > 0.05  # the updates moved the log-probs
    # Adam turns rounding-level gradient differences on near-zero gradients into steps of up to
    # lr, so the weights after two steps agree to about lr (1e-3), not to 1e-6.
    for name, logp in after.items():
        torch.testing.assert_close(logp, after["tp1_dp2"], atol=2e-3, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout, batching", [(dict(tp=2), {}), (dict(pp=2), {}), (dict(cp=2), PACKED),
                                             (dict(tp=2), SHARED)], ids=["tp2", "pp2", "packed_cp2", "shared_tp2"])
def test_reward_model_scores_equal_hf_sequence_classifier(tmp_path, layout, batching):
    """A sample's score (the reward model's value at its last token) equals HF transformers'
    ``*ForSequenceClassification`` logit of the unpadded prompt + response; the values at every
    response token are that model's outputs at those tokens."""
    from transformers import AutoModelForSequenceClassification

    rm_dir = save_tiny_hf_model("tiny-qwen2-untied", tmp_path / "rm", seed=4, reward_model=True, pad_token_id=0)
    batch = {k: v for k, v in rollout_batch(200).items() if k != "loss_mask"}  # values at every token
    per_rank = run_on_ranks(worker_reward_values, 2, rm_dir, layout, batch, 2, batching, timeout_s=240)
    values = _collect(per_rank, "scores", len(batch["input_ids"]))["values"]
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for i, ids in enumerate(batch["input_ids"]):
            p, r = int(batch["prompt_lengths"][i]), int(batch["response_lengths"][i])
            score = model(ids[: p + r].unsqueeze(0)).logits[0, 0]
            assert float(values[i, r - 1]) == pytest.approx(float(score), abs=2e-5), i
            prefix_scores = [float(model(ids[: p + j + 1].unsqueeze(0)).logits[0, 0]) for j in range(r)]
            assert values[i, :r].tolist() == pytest.approx(prefix_scores, abs=2e-5), i
            assert values[i, r:].abs().sum() == 0


def test_padding_does_not_reach_an_moe_update(tiny_hf_model):
    """Padding never influences an update, MoE models included: the same first update (losses and
    grad norm, the load-balancing loss in it) at every layout, although at ep=2 over two replicas
    and under pipelining every micro-batch is padded to the longest of all (one shape) and at ep=1
    to its own longest row. Without the padding mask the worker passes, megatron's load-balancing
    loss counts the padding positions' routing and the grad norms differ (by 7e-5 relative)."""
    hf_dir = tiny_hf_model("tiny-qwen3-moe", seed=1)
    batch = rollout_batch(300)
    layouts = {"ep1_dp2": {}, "ep2": {"ep": 2}, "ep2_tp2_sp": {"ep": 2, "tp": 2, "sequence_parallel": True},
               "pp2": {"pp": 2}}
    runs = {name: run_on_ranks(worker_logprobs_and_updates, 2, hf_dir, layout, batch, 1, 1e-3, 2, None, timeout_s=240)
            for name, layout in layouts.items()}
    want = runs["ep1_dp2"][0]["metrics"][0]
    for name, per_rank in runs.items():
        got = per_rank[-1]["metrics"][0]
        for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (name, key, got[key], want[key])


def hf_logprobs_with_routes(hf_dir: str, batch: dict) -> torch.Tensor:
    """The oracle of routing replay: HF transformers' log-probs of each response token when every
    layer's router (``Qwen3MoeTopKRouter``) takes the batch's ``routed_experts`` as its top-k and
    weighs them by its own renormalised softmax probabilities."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    routers = [layer.mlp.gate for layer in model.model.layers]
    forced: list[torch.Tensor] = []  # [positions, top-k] of each layer for the sample being run

    def routed_forward(router, hidden_states):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, router.weight)
        top = forced[routers.index(router)]
        probs = logits.softmax(-1, dtype=torch.float).gather(-1, top)
        return logits, (probs / probs.sum(-1, keepdim=True)).to(logits.dtype), top

    for router in routers:
        router.forward = routed_forward.__get__(router)
    width = int(batch["response_lengths"].max())
    logp = torch.zeros(len(batch["input_ids"]), width)
    with torch.no_grad():
        for i, ids in enumerate(batch["input_ids"]):
            p, r = int(batch["prompt_lengths"][i]), int(batch["response_lengths"][i])
            forced[:] = batch["routed_experts"][i, : p + r].long().unbind(1)
            logits = model(ids[: p + r].unsqueeze(0)).logits[0].log_softmax(-1)
            logp[i, :r] = logits[p - 1: p + r - 1].gather(-1, ids[p: p + r].unsqueeze(-1)).squeeze(-1)
    return logp


def test_routing_replay_routes_as_the_rollout_did_at_every_layout(tiny_hf_model):
    """With the rollout's experts replayed (here random ones, far from the model's own choices,
    the same for the samples of one prompt over its tokens), the actor's log-probs equal HF's with
    its routers forced to those experts, at every layout: the routes reach each router in its own
    token order (experts split over ranks, sequence-parallel shares, context-parallel zig-zag of
    packed rows, pipeline stages' layers, shared-prompt rows). Without routes the same model routes
    by itself (HF's log-probs); with them an update is the same at every layout."""
    from megarl.workers.batch import response_mask

    hf_dir = tiny_hf_model("tiny-qwen3-moe", seed=1)
    batch = rollout_batch(300)
    rows, width = batch["input_ids"].shape
    from model_specs.presets import PRESETS

    preset = PRESETS["tiny-qwen3-moe"]
    layers, experts, topk = preset["num_hidden_layers"], preset["num_experts"], preset["num_experts_per_tok"]
    generator = torch.Generator().manual_seed(5)
    routes = torch.rand(rows, width, layers, experts, generator=generator).argsort(-1)[..., :topk].to(torch.int16)
    for i in range(1, rows, 2):  # sample i repeats sample i-1's prompt: the engine routed it alike
        prompt = int(batch["prompt_lengths"][i])
        routes[i, :prompt] = routes[i - 1, :prompt]
    batch["routed_experts"] = routes
    mask = response_mask(batch).bool()
    want_replayed, want_own = hf_logprobs_with_routes(hf_dir, batch), hf_response_logprobs(hf_dir, batch)[0]
    assert (want_replayed - want_own)[mask].abs().max() > 0.01  # the forced routes change the outputs
    layouts = {"ep2_tp2_sp": ({"ep": 2, "tp": 2, "sequence_parallel": True}, {}),
               "packed_cp2": ({"cp": 2}, PACKED), "shared_pp2_ep1": ({"pp": 2}, SHARED)}
    updates = {}
    for name, (layout, batching) in layouts.items():
        per_rank = run_on_ranks(worker_routing_replay, 2, hf_dir, layout, batch, 2, batching, timeout_s=240)
        for key, want in (("replayed", want_replayed), ("own", want_own)):
            got = _collect(per_rank, key, rows)["logp"]
            torch.testing.assert_close(got[mask], want[mask], atol=2e-5, rtol=0, msg=lambda m: f"{name} {key}: {m}")
        updates[name] = per_rank[-1]["metrics"]
    want = updates["ep2_tp2_sp"]
    for name, metrics in updates.items():
        assert metrics["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], rel=1e-5), name
    # Not the shared-prompt rows' grad norm: the load-balancing loss is over a micro-batch's tokens,
    # among which those rows hold each prompt once (test_padding_does_not_reach_an_moe_update).
    assert updates["packed_cp2"]["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
