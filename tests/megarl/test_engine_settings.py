"""What every SGLang engine of a run is started with (``engine_settings``): dummy weights, SGLang's
memory saver only where colocated engines share GPUs with Megatron, and the start-up and call
deadlines, configured or derived from the model's parameter count and ``rollout.max_new_tokens``
(the formula of docs/rollout.md, whose worked example is checked here). And a run's engines,
started so, sample their first step with the actor's weights: the controller syncs them once
before the first generation.
"""

import pytest

from megarl.config import CONFIGS_DIR, ConfigError, compose, from_dict, load_config
from megarl.controller.rollout_manager import engine_settings
from megarl.rollout.engine_worker import engine_timeouts
from model_specs.arithmetic import total_parameters
from model_specs.presets import PRESETS
from tests.megarl.test_trainer import _metrics, _overrides, _run

QUICKSTART = CONFIGS_DIR / "quickstart_grpo.yaml"


def _config(**overrides):
    return from_dict(compose(QUICKSTART, [f"{key}={value}" for key, value in overrides.items()]))


def test_derived_deadlines_are_the_documented_formula():
    """docs/rollout.md: Llama-3 70B (70.55 B parameters) with 16k new tokens gets 953 s to start
    and 3713 s per call; a tiny model with 32 new tokens gets the bases, 600 s and 302 s."""
    start, call = engine_timeouts(total_parameters(PRESETS["llama3-70b"]), 16384)
    assert (round(start), round(call)) == (953, 3713)
    start, call = engine_timeouts(total_parameters(PRESETS["tiny-qwen2"]), 32)
    assert (round(start), round(call)) == (600, 302)
    bigger, longer = engine_timeouts(2 * 10**11, 1024), engine_timeouts(10**11, 2048)
    base = engine_timeouts(10**11, 1024)
    assert bigger[0] > base[0] and bigger[1] > base[1] and longer[0] == base[0] and longer[1] > base[1]


@pytest.mark.parametrize("device, placement, saver", [("gpu", "colocated", True), ("gpu", "separate", False),
                                                      ("cpu", "colocated", False)])
def test_engines_start_dummy_with_the_memory_saver_only_beside_megatron_on_gpus(device, placement, saver):
    cfg = _config(**{"cluster.gpus_per_node": 8 if device == "gpu" else 0, "rollout.placement": placement,
                     "rollout.max_new_tokens": 64})
    assert cfg.cluster.device == device
    hf = PRESETS["llama3-70b"]
    settings = engine_settings(cfg, hf)
    assert settings["load_format"] == "dummy" and settings["device"] == {"gpu": "cuda", "cpu": "cpu"}[device]
    assert settings.get("enable_memory_saver", False) is saver
    assert "enable_weights_cpu_backup" not in settings  # every resume of the weights is followed by a full sync
    assert ("mem_fraction_static" in settings) == (device == "gpu")
    assert (settings["startup_timeout_s"], settings["call_timeout_s"]) == engine_timeouts(total_parameters(hf), 64)


def test_configured_deadlines_replace_the_derived_ones_and_nonpositive_ones_are_refused(arith_prompts):
    cfg = _config(**{"rollout.startup_timeout_s": 1200, "rollout.call_timeout_s": 45.5})
    settings = engine_settings(cfg, PRESETS["tiny-qwen2"])
    assert (settings["startup_timeout_s"], settings["call_timeout_s"]) == (1200.0, 45.5)
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, [f"data.train_files=[{arith_prompts(8)}]", "rollout.startup_timeout_s=0",
                                 "rollout.call_timeout_s=-1"])
    assert info.value.problems == [
        "rollout.startup_timeout_s=0.0: must be > 0; use null (derived from the model) or e.g. 1200",
        "rollout.call_timeout_s=-1.0: must be > 0; use null (derived from the model and max_new_tokens) or e.g. 1800"]


@pytest.mark.timeout(600)
def test_a_fresh_runs_dummy_engines_sample_step_one_with_the_actors_weights(arith_prompts, tmp_path):
    """One CPU rank and engine, two mini-batches (so the actor recomputes the pre-update
    log-probs): at step 1 the engine's log-probs of its samples equal the actor's, which they
    could not with the dummy weights it started with; the engine got the configured deadlines."""
    settings = {"cluster.cpu_ranks_per_node": 1, "trainer.total_steps": 1, "trainer.save_every": 0,
                "data.batch_size": 2, "rollout.n": 2, "actor.mini_batch_size": 1, "actor.micro_batch_size": 2,
                "ref.micro_batch_size": 4, "rollout.startup_timeout_s": 500, "rollout.call_timeout_s": 250}
    code, output = _run(_overrides(arith_prompts(8), tmp_path / "run", **settings), timeout_s=500)
    assert code == 0, output[-3000:]
    assert "1 SGLang engine(s) of TP=1 colocated" in output and "deadlines: start 500 s, call 250 s" in output, \
        output[-3000:]
    [step] = _metrics(tmp_path / "run")
    mismatch = {key: step[f"actor/mismatch/{key}"] for key in ("abs_logp_diff", "kl_k3", "outside_bounds")}
    assert mismatch["abs_logp_diff"] < 1e-3 and mismatch["kl_k3"] < 1e-6 and mismatch["outside_bounds"] == 0, mismatch
