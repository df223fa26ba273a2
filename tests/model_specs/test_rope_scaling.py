"""RoPE scaling (linear, llama3, yarn): every spelling transformers accepts maps onto megatron-core's
own options, converts bit-exactly, gives HF transformers' logits at TP2/PP2/CP2 over 512 positions
and SGLang's greedy tokens; dynamic, longrope and unknown variants are refused.

Oracles: HF transformers' forward pass and the source files (as in
tests/parallel/checkpoint/test_conversion.py). The tiny models' scaling is chosen so that it changes
the logits at their head_dim 16; every case also checks that the same weights with unscaled RoPE
give other logits, so a scaling that is silently dropped fails.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from model_specs import UnsupportedModelError, family_for
from model_specs.base import rope_parameters
from model_specs.presets import hf_config_dict
from parallel.checkpoint.hf_io import HFCheckpoint
from parallel.spawn import run_on_ranks
from tests.model_specs import rank_fns as model_rank_fns
from tests.parallel.checkpoint import rank_fns

MAX_POSITIONS = 1024
SEQ = 512
# Weights drawn with std 0.05 instead of the presets' 0.02: sharper attention, so the RoPE scaling
# moves the logits by 1e-2 or more (at 0.02 Llama 3.1's scaling moved them by 5e-4 only, and the
# greedy log-probs by under 1e-4).
INIT_STD = 0.05
# name -> (preset, HF rope parameters, spelling of config.json). "t5": transformers 5's
# rope_parameters (what save_pretrained writes); "t4": transformers 4's rope_scaling with the
# legacy key "type" and rope_theta at the top level (how Qwen2.5's released config.json has it).
MODELS = {
    # llama3 with non-default frequency factors and original context (megatron-core hard-codes
    # 1/4/8192; parallel.models re-runs its _apply_scaling with these).
    "llama3": ("tiny-llama", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 2.0, "original_max_position_embeddings": 256}, "t5"),
    # Llama 3.1/3.3's exact RoPE (megatron-core's built-in llama3 scaling).
    "llama3.1": ("tiny-llama-tied", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}, "t5"),
    # Qwen2.5's long-context YaRN (factor 4 over 32768, default betas), spelled as Qwen ships it.
    "yarn": ("tiny-qwen2-untied", {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 32768}, "t4"),
    "linear": ("tiny-qwen3", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, "t5"),
}
TOKENS = torch.randint(0, 200, (1, SEQ), generator=torch.Generator().manual_seed(3))


def _t4_spelling(rope: dict) -> tuple[dict, float]:
    """transformers 4's ``rope_scaling`` (with ``type``) and top-level ``rope_theta`` of ``rope``."""
    legacy = {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
    return {"type": rope["rope_type"], **legacy}, rope["rope_theta"]


def _hf_logits(model_dir, rope_override: dict | None = None) -> torch.Tensor:
    """HF transformers' logits on TOKENS; with ``rope_override``, of the same weights with that RoPE."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    if rope_override is not None:
        config.rope_parameters = rope_override
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture(scope="module")
def sources(tiny_hf_model, tmp_path_factory):
    """name -> (HF checkpoint dir, HF logits on TOKENS, HF logits with unscaled RoPE)."""
    made = {}
    for name, (preset, rope, spelling) in MODELS.items():
        path = Path(tiny_hf_model(preset, seed=5, max_position_embeddings=MAX_POSITIONS, initializer_range=INIT_STD,
                                  rope_parameters=copy.deepcopy(rope)))
        if spelling == "t4":
            t4 = tmp_path_factory.mktemp(f"rope-{name}") / "hf"
            shutil.copytree(path, t4)
            config = json.loads((t4 / "config.json").read_text())
            del config["rope_parameters"]
            config["rope_scaling"], config["rope_theta"] = _t4_spelling(rope)
            (t4 / "config.json").write_text(json.dumps(config, indent=2))
            path = t4
        unscaled = _hf_logits(path, {"rope_type": "default", "rope_theta": rope["rope_theta"]})
        made[name] = (path, _hf_logits(path), unscaled)
    return made


def test_sources_are_scaled_and_spelled_as_intended(sources):
    """The oracles themselves: HF reads each spelling as the scaled RoPE, and the scaling changes
    the logits (so the parity tests below can fail)."""
    for name, (path, scaled, unscaled) in sources.items():
        config = json.loads((path / "config.json").read_text())
        spelling = MODELS[name][2]
        assert ("rope_scaling" in config) == (spelling == "t4") and ("rope_parameters" in config) == (spelling == "t5")
        # Far above the parity tolerance below (atol + rtol * |logit| < 5e-5 here).
        assert (scaled - unscaled).abs().max() > 1e-3, f"{name}: the scaling does not change the logits"


# ----------------------------------------------------------------------------- the mapping


def _spellings(rope: dict) -> list[dict]:
    """config.json RoPE fields in every spelling transformers accepts."""
    legacy, theta = _t4_spelling(rope)
    with_rope_type = {"rope_type" if k == "type" else k: v for k, v in legacy.items()}
    return [
        {"rope_parameters": dict(rope)},
        {"rope_scaling": legacy, "rope_theta": theta},
        {"rope_scaling": with_rope_type, "rope_theta": theta},
        {"rope_scaling": {**with_rope_type, "type": "ignored-as-in-transformers"}, "rope_theta": theta},
        {"rope_scaling": {**legacy, "rope_theta": theta}},
    ]


def _mapping(hf: dict) -> tuple:
    family = family_for(hf)
    return family.gpt_model_kwargs(hf), family.yarn_config_attributes(hf), family.llama3_scaling_overrides(hf)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_spelling_maps_to_the_same_megatron_options(name):
    preset, rope, _ = MODELS[name]
    base = hf_config_dict(preset, max_position_embeddings=MAX_POSITIONS)
    del base["rope_parameters"]
    mappings = [_mapping({**base, **spelling}) for spelling in _spellings(rope)]
    assert all(m == mappings[0] for m in mappings), mappings
    model_kwargs, yarn, llama3 = mappings[0]
    assert model_kwargs["rotary_base"] == int(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        assert model_kwargs["seq_len_interpolation_factor"] == 4.0
        assert model_kwargs["position_embedding_type"] == "rope" and not yarn and llama3 is None
    elif rope["rope_type"] == "llama3":
        assert model_kwargs["rope_scaling"] is True and model_kwargs["rope_scaling_factor"] == rope["factor"]
        assert "seq_len_interpolation_factor" not in model_kwargs and not yarn
        if name == "llama3.1":
            assert llama3 is None  # megatron-core's built-in values are Llama 3.1's
        else:
            assert llama3 == {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                              "original_max_position_embeddings": 256}
    else:
        assert model_kwargs["position_embedding_type"] == "yarn" and llama3 is None
        assert yarn == dict(yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=32768,
                            yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=0.0,
                            yarn_correction_range_round_to_int=True)


def test_default_rope_maps_as_before():
    hf = hf_config_dict("tiny-llama")
    model_kwargs, yarn, llama3 = _mapping(hf)
    assert model_kwargs["position_embedding_type"] == "rope" and model_kwargs["rotary_base"] == 10000
    assert "rope_scaling" not in model_kwargs and "seq_len_interpolation_factor" not in model_kwargs
    assert not yarn and llama3 is None
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}
    assert _mapping({**legacy, "rope_theta": 10000.0}) == (model_kwargs, yarn, llama3)
    assert _mapping({**legacy, "rope_scaling": None, "rope_theta": 10000.0}) == (model_kwargs, yarn, llama3)


def test_yarn_megatron_attention_factor_is_hfs():
    """megatron applies YaRN's attention factor in every attention layer from the config attributes
    (GPTModel's non-MLA path drops the one the embedding returns): it must be HF's."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from parallel.layout import MegatronLayout
    from parallel.models import megatron_config

    for rope in (MODELS["yarn"][1], {**MODELS["yarn"][1], "mscale": 0.707, "mscale_all_dim": 0.707},
                 {**MODELS["yarn"][1], "mscale": 1.0, "mscale_all_dim": 0.5, "factor": 40.0}):
        hf = hf_config_dict("tiny-qwen2-untied", max_position_embeddings=MAX_POSITIONS, rope_parameters=rope)
        config = megatron_config(hf, MegatronLayout())
        _, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.for_model(**copy.deepcopy(hf)), "cpu")
        assert _yarn_get_concentration_factor_from_config(config) == hf_factor, rope


def test_shared_prompt_rows_with_yarn_give_hfs_logits(sources):
    """One shared-prefix row [prefix][branch 1][branch 2] of the YaRN model: every branch token's
    logits are HF's on prefix + that branch alone (RoPE at per-token positions keeps YaRN's table
    and attention factor)."""
    from parallel.modules.shared_prefix import PREFIX

    path, hf_logits, unscaled = sources["yarn"]
    prefix, branch_2 = 200, 120
    branch_1 = torch.randint(0, 200, (90,), generator=torch.Generator().manual_seed(4))
    tokens = torch.cat([TOKENS[0, :prefix], branch_1, TOKENS[0, prefix:prefix + branch_2]])[None]
    positions = torch.cat([torch.arange(prefix), prefix + torch.arange(len(branch_1)), prefix + torch.arange(branch_2)])
    segments = torch.tensor([PREFIX] * prefix + [1] * len(branch_1) + [2] * branch_2)[None]
    (logits,) = run_on_ranks(model_rank_fns.shared_prefix_logits, 1, str(path), tokens, positions[None], segments)
    own_sequence = torch.cat([logits[0, :prefix], logits[0, prefix + len(branch_1):]])  # prefix + branch 2
    torch.testing.assert_close(own_sequence, hf_logits[0, : prefix + branch_2], atol=1e-5, rtol=1e-5)
    assert (own_sequence - unscaled[0, : prefix + branch_2]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, r"rope_type='dynamic' is not supported .*dynamic NTK.*"
                                                  r"supported rope types: \['default', 'linear', 'llama3', 'yarn'\]"),
        ({"type": "dynamic", "factor": 2.0}, r"rope_scaling.rope_type='dynamic' .*supported rope types"),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, r"rope_type='longrope'.*LongRoPE"),
        ({"rope_type": "su"}, r"rope_type='su' .*supported rope types: \['default', 'linear', 'llama3', 'yarn'\]"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, r"\['partial_rotary_factor'\]"),
        ({"rope_type": "linear"}, r"factor=None for rope_type='linear'"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, r"high_freq_factor=None"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0},
         r"low_freq_factor=4.0 >= high_freq_factor=4.0"),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.0}, r"attention_factor=1.0"),
        ({"rope_type": "yarn", "factor": 4.0, "mscale": 0.0, "mscale_all_dim": 1.0}, r"mscale=0.0 with mscale_all_dim"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0}, r"beta_fast=0"),
        ({"rope_type": "yarn", "factor": 4.0, "extrapolation_factor": 1.0}, r"\['extrapolation_factor'\]"),
    ],
)
def test_unsupported_rope_is_refused_naming_field_value_and_supported(rope, message):
    field = "rope_scaling" if "type" in rope else "rope_parameters"
    hf = hf_config_dict("tiny-llama")
    hf.pop("rope_parameters")
    hf[field] = {**rope, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match=message):
        family_for(hf).transformer_config_kwargs(hf)
    with pytest.raises(UnsupportedModelError):
        family_for(hf).gpt_model_kwargs(hf)


def test_rope_parameters_never_modify_the_config():
    hf = hf_config_dict("tiny-qwen2-untied", rope_parameters=None)
    hf["rope_scaling"], hf["rope_theta"] = _t4_spelling(MODELS["yarn"][1])
    before = copy.deepcopy(hf)
    assert rope_parameters(hf)["original_max_position_embeddings"] == 32768
    family_for(hf).gpt_model_kwargs(hf)
    assert hf == before


# ----------------------------------------------------------------------------- conversion and logits

LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_roundtrip_is_bit_exact_and_logits_match_hf(sources, layout):
    """HF -> Megatron -> HF is bit-exact with config.json unchanged, and the Megatron model's logits
    over 512 positions are HF's (fp32, atol 1e-5); one 2-rank run per layout for all models."""
    jobs = [(str(path), str(path.parent / f"rope-export-{layout}")) for path, _, _ in sources.values()]
    per_rank = run_on_ranks(rank_fns.convert_roundtrip, 2, jobs, LAYOUTS[layout], TOKENS, timeout_s=400)
    for index, (name, (source, hf_logits, unscaled)) in enumerate(sources.items()):
        export = source.parent / f"rope-export-{layout}"
        original = HFCheckpoint(source, check_tensors=False).read_all()
        exported = HFCheckpoint(export, check_tensors=False).read_all()
        assert sorted(exported) == sorted(original), name
        for tensor_name, tensor in original.items():
            assert torch.equal(exported[tensor_name], tensor), f"{name}: {tensor_name}"
        source_config = json.loads((source / "config.json").read_text())
        exported_config = json.loads((export / "config.json").read_text())
        for key in ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings"):
            assert exported_config.get(key, "absent") == source_config.get(key, "absent"), f"{name}: {key}"
        assert {k: v for k, v in exported_config.items() if k not in ("architectures", "dtype")} == \
            {k: v for k, v in source_config.items() if k not in ("architectures", "dtype")}, name
        logits = next(rank[index] for rank in per_rank if rank[index] is not None)
        torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} {layout}: {m}")
        assert (logits - unscaled).abs().max() > 1e-3, name


# ----------------------------------------------------------------------------- SGLang rollouts

NEW_TOKENS = 12
PROMPT = torch.randint(1, 200, (SEQ - NEW_TOKENS,), generator=torch.Generator().manual_seed(4)).tolist()


def _hf_greedy(model_dir, rope_override: dict | None = None) -> tuple[list[int], list[float]]:
    """HF transformers' greedy continuation of PROMPT (EOS ignored) and each new token's log-prob."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    if rope_override is not None:
        config.rope_parameters = rope_override
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(PROMPT):].tolist()
    return ids, [torch.log_softmax(step[0].float(), -1)[tok].item() for step, tok in zip(out.logits, ids)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU SGLang engine")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(MODELS))
def test_sglang_greedy_matches_hf(sources, name):
    """SGLang (its own config reading, from the same config.json) applies the scaling: greedy tokens
    and log-probs equal HF's after a 500-token prompt, and differ from the unscaled model's."""
    from megarl.rollout import SGLangEngine

    path = sources[name][0]
    with SGLangEngine(str(path), tp_size=1, startup_timeout_s=240, call_timeout_s=300) as engine:
        out = engine.generate([PROMPT], {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
                              return_logprob=True)[0]
    hf_ids, hf_logps = _hf_greedy(path)
    assert out["output_ids"] == hf_ids
    assert out["output_logprobs"] == pytest.approx(hf_logps, abs=1e-4)
    unscaled_ids, unscaled_logps = _hf_greedy(path, {"rope_type": "default", "rope_theta": MODELS[name][1]["rope_theta"]})
    # The unscaled model is farther from HF's than the 1e-4 tolerance above (10x at least).
    assert unscaled_ids != hf_ids or max(abs(a - b) for a, b in zip(unscaled_logps, hf_logps)) > 1e-3
