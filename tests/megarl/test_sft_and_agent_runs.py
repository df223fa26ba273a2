"""`megarl sft` end to end on CPU (real Ray, Megatron workers), then a multi-turn GRPO run with
tool calls that starts from its output (real SGLang engines):

- SFT: the last checkpoint's save fails (MEGARL_FAULTS: ENOSPC): the run stops saying so, with
  the previous checkpoint intact and nothing half-written; the same command resumes from it and
  repeats the lost steps exactly; the loss falls; the exported model loads in transformers and has
  a lower masked cross-entropy on the training conversations than the initial model (HF's own);
- multi-turn GRPO from the SFT model: trajectories of several turns, tool calls and masked tool
  outputs in the saved rollouts; at step 1 the actor's log-probs of the policy's tokens equal the
  engines' (the tool tokens are left out by the loss mask).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.controller.run import GRACE_ENV, grace_warning
from tests.megarl.test_trainer import _kill_session, _metrics

ROOT = Path(__file__).resolve().parents[2]


def _megarl(command: str, config: str, overrides: dict, timeout_s: float = 600, faults: str = "",
            env: dict | None = None) -> tuple[int, str]:
    args = [sys.executable, "-m", "megarl.cli", command, str(ROOT / config)] + [f"{k}={v}" for k, v in overrides.items()]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "MEGARL_FAULTS": faults, **(env or {})})
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    finally:
        _kill_session(proc.pid)
    return proc.returncode, output


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    from megarl.data.prepare import write_synthetic_chat

    root = tmp_path_factory.mktemp("sft")
    write_synthetic_chat(root / "train.jsonl", 400, seed=0)
    overrides = {"data.train_files": f"[{root / 'train.jsonl'}]", "trainer.output_dir": str(root / "out"),
                 "trainer.loggers": "[console]", "trainer.total_steps": 24, "trainer.save_every": 12}
    code, failed = _megarl("sft", "configs/sft_chat_arith.yaml", overrides, faults="checkpoint_enospc@24")
    code_after_failure, failed_steps = code, _metrics(root / "out")
    # the same command, resumed, as the Slurm script runs it with a (here absurdly short) SIGTERM grace
    code, output = _megarl("sft", "configs/sft_chat_arith.yaml", overrides, env={GRACE_ENV: "0.01"})
    assert code == 0, output[-3000:]
    return root, (code_after_failure, failed, failed_steps), output


def _hf_masked_nll(model_dir: str, conversations: str) -> float:
    """HF transformers' cross-entropy over the assistant tokens of the first 64 conversations."""
    from transformers import AutoModelForCausalLM

    from megarl.data.chat import ChatDataset, collate_chat
    from model_specs.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    batch = collate_chat(list(ChatDataset(conversations, tokenizer))[:64])
    labels = batch["input_ids"][:, 1:].clone()
    labels[batch["loss_mask"] == 0] = -100
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits[:, :-1]
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))


def test_sft_survives_a_failed_save_and_resumes_exactly(sft_run):
    root, (code, failed, failed_steps), resumed = sft_run
    checkpoints = root / "out" / "checkpoints"
    assert code == 2, failed[-3000:]
    assert (f"saving {checkpoints / 'step_000024'} failed ([Errno 28] No space left on device" in failed
            and f"the newest complete checkpoint, {checkpoints / 'step_000012'}, is intact" in failed), failed[-3000:]
    assert "resumed from" in resumed and "(step 12)" in resumed, resumed[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000012", "step_000024"]  # no partial left
    # The failed run logged steps 1-24; the resumed run replaced 13-24 (every step in the file once)
    # with the same values: the resume is exact.
    assert [m["step"] for m in failed_steps] == list(range(1, 25))
    steps = _metrics(root / "out")
    assert [m["step"] for m in steps] == list(range(1, 25))
    assert [m["actor/nll"] for m in steps[12:]] == pytest.approx([m["actor/nll"] for m in failed_steps[12:]], rel=1e-5)


def test_a_step_and_save_outlasting_the_sigterm_grace_is_warned_of_once(sft_run):
    _, _, resumed = sft_run
    warnings = [line for line in resumed.splitlines() if "WARNING: a step" in line]
    assert len(warnings) == 1 and f"of the 0.01 s a preempted driver gets after SIGTERM ({GRACE_ENV})" in warnings[0]


def test_the_grace_warning_keeps_a_quarter_of_the_grace_to_spare():
    assert grace_warning(300, 150, None) is None  # not under the Slurm script
    assert grace_warning(300, 150, "600") is None  # 450 s = 3/4 of 600
    warning = grace_warning(300, 151, "600")
    assert "take 451 s, more than 3/4 of the 600 s" in warning and "above 601 s" in warning


def test_sft_loss_falls_and_the_export_loads(sft_run):
    root, _, _ = sft_run
    nll = [m["actor/nll"] for m in _metrics(root / "out")][:24]
    assert sum(nll[-3:]) / 3 < 0.6 * sum(nll[:3]) / 3, nll
    before = _hf_masked_nll(str(root / "out" / "initial_model"), str(root / "train.jsonl"))
    after = _hf_masked_nll(str(root / "out" / "hf_final"), str(root / "train.jsonl"))
    assert after < 0.6 * before, (before, after)
    assert abs(after - nll[-1]) < 0.3, (after, nll[-1])  # the exported weights are the trained ones


def test_multi_turn_grpo_from_the_sft_model_has_tool_calls_and_matching_logprobs(sft_run, arith_prompts, tmp_path):
    from model_specs.tokenizer import char_tokenizer

    root, _, _ = sft_run
    newline = char_tokenizer().convert_tokens_to_ids("\n")  # the char chat template's end of turn
    overrides = {"model.path": str(root / "out" / "hf_final"), "data.train_files": f"[{arith_prompts(400)}]",
                 "data.prompt_template": "null", "trainer.output_dir": str(tmp_path / "grpo"),
                 "trainer.loggers": "[console]", "trainer.total_steps": 2, "trainer.save_every": 0,
                 "trainer.save_rollouts_every": 1, "data.batch_size": 4, "rollout.n": 4,
                 "rollout.max_new_tokens": 4, "rollout.stop_token_ids": f"[{newline}]",
                 "imports": "[tests.megarl.agent.first_digit_calls]", "rollout.multi_turn.enabled": "true",
                 "rollout.multi_turn.tools": "[calculator]", "rollout.multi_turn.tool_format": "first_digit",
                 "rollout.multi_turn.max_turns": 3, "rollout.multi_turn.max_total_tokens": 40}
    code, output = _megarl("train", "configs/quickstart_grpo.yaml", overrides)
    assert code == 0, output[-3000:]
    steps = _metrics(tmp_path / "grpo")
    assert steps[0]["multi_turn/turns_mean"] > 1.0 and steps[0]["multi_turn/tools/calls"] > 0, steps[0]
    mismatch = {key: steps[0][f"actor/mismatch/{key}"] for key in ("abs_logp_diff", "kl_k3", "outside_bounds")}
    assert mismatch["abs_logp_diff"] < 0.01 and mismatch["kl_k3"] < 1e-4 and mismatch["outside_bounds"] == 0, mismatch
    rollouts = [json.loads(line) for line in (tmp_path / "grpo" / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    called = [r for r in rollouts if r["tool_calls"]]
    assert called, rollouts[:2]
    for r in called:
        call = r["tool_calls"][0]
        assert call["name"] == "calculator" and call["output"] == str(int(call["arguments"]["expression"][0]) + 1)
        assert 0 in r["loss_mask"] and r["loss_mask"][0] == 1  # the policy's first turn, then a tool output
        assert f"<tool>{call['output']}\n<assistant>" in char_tokenizer().decode(r["response_ids"])
