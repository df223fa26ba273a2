"""megarl's HF <-> Megatron conversion against mbridge, an independent converter, bit for bit.

For Llama and Qwen2 (untied, tied, qkv bias, padded vocab) at TP=1, TP=2, PP=2, PP=2 x VPP=2 and
TP=2 x PP=2: the Megatron parameters megarl's loader writes equal mbridge's on every rank
(vocab padding rows included: both write zeros; every parameter starts as NaN so an element
either loader skips fails), and megarl's HF export equals mbridge's export (and the source),
tensor for tensor. The two overrides mbridge needs for megatron's local layer spec are in
tests/parallel/checkpoint/mbridge_oracle.py.
"""

import importlib.util

import pytest
import torch

from model_specs.presets import save_tiny_hf_model
from parallel.checkpoint.hf_io import HFCheckpoint
from parallel.spawn import run_on_ranks
from tests.parallel.checkpoint import mbridge_oracle

if importlib.util.find_spec("mbridge") is None:  # fail, never skip: the oracle is part of the suite
    raise ImportError("mbridge (test oracle) is not installed: pip install -r requirements/dev.txt")

# name -> (preset, config overrides)
MODELS = {
    "tiny-llama": ("tiny-llama", {}),  # untied, vocab 200 (padded to 256 at TP=1 and TP=2)
    "tiny-llama-tied": ("tiny-llama-tied", {}),
    "tiny-qwen2-untied": ("tiny-qwen2-untied", {}),  # qkv bias, vocab 250
    "tiny-qwen2-tied": ("tiny-qwen2", {"num_key_value_heads": 2}),  # qkv bias, tied
}
# mbridge's Llama bridge maps output_layer to lm_head even when embeddings are tied (its Qwen2
# bridge maps it to embed_tokens), so a tied Llama is compared only where the last pipeline
# stage holds no separate output layer: PP=1.
PP1_ONLY = {"tiny-llama-tied"}
# world size -> layouts run one after another in the same set of ranks
WORLDS = {
    1: [{}],
    2: [{"tp": 2}, {"pp": 2}, {"pp": 2, "vpp": 2}],
    4: [{"tp": 2, "pp": 2}],
}


def _read_all(path):
    return HFCheckpoint(path, check_tensors=False).read_all()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for model, (preset, overrides) in MODELS.items():
        path = tmp_path_factory.mktemp(model)
        save_tiny_hf_model(preset, path / "hf", seed=5, **overrides)
        made[model] = path
    return made


@pytest.mark.parametrize("world", list(WORLDS), ids=[f"world{w}" for w in WORLDS])
def test_megatron_weights_and_hf_export_equal_mbridge(checkpoints, world):
    layouts = WORLDS[world]
    jobs = [(str(checkpoints[m] / "hf"), str(checkpoints[m] / "ours"), str(checkpoints[m] / "mbridge"), m in PP1_ONLY)
            for m in MODELS]
    per_rank = run_on_ranks(mbridge_oracle.compare_loads_and_exports, world, jobs, layouts, timeout_s=300)
    for layout in layouts:
        name = mbridge_oracle.layout_name(layout)
        for model in MODELS:
            if model in PP1_ONLY and layout.get("pp", 1) > 1:
                continue
            hf_dir = str(checkpoints[model] / "hf")
            for rank, report in enumerate(per_rank):
                result = report[name][hf_dir]
                assert result["params"] > 0 and not result["mismatches"], (
                    f"{model} {name} rank {rank}: megarl's Megatron weights differ from mbridge's: "
                    f"{result['mismatches'][:5]}")
            ours = _read_all(checkpoints[model] / "ours" / name)
            theirs = _read_all(checkpoints[model] / "mbridge" / name)
            source = _read_all(checkpoints[model] / "hf")
            assert sorted(ours) == sorted(theirs) == sorted(source), f"{model} {name}"
            for tensor_name, tensor in ours.items():
                assert torch.equal(tensor, theirs[tensor_name]), f"{model} {name}: {tensor_name} differs from mbridge"
                assert torch.equal(tensor, source[tensor_name]), f"{model} {name}: {tensor_name} differs from source"
