"""Reproducible sampling with the real SGLang engine: after ``SGLangEngine.reseed(s)`` the same
requests sample the same tokens (and log-probs), on the same engine and on a freshly started one,
which is what resuming an RL run needs.

Two engines, one after the other: the first runs every call on it inside a module fixture and is
shut down before the second (the "resumed" one) starts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megarl.rollout import SGLangEngine
from megarl.rollout.engine_worker import engine_shares, prefill_shared_prompts
from megarl.rollout.sglang.engine import SITE_DIR
from model_specs.presets import PRESETS

SEED = 1234
N_PROMPTS, NEW_TOKENS = 16, 8
SAMPLES_PER_PROMPT = 4  # the rollout.n copies of each prompt in the prefix-cache check
SAMPLING = {"temperature": 1.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
ENGINE_KW = dict(tp_size=1, startup_timeout_s=240, call_timeout_s=120)
# The first token of one prompt, drawn many times at a low temperature (a peaked distribution).
FIRST_TOKEN_TEMPERATURE, FIRST_TOKEN_DRAWS, FIRST_TOKEN_CALLS = 0.05, 500, 5
FIRST_TOKEN_SAMPLING = {"temperature": FIRST_TOKEN_TEMPERATURE, "max_new_tokens": 1, "ignore_eos": True}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    vocab = PRESETS["tiny-qwen2"]["vocab_size"]
    return [torch.randint(1, vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(3, 12, (N_PROMPTS,), generator=gen)]


def _sample(engine: SGLangEngine) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(_prompts(), SAMPLING, return_logprob=True)
    assert [len(o["output_ids"]) for o in outs] == [NEW_TOKENS] * N_PROMPTS
    return [(o["output_ids"], o["output_logprobs"]) for o in outs]


def _tokens(run):
    return [ids for ids, _ in run]


@pytest.fixture(scope="module")
def model_dir(tiny_hf_model):
    return tiny_hf_model("tiny-qwen2")


@pytest.fixture(scope="module")
def first_engine_runs(model_dir):
    """On one engine, then shut down: reseed(SEED) -> A, no reseed -> B, reseed(SEED) -> C,
    reseed(SEED + 1) -> D."""
    with SGLangEngine(model_dir, **ENGINE_KW) as eng:
        for bad in (-1, 2**32, 1.0, True):
            with pytest.raises(ValueError, match="seed must be an integer"):
                eng.reseed(bad)
        eng.reseed(SEED)
        a = _sample(eng)
        b = _sample(eng)
        eng.reseed(SEED)
        c = _sample(eng)
        eng.reseed(SEED + 1)
        d = _sample(eng)
        first = [eng.generate([_prompts()[0]] * FIRST_TOKEN_DRAWS, FIRST_TOKEN_SAMPLING)
                 for _ in range(FIRST_TOKEN_CALLS)]
        repeated = [p for p in _prompts() for _ in range(SAMPLES_PER_PROMPT)]
        eng.reseed(SEED)
        cold = eng.generate(repeated, SAMPLING, return_logprob=True)
        eng.reseed(SEED)
        prefilled = prefill_shared_prompts(eng, repeated)
        warm = eng.generate(repeated, SAMPLING, return_logprob=True)
    return {"A": a, "B": b, "C": c, "D": d, "first_tokens": [o["output_ids"][0] for call in first for o in call],
            "repeated": repeated, "cold": cold, "warm": warm, "prefilled": prefilled}


@pytest.mark.timeout(400)
def test_sampling_is_random_without_reseed(first_engine_runs):
    """Negative control: the RNG moves on between calls, so the same requests sample differently
    (and the tiny random model's distributions are wide enough for that to show)."""
    a, b = _tokens(first_engine_runs["A"]), _tokens(first_engine_runs["B"])
    assert sum(x != y for x, y in zip(a, b)) >= N_PROMPTS // 2, (a, b)


@pytest.mark.timeout(400)
def test_samples_follow_hf_next_token_distribution(model_dir, first_engine_runs):
    """The engine's sampler (megarl's inverse-CDF patch) draws from HF transformers' softmax of
    the last logits at that temperature: every token's frequency within 5 standard errors."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([_prompts()[0]])).logits[0, -1].double()
    p = torch.softmax(logits / FIRST_TOKEN_TEMPERATURE, -1)
    draws = len(first_engine_runs["first_tokens"])
    frequencies = torch.bincount(torch.tensor(first_engine_runs["first_tokens"]), minlength=len(p)).double() / draws
    assert p.max() > 0.05, "the distribution is too flat for this check to see a wrong sampler"
    bound = 5 * (p * (1 - p) / draws).sqrt() + 1.0 / draws
    assert ((frequencies - p).abs() <= bound).all(), ((frequencies - p).abs() - bound).max()


@pytest.mark.timeout(400)
def test_reseed_replays_on_the_same_engine(first_engine_runs):
    assert first_engine_runs["C"] == first_engine_runs["A"]  # tokens and log-probs, exactly


@pytest.mark.timeout(400)
def test_other_seed_samples_differently(first_engine_runs):
    a, d = _tokens(first_engine_runs["A"]), _tokens(first_engine_runs["D"])
    assert sum(x != y for x, y in zip(a, d)) >= N_PROMPTS // 2, (a, d)


@pytest.mark.timeout(400)
def test_prefilled_prompts_sample_the_same_tokens_from_the_cache(first_engine_runs):
    """``prefill_shared_prompts`` (what a rollout does before generating ``n`` samples per prompt):
    every sample then takes all but its prompt's last token from the prefix cache, where one
    batch of copies shares nothing (the control), and samples exactly what it samples without."""
    runs = first_engine_runs
    assert runs["prefilled"] == N_PROMPTS
    assert [o["cached_tokens"] for o in runs["cold"]] == [0] * len(runs["repeated"])
    assert [o["cached_tokens"] for o in runs["warm"]] == [len(p) - 1 for p in runs["repeated"]]
    assert [o["output_ids"] for o in runs["warm"]] == [o["output_ids"] for o in runs["cold"]]
    gap = max(abs(x - y) for w, c in zip(runs["warm"], runs["cold"])
              for x, y in zip(w["output_logprobs"], c["output_logprobs"]))
    assert gap < 1e-5, gap


@pytest.mark.parametrize("prompts, n, engines", [(16, 8, 2), (10, 8, 4), (3, 8, 4), (5, 1, 2), (7, 16, 8)])
def test_each_prompt_is_prefilled_by_as_few_engines_as_balance_allows(prompts, n, engines):
    """The samples of a step (``n`` consecutive copies of each prompt) dealt to engines: every
    sample exactly once, shares within one sample of each other, and each prompt's copies on one
    engine except where a share must end inside them, so the prefills (one per prompt and engine
    holding it) number at most prompts + engines - 1, not prompts * min(n, engines)."""
    shares = engine_shares(prompts * n, engines)
    assert sorted(i for share in shares for i in share) == list(range(prompts * n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    prefills = sum(len({i // n for i in share}) for share in shares)
    assert prefills <= prompts + engines - 1


@pytest.mark.timeout(400)
def test_reseed_replays_on_a_fresh_engine(model_dir, first_engine_runs):
    """The resume case: a new engine (started with another random_seed, which reseed overrides)
    reseeded with SEED samples exactly what the first engine sampled after reseed(SEED)."""
    with SGLangEngine(model_dir, random_seed=987, **ENGINE_KW) as eng:
        eng.reseed(SEED)
        assert _sample(eng) == first_engine_runs["A"]


@pytest.mark.timeout(60)
def test_sitecustomize_runs_the_one_it_shadows(tmp_path):
    """SITE_DIR first on PYTHONPATH must not disable another sitecustomize further down the path;
    with neither hook variable set, it imports nothing of megarl."""
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_SITECUSTOMIZE = True\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGARL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), str(tmp_path)])
    code = ("import builtins, sys; print(getattr(builtins, 'OTHER_SITECUSTOMIZE', False), "
            "any(m.startswith(('megarl', 'parallel')) for m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "False"]


def test_reseed_error_names_the_missing_patch():
    """Without the scheduler patch the RPC fails; the message says what is missing (engine-side
    helper driven with a stand-in for collective_rpc)."""
    from megarl.rollout.sglang import engine_process

    class NoPatch:
        def collective_rpc(self, method, **kwargs):
            raise AssertionError(f"'Scheduler' object has no attribute '{method}'")

    with pytest.raises(RuntimeError, match="MEGARL_SGLANG_SCHEDULER_PATCH=1"):
        engine_process._do_reseed(NoPatch(), 1)
