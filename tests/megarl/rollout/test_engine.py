"""The real SGLang engine on CPU: greedy output equals HF transformers', token for token, also
after a direct per-rank weight update.

Engines run in their own process group (megarl.rollout.sglang.engine.SGLangEngine), so a crashing engine is a
failing test, never a dead pytest. One engine runs at a time (module-scoped, parametrised fixture).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from megarl.rollout import EngineDiedError, EngineTimeoutError, SGLangEngine, weight_checksum
from megarl.rollout.sglang.engine import child_env
from megarl.rollout.sglang.transport import serialize_rank_tensors
from model_specs.presets import PRESETS
from tests.megarl.rollout import sglang_probe
from tests.processes import live, live_descendants
from tests.sglang_oracle import sglang_all_rank_parameters, sglang_oracle_batch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-path tests")

NEW_TOKENS = 12
PROMPT_LENGTHS = (4, 7, 11)


@pytest.fixture(scope="module")
def model_dirs(tiny_hf_model):
    return {p: tiny_hf_model(p) for p in ("tiny-llama", "tiny-qwen2")}


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """HF transformers' greedy continuation (EOS ignored) and the log-prob of each new token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 eos_token_id=None, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            ids = out.sequences[0, len(prompt):].tolist()
            logps = [torch.log_softmax(step[0].float(), -1)[tok].item() for step, tok in zip(out.logits, ids)]
            results.append((ids, logps))
    return results


def _engine_leftovers(pgid: int, descendants: bool = True) -> list[psutil.Process]:
    """Live processes of the engine's process group, plus (``descendants``) live descendants of
    this process: False where another engine of the test module still runs."""
    in_group = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                in_group.append(p)
        except (OSError, psutil.Error):
            pass
    return live(in_group) + (live_descendants() if descendants else [])


# --------------------------------------------------------------------------- stubs


@pytest.mark.timeout(60)
def test_sgl_kernel_stub_raises_when_called():
    """In a fresh interpreter started with child_env(): the sitecustomize installs the stubs;
    imports and attribute access work, calls raise naming the function."""
    code = textwrap.dedent("""
        import sys
        from sgl_kernel import silu_and_mul
        from sgl_kernel.scalar_type import scalar_types
        from torchvision.transforms import InterpolationMode
        import torchvision.transforms.v2.functional
        from megarl.rollout.sglang.cpu.stubs import StubCalledError, is_stub
        assert is_stub(sys.modules["sgl_kernel"]) and is_stub(sys.modules["torchvision"])
        assert InterpolationMode.NEAREST_EXACT == InterpolationMode.NEAREST_EXACT
        scalar_types.uint4b8  # attribute chains resolve at import time
        for fn in (silu_and_mul, scalar_types.uint4b8):
            try:
                fn(1, 2)
            except StubCalledError as e:
                print("RAISED", e)
            else:
                raise SystemExit("stub did not raise")
        try:
            InterpolationMode()
        except StubCalledError as e:
            print("RAISED", e)
    """)
    res = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True,
                         timeout=50)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("RAISED")]
    assert len(lines) == 3
    assert "sgl_kernel.silu_and_mul()" in lines[0]
    assert "sgl_kernel.scalar_type.scalar_types.uint4b8()" in lines[1]
    # Without MEGARL_CPU_STUBS nothing is installed.
    env = {k: v for k, v in child_env().items() if k != "MEGARL_CPU_STUBS"}
    res = subprocess.run([sys.executable, "-c", "import sgl_kernel"], env=env, capture_output=True,
                         text=True, timeout=50)
    assert res.returncode != 0 and "No module named 'sgl_kernel'" in res.stderr


@pytest.mark.timeout(120)
def test_triton_stub_lets_sglang_import():
    """Where triton is not installed, the stub must carry SGLang's (and inductor's) import-time use
    of it. Shadow the installed triton to prove it."""
    code = textwrap.dedent("""
        import sys
        import sglang.srt.entrypoints.engine, sglang.srt.models.llama, sglang.srt.models.qwen2
        import sglang.srt.layers.attention.torch_native_backend
        from megarl.rollout.sglang.cpu.stubs import is_stub
        import triton
        assert is_stub(triton), triton
        try:
            triton.runtime.driver.active
        except RuntimeError as e:
            print("NO DRIVER", e)
    """)
    env = child_env(override=("triton",))
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "NO DRIVER" in res.stdout


# --------------------------------------------------------------------------- isolation


@pytest.mark.timeout(300)
def test_killed_scheduler_raises_engine_died_and_leaves_nothing(model_dirs):
    """SGLang kills its own parent when a scheduler dies; that parent is the handle's child, so the
    caller gets EngineDiedError and pytest lives on."""
    eng = SGLangEngine(model_dirs["tiny-llama"], tp_size=1, startup_timeout_s=240, call_timeout_s=90)
    try:
        schedulers = [p for p in psutil.Process(eng.pid).children(recursive=True) if "scheduler" in p.name()]
        assert schedulers, psutil.Process(eng.pid).children(recursive=True)
        schedulers[0].kill()
        with pytest.raises(EngineDiedError) as err:
            eng.generate([[1, 2, 3]], {"temperature": 0.0, "max_new_tokens": 4})
        assert not isinstance(err.value, EngineTimeoutError)
        assert err.value.exitcode is not None and err.value.log_tail
    finally:
        eng.shutdown()
    assert _engine_leftovers(eng.pid) == []


@pytest.mark.timeout(120)
def test_bad_model_raises_engine_died(tmp_path):
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(EngineDiedError) as err:
        SGLangEngine(str(bad), startup_timeout_s=100)
    assert "no-such-model" in str(err.value)
    assert _engine_leftovers(err.value.pid) == []


@pytest.mark.timeout(120)
def test_startup_timeout_kills_the_engine(model_dirs):
    with pytest.raises(EngineTimeoutError) as err:
        SGLangEngine(model_dirs["tiny-llama"], startup_timeout_s=3)
    assert _engine_leftovers(err.value.pid) == []


@pytest.mark.timeout(120)
def test_owner_death_kills_the_engine(model_dirs, tmp_path):
    """If the process holding the handle dies (SIGKILL: no cleanup runs), the engine process group
    kills itself (within about a second) instead of living on."""
    owner = subprocess.Popen([sys.executable, "-c", "import sys; from megarl.rollout import SGLangEngine; "
                              "SGLangEngine(sys.argv[1], startup_timeout_s=100)", model_dirs["tiny-llama"]],
                             cwd=Path(__file__).resolve().parents[3],  # the repository root
                             env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        deadline = time.monotonic() + 60
        while not psutil.Process(owner.pid).children() and time.monotonic() < deadline:
            time.sleep(0.1)
        engine_pid = psutil.Process(owner.pid).children()[0].pid
        time.sleep(2.0)  # the engine is busy importing SGLang
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 8  # well before the engine would finish starting
    while _engine_leftovers(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _engine_leftovers(engine_pid) == []


# --------------------------------------------------------------------------- weight updates
# One TP=2 engine (class scope: it is gone before the parity engines below start) serving
# tiny-llama seed 0 (untied, vocab 200 padded to 256); updates bring in seed 1 and back. The
# per-rank tensors come from the SGLang oracle (SGLang's own model class loading the checkpoint
# as each rank), not from megarl's layout code.


@pytest.fixture(scope="module")
def second_llama(tiny_hf_model):
    return tiny_hf_model("tiny-llama", seed=1)


def _checksums(per_rank: list[dict[str, torch.Tensor]]) -> list[dict[str, str]]:
    return [{name: weight_checksum(t) for name, t in tensors.items()} for tensors in per_rank]


def test_rank_payload_is_self_contained_and_owns_its_bytes():
    """A payload carries the tensors' data inline (no shared memory, no fds: it crosses any process
    boundary) and only the bytes of each tensor, not the whole storage a slice points into."""
    base = torch.randn(1000, 256)
    tensors = {"rows": base[10:12], "cols": base[:4, 3:5], "whole": torch.arange(6.0)}
    payload = serialize_rank_tensors(tensors)
    assert len(payload) < 8192  # base alone is 1 MB
    decoded = pickle.loads(payload)
    assert [n for n, _ in decoded] == list(tensors)
    for (name, got), want in zip(decoded, tensors.values()):
        assert torch.equal(got, want) and got.is_contiguous(), name
    with pytest.raises(TypeError, match="str -> torch.Tensor"):
        serialize_rank_tensors({"x": [1.0]})


class TestWeightUpdate:
    TP = 2

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def oracle(cls, model_dirs, second_llama):
        """SGLang's loaders' parameters of both checkpoints, from one oracle process (then cached)."""
        sglang_oracle_batch([(model_dirs["tiny-llama"], cls.TP), (second_llama, cls.TP)])

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, model_dirs):
        with SGLangEngine(model_dirs["tiny-llama"], tp_size=cls.TP, startup_timeout_s=240, call_timeout_s=120,
                          custom_weight_loader=[sglang_probe.PROBE]) as eng:
            yield eng
        assert _engine_leftovers(eng.pid) == []

    @pytest.mark.timeout(300)
    def test_direct_update_matches_hf_in_place(self, engine, model_dirs, second_llama, tmp_path):
        first = sglang_all_rank_parameters(model_dirs["tiny-llama"], self.TP)
        second = sglang_all_rank_parameters(second_llama, self.TP)
        # Checksums come from inside each scheduler; every parameter of every rank, nothing else.
        assert engine.rank_parameter_checksums() == _checksums(first)
        pointers = sglang_probe.parameter_pointers(engine, str(tmp_path / "before"))
        assert [set(p) for p in pointers] == [set(r) for r in first]

        start = time.perf_counter()
        with engine.weight_update():
            engine.update_weights_direct(second)
        print(f"one full direct update (tiny-llama, TP={self.TP}): {time.perf_counter() - start:.3f} s")

        assert engine.rank_parameter_checksums() == _checksums(second)
        prompts = _prompts(PRESETS["tiny-llama"]["vocab_size"])
        outs = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
                               return_logprob=True)
        for prompt, out, (hf_ids, hf_logps) in zip(prompts, outs, _hf_greedy(second_llama, prompts)):
            assert out["output_ids"] == hf_ids, f"prompt {prompt}"
            assert out["output_logprobs"] == pytest.approx(hf_logps, abs=1e-4)
        # In place: every parameter of every rank is where it was.
        assert sglang_probe.parameter_pointers(engine, str(tmp_path / "after")) == pointers

        # Back to the first checkpoint in two buckets, flushing the cache only after the last,
        # with the bytes inline in the payloads this time (the fallback of the shared-memory path).
        with engine.weight_update():
            for half in (0, 1):
                engine.update_weights_direct(
                    [{n: t for i, (n, t) in enumerate(r.items()) if i % 2 == half} for r in first],
                    flush_cache=bool(half), via_shared_memory=False)
        assert engine.rank_parameter_checksums() == _checksums(first)

    @pytest.mark.timeout(300)
    def test_bad_updates_fail_before_reaching_sglang(self, engine, model_dirs):
        tensors = sglang_all_rank_parameters(model_dirs["tiny-llama"], self.TP)
        with pytest.raises(RuntimeError, match="inside engine.weight_update"):
            engine.update_weights_direct(tensors)
        with engine.weight_update():
            with pytest.raises(ValueError, match="one dict per TP rank"):
                engine.update_weights_direct(tensors[:1])
            bad = [dict(r) for r in tensors]
            bad[1]["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 64)  # an HF name
            with pytest.raises(ValueError, match=r"TP rank 1 has no parameter\(s\) \['model.layers.0.self_attn.q_proj"):
                engine.update_weights_direct(bad)
        out = engine.generate([[1, 2, 3]], {"temperature": 0.0, "max_new_tokens": 2})  # still serving
        assert len(out[0]["output_ids"]) == 2

    @pytest.mark.timeout(300)
    def test_get_weights_by_name_and_flush_cache(self, engine, second_llama):
        second = sglang_all_rank_parameters(second_llama, self.TP)
        with engine.weight_update():
            engine.update_weights_direct(second)
        hf = load_file(f"{second_llama}/model.safetensors")
        assert engine.get_weights_by_name("model.norm.weight", truncate_size=5) == hf["model.norm.weight"][:5].tolist()
        # rank 0's first rows of the (vocab-parallel) embedding
        assert engine.get_weights_by_name("model.embed_tokens.weight", truncate_size=3) == \
            second[0]["model.embed_tokens.weight"][:3].tolist()
        assert engine.flush_cache() is True


# --------------------------------------------------------------------------- parity with HF
# Last in the file: the module-scoped engine of the final case lives until the module ends, and
# the tests above must not share the machine (or their leftover checks) with it.

# TP=2 engines are compared with HF in test_moe_engine.py (TP2 x EP2) and test_weight_sync.py.
CASES = [("tiny-llama", 1), ("tiny-qwen2", 1)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-tp{tp}" for m, tp in CASES])
def engine_case(request, model_dirs):
    preset, tp = request.param
    with SGLangEngine(model_dirs[preset], tp_size=tp, startup_timeout_s=240, call_timeout_s=120) as eng:
        yield preset, model_dirs[preset], eng
    assert _engine_leftovers(eng.pid) == []


@pytest.mark.timeout(300)
def test_greedy_and_logprobs_match_hf(engine_case):
    preset, model_dir, eng = engine_case
    assert eng.info["cpu_stubs"] and "sgl_kernel" in eng.info["cpu_stubs"]
    prompts = _prompts(PRESETS[preset]["vocab_size"])
    outs = eng.generate(prompts, {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
                        return_logprob=True)
    expected = _hf_greedy(model_dir, prompts)
    for prompt, out, (hf_ids, hf_logps) in zip(prompts, outs, expected):
        assert len(hf_ids) == NEW_TOKENS
        assert out["output_ids"] == hf_ids, f"prompt {prompt}"
        assert out["output_logprobs"] == pytest.approx(hf_logps, abs=1e-4)
