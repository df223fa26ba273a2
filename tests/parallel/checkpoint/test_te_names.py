"""Transformer Engine (TE) layer-spec parameter names in conversion, dist checkpoints and loading,
without TE: against mbridge (an independent HF <-> Megatron converter whose tables are spelled
in TE's names) and megatron-core's own code, bit for bit.

TE's spec fuses the two pre-norms into linear_qkv / linear_fc1 (``layer_norm_weight``); megarl
maps that as one renaming (``model_specs.megatron_name``) of its local-spec weight rules.

- Names and tensors (no processes): every TE-named Megatron tensor megarl's shards describe, on
  each TP rank at TP=1 and TP=2, equals mbridge's (its HF-name lookup, QKV/gate-up merge and TP
  split), and at TP=1 mbridge's split back into HF tensors equals the HF checkpoint; the HF
  names reached are exactly the checkpoint's; megatron's own TE -> local renaming (modelopt's
  load hook) maps the TE names back onto the local ones.
- Models: chunks in TE-spec structure (``te_stand_in``, megatron's GPTModel rearranged as the TE
  spec arranges it) filled by megarl's loader equal those mbridge fills (TP=1, TP=2, PP=2 x
  VPP=2), and both exports equal the source.
- Dist checkpoints: ``hf_to_megatron(..., layer_spec="te")`` writes what megatron's own save of
  the TE-structured model writes (same keys, tensors and ``_extra_state`` objects); it loads into
  the TE-structured model (equal to mbridge's) and into megarl's local-spec model (equal to a
  load from HF), at another layout.

Llama (untied), Qwen2 (qkv bias) and Qwen3 (q/k norms). The CLI flag is tested in
tests/megarl/test_convert_cli.py, resharding in tests/parallel/reshard/test_plan.py.
"""

import pytest
import torch

from model_specs import family_for, megatron_name
from model_specs.presets import hf_config_dict
from parallel.checkpoint.convert import fill_local_tensor
from parallel.checkpoint.hf_io import HFCheckpoint
from parallel.layout import MegatronLayout
from parallel.shards import MegatronRank, megatron_shards
from parallel.spawn import run_on_ranks
from tests.parallel.checkpoint import mbridge_oracle, rank_fns, te_stand_in

MODELS = {
    "tiny-llama": {},  # untied, vocab 200 (padded)
    "tiny-qwen2-untied": {},  # qkv bias, vocab 250
    "tiny-qwen3": {},  # q/k layernorms, vocab 300
}
FUSED = ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")


@pytest.fixture(scope="module")
def hf_dirs(tiny_hf_model):
    return {model: tiny_hf_model(model, seed=21, **overrides) for model, overrides in MODELS.items()}


def _read_all(path):
    return HFCheckpoint(str(path), check_tensors=False).read_all()


@pytest.mark.parametrize("layout", [MegatronLayout(), MegatronLayout(tp=2, pp=2), MegatronLayout(pp=2, vpp=2)],
                         ids=["tp1", "tp2_pp2", "pp2_vpp2"])
@pytest.mark.parametrize("model", list(MODELS))
def test_te_shards_are_the_local_shards_with_the_norms_renamed(model, layout):
    from megatron.core.post_training.modelopt.gpt.state_dict_hooks import mcore_gpt_load_te_state_dict_pre_hook

    hf = hf_config_dict(model, **MODELS[model])
    local, te = megatron_shards(hf, layout), megatron_shards(hf, layout, layer_spec="te")
    assert local.keys() == te.keys()
    for position in local:
        for local_chunk, te_chunk in zip(local[position], te[position], strict=True):
            assert list(te_chunk) == [megatron_name(name, "te") for name in local_chunk]
            renamed = [name for name in te_chunk if name not in local_chunk]
            layers = {name.split(".")[2] for name in local_chunk if name.startswith("decoder.layers.")}
            assert sorted(renamed) == sorted(f"decoder.layers.{i}.{n}" for i in layers for n in FUSED)
            for name, tensor in local_chunk.items():
                te_tensor = te_chunk[megatron_name(name, "te")]
                assert (te_tensor.shape, te_tensor.pieces) == (tensor.shape, tensor.pieces), name
            # megatron-core's own TE -> local renaming (modelopt's state-dict load hook) undoes ours
            state = {megatron_name(name, "te"): name for name in local_chunk}
            mcore_gpt_load_te_state_dict_pre_hook(state, "", {}, True, [], [], [])
            assert sorted(state) == sorted(local_chunk) and all(key == name for key, name in state.items())


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", list(MODELS))
def test_te_tensors_equal_mbridge_on_every_tp_rank(hf_dirs, model, tp):
    from mbridge.core.parallel_states import ParallelStates

    ckpt = HFCheckpoint(hf_dirs[model])
    hf_tensors = _read_all(hf_dirs[model])
    shards = megatron_shards(ckpt.config, MegatronLayout(tp=tp), layer_spec="te")
    bridge = mbridge_oracle.bridge_for(hf_dirs[model], MegatronLayout(tp=tp), layer_spec="te",
                                       parallel_states=ParallelStates(tp_size=tp))
    rules = {rule.megatron: rule for rule in family_for(ckpt.config).weight_rules(ckpt.config, "te")}
    names = list(shards[MegatronRank(0, 0)][0])
    assert sum(name.endswith(FUSED) for name in names) == 2 * ckpt.config["num_hidden_layers"]
    reached = set()
    for name in names:
        hf_names = bridge._weight_name_mapping_mcore_to_hf(name)
        layer = name.split(".")[2] if name.startswith("decoder.layers.") else None
        template = name.replace(f"layers.{layer}.", "layers.{layer}.", 1) if layer else name
        assert hf_names == [n.format(layer=layer) for n in rules[template].hf], name
        reached.update(hf_names)
        full = bridge._weight_to_mcore_format(name, [hf_tensors[n] for n in hf_names])
        local_shape = shards[MegatronRank(0, 0)][0][name].shape
        theirs = bridge._weight_split_across_tp(name, full, torch.empty(local_shape), tp)
        for tp_rank in range(tp):
            local = shards[MegatronRank(0, tp_rank)][0][name]
            ours = torch.full(local.shape, float("nan"))
            fill_local_tensor(ours, local, ckpt)
            assert torch.equal(ours, theirs[tp_rank]), f"{model} tp{tp} rank {tp_rank}: {name}"
            if tp == 1:  # and back: mbridge's split of megarl's tensor into HF tensors
                back_names, back = bridge._weight_to_hf_format(name, ours)
                assert back_names == hf_names
                for hf_name, tensor in zip(back_names, back):
                    assert torch.equal(tensor, hf_tensors[hf_name]), f"{model}: {name} -> {hf_name}"
    assert reached == set(hf_tensors)


# world size -> layouts run one after another in the same ranks
WORLDS = {1: [{}], 2: [{"tp": 2}, {"pp": 2, "vpp": 2}]}


@pytest.mark.parametrize("world", list(WORLDS), ids=[f"world{w}" for w in WORLDS])
def test_te_structured_chunks_load_and_export_like_mbridge(hf_dirs, tmp_path, world):
    layouts = WORLDS[world]
    jobs = [(hf_dirs[m], str(tmp_path / m / "ours"), str(tmp_path / m / "mbridge"), False) for m in MODELS]
    per_rank = run_on_ranks(mbridge_oracle.compare_loads_and_exports, world, jobs, layouts, "te", timeout_s=300)
    for layout in layouts:
        name = mbridge_oracle.layout_name(layout)
        for model in MODELS:
            for rank, report in enumerate(per_rank):
                result = report[name][hf_dirs[model]]
                assert result["layer_spec"] == "te"
                assert result["params"] > 0 and not result["mismatches"], (
                    f"{model} {name} rank {rank}: megarl's TE-named weights differ from mbridge's: "
                    f"{result['mismatches'][:5]}")
            ours, theirs = _read_all(tmp_path / model / "ours" / name), _read_all(tmp_path / model / "mbridge" / name)
            source = _read_all(hf_dirs[model])
            assert sorted(ours) == sorted(theirs) == sorted(source), f"{model} {name}"
            for tensor_name, tensor in source.items():
                assert torch.equal(ours[tensor_name], tensor), f"{model} {name}: {tensor_name} differs from source"
                assert torch.equal(theirs[tensor_name], tensor), f"{model} {name}: mbridge {tensor_name}"


def _dist_checkpoint_content(path, tmp_path):
    """Every stored item of a torch_dist checkpoint: tensors by key, ShardedObjects as stored."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    file = tmp_path / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(file))
    return torch.load(file, weights_only=False)


def _same_content(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same_content, a, b))
    return a == b


@pytest.mark.parametrize("model", list(MODELS))
def test_te_dist_checkpoint_is_what_a_te_model_saves_and_loads_into_both_specs(hf_dirs, tmp_path, model):
    hf_dir = hf_dirs[model]
    te_ckpt, local_ckpt, model_save = tmp_path / "te", tmp_path / "local", tmp_path / "te-model-save"
    # verified conversion: read back bit-exact and the logit probe, whose model (megarl's local spec)
    # loads the TE checkpoint
    run_on_ranks(rank_fns.convert, 2, "hf-to-megatron", hf_dir, str(te_ckpt), {"tp": 2}, True, "te", timeout_s=300)
    run_on_ranks(rank_fns.convert, 2, "hf-to-megatron", hf_dir, str(local_ckpt), {"tp": 2}, False, timeout_s=300)
    # loaded at another layout than saved (the same TP: the stored vocab padding depends on it), where
    # the TE model then saves
    per_rank = run_on_ranks(te_stand_in.dist_checkpoint_checks, 4, hf_dir, str(te_ckpt), str(model_save),
                            {"tp": 2, "pp": 2}, timeout_s=300)
    for rank, report in enumerate(per_rank):
        assert report["params"] > 0 and not report["mismatches"], f"rank {rank}: {report['mismatches'][:5]}"
        assert report["layer_spec"] == "te"

    written = _dist_checkpoint_content(te_ckpt, tmp_path)
    saved_by_model = _dist_checkpoint_content(model_save, tmp_path)
    local = _dist_checkpoint_content(local_ckpt, tmp_path)
    assert sorted(written) == sorted(saved_by_model) == sorted(local)
    for key, value in written.items():
        assert _same_content(value, saved_by_model[key]), f"{model}: {key} differs from the TE model's own save"
    extra = [key for key in written if "_extra_state" in key]
    layers = hf_config_dict(model)["num_hidden_layers"]
    linears = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert sorted(extra) == sorted(f"decoder.layers.self_attention.{n}._extra_state/shard_{i}_{layers}" if "fc" not in n
                                   else f"decoder.layers.mlp.{n}._extra_state/shard_{i}_{layers}"
                                   for n in linears for i in range(layers))
    assert all(_same_content(written[key], [te_stand_in.te_extra_state()]) for key in extra)
    assert all(local[key] == [None] for key in extra)  # megatron's local linears store None
    for key in set(written) - set(extra):
        assert torch.equal(written[key], local[key]), key
    assert {k for k in written if "layer_norm_weight" in k} == {
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight"}
    assert not [k for k in written if "input_layernorm" in k or "pre_mlp_layernorm" in k or "core_attention" in k]
