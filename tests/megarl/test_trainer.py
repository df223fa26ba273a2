"""`megarl train` end to end on CPU: real Ray, real Megatron workers, real SGLang engines.

- learning (an MoE model, its experts split over the actor's ranks): GRPO raises the mean reward
  far beyond a no-update control (lr = 0) run of the same seed; every rollout's SGLang log-probs
  equal the actor's recomputation; the control lays out a row per sample and its first step
  equals the GRPO run's shared-prompt rows;
- pools and resume, against one uninterrupted run with every role on a pool of its own: a
  colocated run gives its steps 1-2, is SIGKILLed (driver) in the middle of its step-3
  checkpoint, and resumed from step 2 gives its step 3 (an engine killed and restarted in it);
  a Megatron worker killed in step 4's update stops the run at once, naming it; with its newest
  checkpoint then corrupted, the same command resumes from the one before and gives steps 3-4
  (each step logged once, the partial checkpoint replaced); no process of the killed or stopped
  run survives;
- a reward model (on its own pool) scores every sample as HF's sequence classifier does;
- PPO with a critic (on a pool of its own): the value loss falls as the critic learns the returns;
  a reward worker killed as it is to score costs one sample's score and nothing else; a SIGTERM
  makes the driver finish its step, save a checkpoint and exit with status 143;
- a broken config or a missing dataset fails before Ray starts, with one clear message.
"""

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MEGARL = [sys.executable, "-m", "megarl.cli", "train", str(ROOT / "configs/quickstart_grpo.yaml")]


@pytest.fixture(scope="module")
def prompts(arith_prompts):
    return arith_prompts(400)


def _overrides(prompts, out, **extra):
    base = {"data.train_files": f"[{prompts}]", "trainer.output_dir": str(out), "trainer.loggers": "[console]"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _run(args, timeout_s=600, survivors: list | None = None, **popen):
    """Run `megarl train` in its own session; whatever it leaves behind is killed with it (and,
    given a ``survivors`` list, named there first)."""
    proc = subprocess.Popen(MEGARL + args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        if survivors is not None:
            survivors.extend(_survivors(proc.pid))
    finally:
        _kill_session(proc.pid)
    return proc.returncode, output


def _survivors(sid: int, grace_s: float = 60, ignore=()) -> list[str]:
    """The processes of session ``sid`` still alive ``grace_s`` after its leader ended (sooner if
    none), but those named in ``ignore``."""
    deadline = time.monotonic() + grace_s
    while _session_members(sid) and time.monotonic() < deadline:
        time.sleep(1)
    return [f"{p.name()} ({' '.join(p.cmdline())[:120]})" for p in _session_members(sid) if p.name() not in ignore]


def _kill_session(sid: int) -> None:
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _session_members(sid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error, OSError):
            pass
    return members


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_grpo_reward_rises_against_a_no_update_control(prompts, tmp_path):
    """On an MoE model (tiny-qwen3-moe) with its experts split over the actor's two ranks (ep=2) and
    synced into two SGLang engines that each hold all four: the reward rises beyond a no-update
    control, and at every step the engines' log-probs of their samples equal the actor's
    recomputation (the experts each sync moves are exact), which replays the experts the engines
    routed each token to (routing replay: a misplaced route would change the log-probs, see
    test_routing_replay_routes_as_the_rollout_did_at_every_layout)."""
    common = {"model.path": "tiny-qwen3-moe", "actor.layout.ep": 2, "trainer.total_steps": 20,
              "trainer.save_every": 0, "data.batch_size": 16, "rollout.n": 8, "actor.micro_batch_size": 8,
              "ref.micro_batch_size": 8}
    code, output = _run(_overrides(prompts, tmp_path / "grpo", **common, **{"actor.routing_replay": "true"}),
                        timeout_s=900)
    assert code == 0, output[-3000:]
    assert "layout tp=1 pp=1 cp=1 ep=2" in output, output[-3000:]
    assert "routing replay: the actor's routers use the engines' experts" in output, output[-3000:]
    assert "rows: one per prompt, its samples as branches" in output, output[-3000:]  # the default at n > 1
    # The no-update control: lr must be > 0, and at 1e-12 Adam moves each weight by ~1e-12. It also
    # lays out a row per sample (actor.shared_prompts=false): see the padded-rows check below.
    control_settings = {**common, "actor.optim.lr": 1e-12, "trainer.total_steps": 5, "actor.shared_prompts": "false"}
    code, control_output = _run(_overrides(prompts, tmp_path / "control", **control_settings), timeout_s=600)
    assert code == 0, control_output[-3000:]
    assert "rows: one per sample" in control_output, control_output[-3000:]
    grpo_steps, control_steps = _metrics(tmp_path / "grpo"), _metrics(tmp_path / "control")
    grpo = [m["reward/mean"] for m in grpo_steps]
    control = [m["reward/mean"] for m in control_steps]
    print("GRPO reward per step:", [round(r, 3) for r in grpo])
    print("no-update control:   ", [round(r, 3) for r in control])
    first, last = sum(grpo[:3]) / 3, sum(grpo[-3:]) / 3
    spread = max(control) - min(control)  # run-to-run noise of the per-step mean reward
    assert last - first > max(0.08, 2 * spread), (grpo, control)
    assert max(control) < last, (grpo, control)
    # Every step: the engine's log-probs of its own samples equal the actor's recomputation.
    for m in grpo_steps:
        mismatch = {key: m[f"actor/mismatch/{key}"] for key in ("abs_logp_diff", "kl_k3", "outside_bounds")}
        assert mismatch["abs_logp_diff"] < 1e-3 and mismatch["kl_k3"] < 1e-6 and mismatch["outside_bounds"] == 0, \
            (m["step"], mismatch)
    assert (tmp_path / "grpo" / "hf_final" / "model.safetensors").is_file()
    # Padded rows: the first step (same initial weights, seed and so rollouts; the learning rate
    # acts only after it) has the shared-prompt run's losses, entropy and KL. Later steps sample
    # from other weights. Not its grad norm: megatron's load-balancing loss is computed over a
    # micro-batch's tokens, among which padded rows hold each prompt n times and shared-prompt
    # rows once.
    _assert_same_steps({m["step"]: m for m in control_steps}, {m["step"]: m for m in grpo_steps}, (1,),
                       keys=[k for k in COMPARED if k != "actor/grad_norm"])


FOUR_STEPS = {"trainer.total_steps": 4, "trainer.save_every": 2, "data.batch_size": 8, "rollout.n": 4}
COMPARED = ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm")


SEPARATE = {**FOUR_STEPS, "trainer.save_every": 0, "cluster.cpu_ranks_per_node": 6,
            "cluster.pools": "{train: 2, rollout: 2, reference: 2}", "actor.pool": "train",
            "rollout.placement": "separate", "rollout.pool": "rollout", "ref.pool": "reference", "ref.layout.pp": 2}


@pytest.fixture(scope="module")
def separate_pools(prompts, tmp_path_factory):
    """Step -> metrics of an uninterrupted 4-step run with every role on a pool of its own: the
    actor on 2 trainer ranks, two TP=1 engines on 2 ranks of their own (fed by the separate-pool
    sync), the reference at PP=2 on 2 more, and generation in streaming mode with
    max_staleness=0 (the stream's thread waits for each update's weights, which must give the
    synchronous loop's batches). The oracle of the colocated synchronous runs below: the same
    seed, data and model, so every step (rollouts after each sync, KL to the reference) must match."""
    out = tmp_path_factory.mktemp("separate")
    streaming = {"rollout.mode": "streaming", "rollout.max_staleness": 0}
    code, output = _run(_overrides(prompts, out, **SEPARATE, **streaming) + ["--no-export"])
    assert code == 0, output[-3000:]
    assert "pool 'reference': 2 rank(s) of ref (layout tp=1 pp=2 cp=1)" in output, output[-3000:]
    assert "2 SGLang engine(s) of TP=1 on their own pool 'rollout'" in output, output[-3000:]
    steps = {m["step"]: m for m in _metrics(out)}
    assert [steps[k]["rollout/version_lag_max"] for k in (1, 2, 3, 4)] == [0, 0, 0, 0]
    return steps


KILLED = {**FOUR_STEPS, "trainer.save_every": 1}


@pytest.fixture(scope="module")
def killed_and_resumed(prompts, tmp_path_factory):
    """A colocated run (2 ranks, two engines of TP=1, a checkpoint every step) whose driver is
    SIGKILLed in the middle of its step-3 checkpoint (MEGARL_FAULTS, after the workers wrote their
    shards), then run again until a Megatron worker dies in step 4's update: its steps, output and
    leftovers, as a namespace (fields below). The corrupted-checkpoint test below runs it to the end."""
    out = tmp_path_factory.mktemp("killed")
    log = tmp_path_factory.mktemp("killed_log") / "output.txt"
    with log.open("w") as log_file:
        proc = subprocess.Popen(MEGARL + _overrides(prompts, out, **KILLED) + ["--no-export"], cwd=ROOT,
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "MEGARL_FAULTS": "kill_driver_during_save@3"})
    try:
        assert proc.wait(timeout=600) == -signal.SIGKILL, log.read_text()[-3000:]
        # Ray's own per-node agents outlive a SIGKILLed driver that started Ray (they are killed with
        # the session below); the run's workers, engines and reward processes must all be gone.
        survivors = _survivors(proc.pid, ignore=("ray::DashboardAgent", "ray::RuntimeEnvAgent"))
    finally:
        _kill_session(proc.pid)
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".step_000003.partial", "step_000001", "step_000002"]
    assert [m["step"] for m in _metrics(out)] == [1, 2, 3]  # step 3 was logged before its save began
    # The resumed run meets a dead engine (MEGARL_FAULTS SIGKILLs engine 0 before step 3's
    # generation) and then a dead Megatron worker (the actor's rank 1, as step 4's update begins).
    stopped_survivors = []
    stopped_code, output = _run(_overrides(prompts, out, **KILLED) + ["--no-export"], survivors=stopped_survivors,
                                env={**os.environ, "MEGARL_FAULTS": "kill_engine@3,kill_megatron_worker@4"})
    return types.SimpleNamespace(
        steps={m["step"]: m for m in _metrics(out)},  # step -> metrics, of both runs
        output=output,  # the second run's: resumed, engine restarted, stopped by the dead worker
        survivors=survivors,  # of the first run, SIGKILLed
        stopped_code=stopped_code, stopped_survivors=stopped_survivors,  # of the second run
        checkpoints=sorted(p.name for p in checkpoints.iterdir()),  # after the second run
        out=out)


def _assert_same_steps(run: dict, oracle: dict, steps, keys=COMPARED) -> None:
    for step in steps:
        for key in keys:
            assert run[step][key] == pytest.approx(oracle[step][key], rel=1e-5, abs=1e-6), (step, key)


def test_resume_after_sigkill_matches_an_uninterrupted_run(separate_pools, killed_and_resumed):
    run = killed_and_resumed
    assert "resumed from" in run.output and "(step 2)" in run.output, run.output[-3000:]
    assert list(run.steps) == [1, 2, 3]  # every step logged once
    _assert_same_steps(run.steps, separate_pools, (3,))
    assert run.survivors == [], f"processes of the killed run still alive: {run.survivors}"


def test_a_megatron_worker_killed_in_the_update_stops_the_run_naming_it(separate_pools, killed_and_resumed):
    """The actor's rank 1 died as step 4's update began, while rank 0 ran the update and waited
    for it in the gradients' all-reduce: the run stopped at once (not at the phase deadline),
    exit 2, naming the rank, the phase and the checkpoint to resume from, left no process, kept
    its checkpoints, and had not logged step 4 (the corrupted-checkpoint test finishes the run)."""
    run = killed_and_resumed
    assert run.stopped_code == 2, run.output[-3000:]
    assert "fault injection: Megatron rank 1 of the actor dies as step 4's update begins" in run.output
    checkpoint = run.out / "checkpoints" / "step_000003"
    assert ("megarl train: update (actor): Megatron rank 1 of pool 'global' died (" in run.output
            and f"The newest complete checkpoint is {checkpoint}: run the same command to resume from it"
            in run.output), run.output[-3000:]
    assert run.stopped_survivors == [], f"processes of the stopped run still alive: {run.stopped_survivors}"
    assert run.checkpoints == ["step_000002", "step_000003"] and list(run.steps) == [1, 2, 3]


def test_a_killed_engine_is_restarted_resynced_and_retried(killed_and_resumed):
    """In the resumed run, engine 0's processes were SIGKILLed before step 3's generation: the run
    restarted it, resynced the trained weights into it (checksum-verified) and retried its requests
    with the same seed, which is why its steps 3-4 equal the uninterrupted run's (test above)."""
    run = killed_and_resumed
    assert "fault injection: killing engine 0" in run.output, run.output[-3000:]
    assert "step 3: SGLang engine 0 died during generation" in run.output and "restarted it" in run.output, \
        run.output[-3000:]
    assert run.steps[3]["rollout/engine_restarts"] == 1


def test_every_role_on_a_pool_of_its_own_matches_the_colocated_run(separate_pools, killed_and_resumed):
    """The colocated run's steps before its kill (steps 1-2: the second samples from weights
    synced after an update) equal the separate pools' (its steps 3-4 are the resume test's)."""
    run = killed_and_resumed
    # engines use their ranks' cores, not the one thread Ray gives its actors (2 ranks here)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"of actor+ref (layout tp=1 pp=1 cp=1) ({threads} CPU thread(s) per rank)" in run.output, \
        run.output[-3000:]
    assert "2 SGLang engine(s) of TP=1 colocated" in run.output, run.output[-3000:]
    _assert_same_steps(run.steps, separate_pools, (1, 2))
    assert separate_pools[4]["actor/kl_loss"] > 1e-6  # the reference's log-probs are in the compared loss


SHIFTED_REWARD = """
from megarl.rewards.builtin import arithmetic_reward

def shifted(**kw):
    return 1.0 + arithmetic_reward(**kw)
"""


def test_auto_resume_skips_a_corrupted_newest_checkpoint(separate_pools, killed_and_resumed, prompts):
    """The run a dead Megatron worker stopped in step 4, its newest checkpoint (step 3) then
    damaged by one flipped byte: the same command finds it against the checksums recorded at save,
    says so, moves it aside, resumes from step 2 instead, and finishes the run with steps 3 and 4
    exactly as the uninterrupted run, saving step 3 anew."""
    out = killed_and_resumed.out
    newest = out / "checkpoints" / "step_000003"
    victim = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(data)
    code, output = _run(_overrides(prompts, out, **KILLED) + ["--no-export"])
    assert code == 0, output[-3000:]
    assert f"skipping checkpoint {newest}: {victim.relative_to(newest)} does not match its checksum" in output, output
    assert "resumed from" in output and "(step 2)" in output, output[-3000:]
    # The damaged checkpoint was moved aside, and the re-run step 3 saved an intact one in its place.
    from parallel.checkpoint.manifest import manifest_problem

    assert (out / "checkpoints" / ".step_000003.damaged").is_dir() and manifest_problem(newest) is None
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        ".step_000003.damaged", "step_000003", "step_000004"]  # keep_last 2
    steps = _metrics(out)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]  # every step logged once
    _assert_same_steps({m["step"]: m for m in steps}, separate_pools, (3, 4))


def test_one_step_off_trains_on_batches_one_version_old_while_generating_the_next(separate_pools, prompts,
                                                                                  tmp_path):
    """rollout.mode=one_step_off on the separate pools, with partial rollouts (chunks of 2 new
    tokens): step 1 trains on the same first batch as the synchronous run (identical metrics: no
    weights arrive during it, and the chunks continue the sampling as one call would), every later
    batch was started by the weights one update older (version lag exactly 1, on each sample's
    oldest token), tokens sampled after the next update arrived count as newer, and the timeline
    shows the rollout side working while each step trains."""
    from megarl.metrics import read_timeline

    settings = {**SEPARATE, "rollout.mode": "one_step_off", "trainer.total_steps": 3, "rollout.partial_rollout_tokens": 2}
    code, output = _run(_overrides(prompts, tmp_path, **settings) + ["--no-export"])
    assert code == 0, output[-3000:]
    steps = {m["step"]: m for m in _metrics(tmp_path)}
    _assert_same_steps(steps, separate_pools, (1,))
    assert [steps[k]["rollout/version_lag_max"] for k in (1, 2, 3)] == [0, 1, 1]
    assert [steps[k]["rollout/version_lag/1"] for k in (2, 3)] == [32, 32]  # 8 prompts x 4 samples
    assert (steps[1]["rollout/partial_samples"], steps[1]["rollout/token_version_lag_mean"]) == (0, 0)
    for k in (2, 3):  # a token lags 1 update unless it was sampled after the next one arrived
        partial, token_lag = steps[k]["rollout/partial_samples"], steps[k]["rollout/token_version_lag_mean"]
        assert 0 <= token_lag <= 1 and (partial > 0) == (token_lag < 1), (k, partial, token_lag)
    events = read_timeline(tmp_path / "timeline.json")
    rollout = [e for e in events if e["lane"] == "rollout"]
    for step in (1, 2):
        # The next batch's generation starts once the step's own batch is generated (one thread
        # generates them in order), and the rollout side (that generation, or applying the last
        # update's weights before it) works while the step trains: between the end of its wait
        # for its batch (the "generate" phase) and its weight sync.
        phase = {e["name"]: e for e in events if e["lane"] == "controller" and e["args"]["step"] == step}
        training = (phase["generate"]["ts"] + phase["generate"]["dur"], phase["sync"]["ts"])
        own, following = ([e for e in rollout if e["name"] == "generate" and e["args"]["step"] == k][0]
                          for k in (step, step + 1))
        assert own["ts"] + own["dur"] <= following["ts"], (own, following)
        assert any(e["ts"] < training[1] and e["ts"] + e["dur"] > training[0] for e in rollout), (phase, rollout)


def test_ppo_critic_value_loss_falls_and_sigterm_saves_before_exit(prompts, tmp_path):
    # Rewards shifted by +1 (a reward model's offset): a fresh value head predicts ~0.16, so the
    # critic has a clear error to remove before only the rewards' own variance is left.
    reward_file = tmp_path / "shifted.py"
    reward_file.write_text(SHIFTED_REWARD)
    out = tmp_path / "ppo"
    # The critic trains on a pool of its own, concurrently with the actor.
    settings = {"trainer.total_steps": 50, "trainer.save_every": 0, "cluster.cpu_ranks_per_node": 2,
                "cluster.pools": "{train: 1, values: 1}", "actor.pool": "train", "critic.pool": "values",
                "data.batch_size": 32, "rollout.n": 1, "actor.micro_batch_size": 32, "ref.micro_batch_size": 32,
                "critic.micro_batch_size": 32, "actor.sequence_packing": "true",  # packed rows, all 3 models
                "algorithm.advantage": "gae", "algorithm.lam": 0.95,
                "algorithm.kl_penalty.enabled": "true", "ref.enabled": "true", "critic.enabled": "true",
                "critic.optim.lr": 5e-4, "reward.functions": f"{{synthetic_arith: {reward_file}:shifted}}",
                "algorithm.rollout_correction.method": "tis"}
    # The user's reward runs in worker processes; MEGARL_FAULTS kills the one about to score step 3.
    proc = subprocess.Popen(MEGARL + _overrides(prompts, out, **settings) + ["--no-export"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "MEGARL_FAULTS": "kill_reward_worker@3"})
    try:
        deadline = time.monotonic() + 600
        while not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < 8:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 8"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=300)
    finally:
        _kill_session(proc.pid)
    assert proc.returncode == 143, output[-3000:]
    steps = _metrics(out)
    last = steps[-1]["step"]
    assert 8 <= last < 50 and f"SIGTERM: saved step {last}" in output, output[-3000:]
    saved = out / "checkpoints" / f"step_{last:06d}"
    assert (saved / "trainer_state.json").is_file() and (saved / "critic").is_dir() and not (saved / "ref").exists()
    assert sorted(p.name for p in (saved / "rank_states").iterdir()) == ["train", "values"]
    vf_loss = [m["critic/vf_loss"] for m in steps]
    print("PPO critic value loss per step:", [round(v, 4) for v in vf_loss])
    assert vf_loss[0] > 0.2, vf_loss
    assert sum(vf_loss[-3:]) / 3 < vf_loss[0] / 5, vf_loss
    # The critic's mean prediction has moved to the mean return (the reward: one scored token).
    recent_reward = sum(m["reward/mean"] for m in steps[-3:]) / 3
    assert abs(steps[-1]["critic/vpred_mean"] - recent_reward) < 0.2, (steps[-1], recent_reward)
    assert all(m["actor/update_ok"] == 1.0 for m in steps)
    # The killed reward worker cost one sample's score at step 3 (scored 0, counted); a new worker
    # scored everything else, and every step ran once.
    assert [m["reward/num_errors"] for m in steps] == [1.0 if m["step"] == 3 else 0.0 for m in steps], steps
    assert [m["step"] for m in steps] == list(range(1, last + 1))
    assert "reward worker process died before the call" in output, output[-3000:]
    # Truncated IS on the recomputed pre-update log-probs: the engine samples what the trainer
    # computes (same weights at each step's start), so the weights stay ~1 and the gap small.
    for m in steps:
        assert abs(m["rollout_correction/weight_mean"] - 1) < 0.02 and m["rollout_correction/zeroed_fraction"] == 0, m
        assert m["actor/mismatch/abs_logp_diff"] < 0.02 and m["actor/mismatch/outside_bounds"] < 0.01, m


def test_reward_model_on_its_own_pool_scores_like_hf(prompts, tmp_path):
    """GRPO scored by a reward model (an HF sequence classifier, here at PP=2 on 2 ranks of its
    own): every saved sample's score equals HF transformers' classifier logit of its prompt +
    response, and the step's reward/mean is their mean."""
    from transformers import AutoModelForSequenceClassification

    from model_specs.presets import save_tiny_hf_model

    rm_dir = save_tiny_hf_model("tiny-qwen2", tmp_path / "rm", seed=9, reward_model=True, pad_token_id=0)
    out = tmp_path / "rm_run"
    settings = {"trainer.total_steps": 2, "trainer.save_every": 0, "data.batch_size": 4, "rollout.n": 4,
                "cluster.cpu_ranks_per_node": 4, "cluster.pools": "{train: 2, scoring: 2}", "actor.pool": "train",
                "reward_model.enabled": "true", "reward_model.model_path": rm_dir, "reward_model.pool": "scoring",
                "reward_model.layout.pp": 2, "reward_model.micro_batch_size": 2, "trainer.save_rollouts_every": 1,
                "algorithm.rollout_correction.bypass": "true"}  # the engine's log-probs as PPO's old policy
    code, output = _run(_overrides(prompts, out, **settings) + ["--no-export"])
    assert code == 0, output[-3000:]
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    metrics = {m["step"]: m for m in _metrics(out)}
    for step in (1, 2):
        samples = [json.loads(line) for line in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(samples) == 16
        with torch.no_grad():
            want = [float(model(torch.tensor([s["prompt_ids"] + s["response_ids"]])).logits[0, 0]) for s in samples]
        assert [s["score"] for s in samples] == pytest.approx(want, abs=2e-5), step
        assert metrics[step]["reward/mean"] == pytest.approx(sum(want) / len(want), abs=1e-5)
    assert len(set(round(w, 6) for w in want)) > 1  # the scores are not all the same
    # bypass: no recomputed old log-probs; the mismatch is measured on the update's own forward
    assert metrics[1]["actor/mismatch/abs_logp_diff"] < 0.01 and metrics[1]["actor/mismatch/kl_k3"] < 1e-4


def test_broken_config_and_missing_data_fail_before_ray(prompts, tmp_path):
    code, output = _run(_overrides(prompts, tmp_path / "a", **{"rollout.n": 0}), timeout_s=120)
    assert code == 2 and "rollout.n=0" in output, output
    code, output = _run(_overrides(str(tmp_path / "missing.parquet"), tmp_path / "b"), timeout_s=120)
    assert code == 2 and "missing.parquet" in output, output
    assert "ray" not in output.lower()
    code, output = _run(_overrides(prompts, tmp_path / "c", **{"ref.layout.pp": 2}), timeout_s=120)
    assert code == 2 and 'ref.layout="tp=1 pp=2 cp=1": differs from the actor\'s layout' in output, output
    assert "give the ref a pool of its own" in output, output
    assert "ray" not in output.lower()
