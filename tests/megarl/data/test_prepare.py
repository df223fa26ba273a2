import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.data import prepare
from megarl.data.dataset import PromptDataset, PromptLoader
from megarl.data.io import read_records
from megarl.rewards import compute_rewards

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "prepare_data.py"

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 and a bike $300. Total?", "answer": "1200 + 300 = 1500\n#### 1,500"},
]
MATH_ROWS = [
    {"problem": "What is $\\frac{2}{4}$?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1", "type": "Algebra"},
    {"problem": "Solve $x+1=3$.", "solution": "So $x = \\boxed{2}$."},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _load_tool():
    spec = importlib.util.spec_from_file_location("prepare_data_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gsm8k_and_math_records():
    rec = prepare.gsm8k_record(GSM8K_ROWS[1], 1, split="test")
    assert rec["data_source"] == "openai/gsm8k"
    assert rec["reward_model"]["ground_truth"] == "1500"
    assert rec["prompt"][0]["role"] == "user" and rec["prompt"][0]["content"].endswith('after "####".')
    assert rec["extra_info"]["split"] == "test" and rec["extra_info"]["index"] == 1
    rec = prepare.math_record(MATH_ROWS[0], 0)
    assert rec["data_source"] == "lighteval/MATH" and rec["reward_model"]["ground_truth"] == "\\frac{1}{2}"
    assert rec["extra_info"]["level"] == "Level 1"
    with pytest.raises(ValueError, match=r"f.jsonl:row 3: the MATH solution has no \\boxed"):
        prepare.math_record({"problem": "p", "solution": "no box"}, 0, origin="f.jsonl:row 3")
    with pytest.raises(ValueError, match="GSM8K rows need a 'answer' field"):
        prepare.gsm8k_record({"question": "q"}, 0)


def test_synthetic_records_are_deterministic():
    a = prepare.synthetic_arith_records(20, seed=4, partial_credit_scale=3)
    assert a == prepare.synthetic_arith_records(20, seed=4, partial_credit_scale=3)
    assert a != prepare.synthetic_arith_records(20, seed=5, partial_credit_scale=3)
    for r in a:
        x, y = r["prompt"].rstrip("=").split("+")
        assert r["reward_model"]["ground_truth"] == str(int(x) + int(y))
        assert r["extra_info"]["partial_credit_scale"] == 3.0 and r["data_source"] == "synthetic_arith"


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_tool_gsm8k_and_math_end_to_end(tmp_path, suffix, char_tokenizer):
    tool = _load_tool()
    gsm_in = _jsonl(tmp_path / "gsm.jsonl", GSM8K_ROWS)
    math_in = _jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    gsm_out, math_out = tmp_path / f"out/gsm{suffix}", tmp_path / f"out/math{suffix}"
    assert tool.main(["gsm8k", "--input", str(gsm_in), "--output", str(gsm_out), "--split", "test"]) == 0
    assert tool.main(["math", "--input", str(math_in), "--output", str(math_out)]) == 0
    ds = PromptDataset([gsm_out, math_out], char_tokenizer)
    assert [s.ground_truth for s in ds] == ["7", "1500", "\\frac{1}{2}", "2"]
    assert [s.data_source for s in ds] == ["openai/gsm8k"] * 2 + ["lighteval/MATH"] * 2
    assert ds[0].text.startswith("<user>Tom has 3 apples") and ds[0].extra_info["split"] == "test"
    # the references themselves score 1.0 under the rewards the data sources pick
    responses = ["#### 7", "#### 1,500", "$\\boxed{0.5}$", "\\boxed{2}"]
    scores, _ = compute_rewards([s.data_source for s in ds], responses, [s.ground_truth for s in ds])
    assert scores.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_tool_reports_bad_input(tmp_path, capsys):
    tool = _load_tool()
    bad = _jsonl(tmp_path / "bad.jsonl", GSM8K_ROWS + [{"question": "q", "answer": "no final answer"}])
    out = tmp_path / "o.jsonl"
    assert tool.main(["gsm8k", "--input", str(bad), "--output", str(out)]) == 2
    assert "bad.jsonl:row 2" in capsys.readouterr().err and not out.exists()
    assert tool.main(["gsm8k", "--input", str(bad), "--output", str(out), "--skip-invalid"]) == 0
    assert len(read_records(out)) == 2 and "1 invalid rows skipped" in capsys.readouterr().out
    assert tool.main(["math", "--input", str(tmp_path / "nope.jsonl"), "--output", str(out)]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_tool_synthetic_arith_as_a_command(tmp_path, char_tokenizer):
    out = tmp_path / "arith.parquet"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "synthetic-arith", "--output", str(out), "--num", "12", "--seed", "3",
         "--partial-credit-scale", "4"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 12 prompts" in proc.stdout
    rows = read_records(out)
    assert rows == prepare.synthetic_arith_records(12, seed=3, partial_credit_scale=4)
    ds = PromptDataset(out, char_tokenizer, prompt_template="{prompt}")
    batch = PromptLoader(ds, batch_size=4, seed=0).next_batch()
    answers = [str(int(p.split("+")[0]) + int(p.rstrip("=").split("+")[1])) for p in batch["raw_prompt"]]
    assert batch["ground_truth"] == answers and all(len(a) == 1 for a in answers)
    # a near miss earns partial credit through extra_info
    near = [str(int(a) + 1) for a in answers]
    scores, _ = compute_rewards(batch["data_source"], near, batch["ground_truth"], batch["extra_info"])
    assert scores.tolist() == [0.75] * 4
