"""HF <-> Megatron conversion at every layout, against HF transformers and the source files.

Oracles: the source safetensors (the round trip must be bit-exact, every tensor, config.json
preserved) and HF transformers' own forward pass (the Megatron model built from the converted
weights must give the same logits, fp32 atol 1e-5).
"""

import json
from pathlib import Path

import pytest
import torch

from model_specs.presets import hf_config_dict
from parallel.checkpoint.hf_io import HFCheckpoint
from parallel.spawn import run_on_ranks
from tests.parallel.checkpoint import rank_fns

LAYOUTS = {
    "tp1": ({}, 1),
    "tp2": ({"tp": 2}, 2),
    "pp2": ({"pp": 2}, 2),
    "tp2_pp2": ({"tp": 2, "pp": 2}, 4),
    "pp2_vpp2": ({"pp": 2, "vpp": 2}, 2),
    "tp4": ({"tp": 4}, 4),
    "cp2": ({"cp": 2}, 2),
    "cp2_tp2": ({"cp": 2, "tp": 2}, 4),
}
# Each family, tied and untied, vocab with and without padding, 1/2/4 KV heads. A model takes
# the layouts whose TP divides its KV heads (megatron's rule).
MODELS = {
    "tiny-llama": {},
    "tiny-llama-tied": {},
    "tiny-qwen2": {},  # one KV head: TP=1 layouts only
    "tiny-qwen2-tied-kv2": {"num_key_value_heads": 2},
    "tiny-qwen2-untied": {},
    "tiny-llama-mha": {"num_key_value_heads": 4},  # 4 KV heads: TP=4 is possible
    "tiny-qwen3": {},
    "tiny-mistral": {},
}


def _preset(model):
    return model.removesuffix("-mha").removesuffix("-tied-kv2")


def _read_all(path):
    return HFCheckpoint(path, check_tensors=False).read_all()


TOKENS = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def sources(tiny_hf_model):
    """model name -> (HF checkpoint dir, HF transformers logits on TOKENS)."""
    from transformers import AutoModelForCausalLM

    made = {}
    for model, overrides in MODELS.items():
        path = Path(tiny_hf_model(_preset(model), seed=11, **overrides))
        hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            made[model] = (path, hf_model(TOKENS).logits)
    return made


def _supports(model, layout_kwargs):
    kv_heads = hf_config_dict(_preset(model), **MODELS[model])["num_key_value_heads"]
    return kv_heads % layout_kwargs.get("tp", 1) == 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_roundtrip_is_bit_exact_and_logits_match_hf(sources, layout):
    layout_kwargs, world = LAYOUTS[layout]
    models = [m for m in MODELS if _supports(m, layout_kwargs)]
    jobs = [(str(sources[m][0]), str(sources[m][0].parent / f"export-{layout}")) for m in models]
    per_rank = run_on_ranks(rank_fns.convert_roundtrip, world, jobs, layout_kwargs, TOKENS, timeout_s=300)
    for index, model in enumerate(models):
        source, hf_logits = sources[model]
        export = source.parent / f"export-{layout}"
        original, exported = _read_all(source), _read_all(export)
        assert sorted(exported) == sorted(original), model
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), f"{model}: {name}"
        source_config = json.loads((source / "config.json").read_text())
        exported_config = json.loads((export / "config.json").read_text())
        for key, value in source_config.items():
            assert exported_config[key] == value, f"{model}: config.json {key}"
        logits = next(rank[index] for rank in per_rank if rank[index] is not None)
        torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=1e-5, msg=lambda m: f"{model}: {m}")


@pytest.mark.parametrize("save_layout, load_layout", [("tp2_pp2", "tp1"), ("tp1", "tp2_pp2"), ("tp2", "pp2_vpp2")])
def test_megatron_checkpoint_loads_at_another_layout_with_identical_logits(sources, tmp_path, save_layout, load_layout):
    source = str(sources["tiny-llama"][0])
    ckpt = str(tmp_path / "ckpt")
    (save_kwargs, save_world), (load_kwargs, load_world) = LAYOUTS[save_layout], LAYOUTS[load_layout]
    saved = run_on_ranks(rank_fns.checkpoint_logits, save_world, source, ckpt, save_kwargs, TOKENS, timeout_s=240)
    loaded = run_on_ranks(rank_fns.checkpoint_logits, load_world, None, ckpt, load_kwargs, TOKENS, timeout_s=240)
    saved_logits = next(x for x in saved if x is not None)
    loaded_logits = next(x for x in loaded if x is not None)
    torch.testing.assert_close(loaded_logits, saved_logits, atol=1e-6, rtol=0)


def test_logit_probe_catches_an_error_that_grows_with_position(tiny_hf_model, tmp_path):
    """RoPE with another base in the Megatron model than in HF's: the stored hf_config of a correct
    conversion given rope_theta 10000 -> 11000, as a converter that misread a RoPE parameter
    would write it. q and k are rotated by slightly other angles, an error that is zero at
    position 0 and grows with position (as a dropped RoPE scaling does): over the first 8
    positions (the old probe's length) it stays below the tolerance, over 256 it is caught."""
    hf_dir = tiny_hf_model("tiny-llama", seed=6)
    ckpt = tmp_path / "mg"
    run_on_ranks(rank_fns.convert, 1, "hf-to-megatron", hf_dir, str(ckpt), {}, False, timeout_s=240)
    assert run_on_ranks(rank_fns.logit_probe, 1, str(ckpt), hf_dir, {}, timeout_s=240)[0].startswith(
        "logit probe passed over 256 positions")
    meta_file = ckpt / "megarl_checkpoint.json"
    meta = json.loads(meta_file.read_text())
    meta["hf_config"]["rope_parameters"]["rope_theta"] = 11000.0
    meta_file.write_text(json.dumps(meta))
    short = run_on_ranks(rank_fns.logit_probe, 1, str(ckpt), hf_dir, {}, positions=8, timeout_s=240)[0]
    assert short.startswith("logit probe passed over 8 positions"), short
    result = run_on_ranks(rank_fns.logit_probe, 2, str(ckpt), hf_dir, {"pp": 2}, timeout_s=240)[-1]
    assert result.startswith("FAILED: logit probe failed over 256 positions"), result
