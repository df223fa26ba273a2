"""Megatron -> SGLang resharding plans, checked without any process: coverage, bytes moved vs an
independently computed minimum, and executed copies equal to slicing the HF tensors by SGLang's
layout (whose own loaders are the oracle in tests/parallel/reshard/test_sglang_loaders.py)."""

import pytest
import torch

from model_specs.presets import hf_config_dict
from parallel.checkpoint.convert import fill_local_tensor
from parallel.layout import MegatronLayout
from parallel.reshard.execute import execute_plan_in_memory
from parallel.reshard.plan import megatron_device_positions, plan_megatron_to_sglang, separate_pool_rounds
from parallel.shards import hf_tensor_shapes, megatron_shards, sglang_shards

LAYOUTS = {"tp1": (MegatronLayout(), 1), "tp2": (MegatronLayout(tp=2), 2), "tp2_pp2": (MegatronLayout(tp=2, pp=2), 4),
           "pp2_vpp2": (MegatronLayout(pp=2, vpp=2), 2), "tp2_dp2": (MegatronLayout(tp=2), 4)}
MODELS = {"tiny-llama": {}, "tiny-qwen2": {}, "tiny-qwen2-untied": {}, "tiny-llama-tied": {}, "tiny-qwen3-moe": {}}
SP = {"tp": 2, "sequence_parallel": True}
MOE_LAYOUTS = {"ep1": (MegatronLayout(), 1), "ep2": (MegatronLayout(ep=2), 2), "ep2_tp2": (MegatronLayout(ep=2, **SP), 2),
               "ep2_etp2_tp2": (MegatronLayout(ep=2, etp=2, **SP), 4), "ep2_pp2": (MegatronLayout(ep=2, pp=2), 4),
               "ep2_dp2": (MegatronLayout(ep=2), 4)}


class Tensors:
    """A dict of HF tensors with HFCheckpoint's read_box."""

    def __init__(self, tensors):
        self.tensors = tensors

    def read_box(self, name, box):
        return self.tensors[name][tuple(slice(a, b) for a, b in box)]


def random_hf_tensors(hf, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in hf_tensor_shapes(hf).items()}


def materialise(local_tensors, hf_tensors):
    out = {}
    for key, local in local_tensors.items():
        out[key] = torch.full(local.shape, float("nan"))
        fill_local_tensor(out[key], local, Tensors(hf_tensors))
    return out


def cases():
    for model, overrides in MODELS.items():
        hf = hf_config_dict(model, **overrides)
        moe = "moe" in model
        for name, (layout, _world) in (MOE_LAYOUTS if moe else LAYOUTS).items():
            if hf["num_key_value_heads"] % layout.tp:
                continue
            for rollout_tp, rollout_ep in ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4)) if moe else ((1, 1), (2, 1), (4, 1)):
                yield pytest.param(model, name, rollout_tp, rollout_ep,
                                   id=f"{model}-{name}-sglang_tp{rollout_tp}" + (f"_ep{rollout_ep}" if moe else ""))


@pytest.mark.parametrize("model, layout_name, rollout_tp, rollout_ep", list(cases()))
def test_plan_covers_destinations_and_moves_the_minimum(model, layout_name, rollout_tp, rollout_ep):
    """Also for an MoE model into SGLang's fused experts: each SGLang rank receives exactly the
    bytes of its own experts (and expert-TP slices) that its co-located trainer rank lacks."""
    hf = hf_config_dict(model, **MODELS[model])
    layout, world = (MOE_LAYOUTS if "moe" in model else LAYOUTS)[layout_name]
    plan = plan_megatron_to_sglang(hf, layout, world, rollout_tp, rollout_ep=rollout_ep)
    plan.check()

    # Independent minimum: per destination device, the HF elements it needs minus those its
    # co-located trainer rank holds, counted element by element with masks.
    shapes = hf_tensor_shapes(hf)
    positions = megatron_device_positions(layout, world)
    source = megatron_shards(hf, layout)
    minimum = 0
    for device, tensors in plan.destinations.items():
        held = {name: torch.zeros(shape, dtype=torch.bool) for name, shape in shapes.items()}
        if device in positions:
            for chunk in source[positions[device]]:
                for local in chunk.values():
                    for piece in local.pieces:
                        if piece.hf is not None:
                            held[piece.hf][tuple(slice(a, b) for a, b in piece.src)] = True
        for local in tensors.values():
            for piece in local.pieces:
                if piece.hf is not None:
                    region = held[piece.hf][tuple(slice(a, b) for a, b in piece.src)]
                    minimum += int((~region).sum()) * plan.element_size
    assert plan.network_bytes == minimum == plan.minimum_network_bytes
    if rollout_tp == layout.tp and layout.pp == 1 and "moe" not in model:
        assert plan.network_bytes == 0  # equal TP, co-located: purely local copies
    if (rollout_ep, rollout_tp // rollout_ep) == (layout.ep, layout.etp) and layout.pp == 1:
        # the same expert split, co-located: no expert byte crosses the network
        assert sum(c.nbytes for c in plan.copies if c.src != c.dst and ".experts." in c.dst_key) == 0

    # Executing the plan from Megatron shards gives exactly SGLang's shards of the same weights.
    hf_tensors = random_hf_tensors(hf)
    sources = {}
    for device, position in positions.items():
        sources[device] = {}
        for chunk_index, chunk in enumerate(source[position]):
            for key, tensor in materialise(chunk, hf_tensors).items():
                sources[device][(chunk_index, key)] = tensor
    destinations = {device: {k: torch.full(t.shape, float("nan")) for k, t in tensors.items()}
                    for device, tensors in plan.destinations.items()}
    execute_plan_in_memory(plan, sources, destinations)
    expected = sglang_shards(hf, rollout_tp, rollout_ep)
    for device, tensors in destinations.items():
        reference = materialise(expected[device % rollout_tp], hf_tensors)
        for name, tensor in tensors.items():
            assert torch.equal(tensor, reference[name]), f"device {device} {name}"


def _megatron_sources(hf, layout, world, hf_tensors, layer_spec="local"):
    source = megatron_shards(hf, layout, layer_spec=layer_spec)
    return {device: {(chunk_index, key): tensor for chunk_index, chunk in enumerate(source[position])
                     for key, tensor in materialise(chunk, hf_tensors).items()}
            for device, position in megatron_device_positions(layout, world).items()}


@pytest.mark.parametrize("layout_name, rollout_tp", [("tp1", 1), ("tp1", 4), ("tp2", 4), ("tp2_pp2", 2),
                                                     ("pp2_vpp2", 4)])
def test_separate_pool_rounds_assemble_every_engine_rank_once_on_trainer_devices(layout_name, rollout_tp):
    """Engines on their own pool: each SGLang rank's shards are assembled exactly once, on a
    trainer device, and equal slicing the HF tensors by SGLang's layout."""
    hf = hf_config_dict("tiny-qwen2-untied")
    layout, world = LAYOUTS[layout_name]
    hf_tensors = random_hf_tensors(hf)
    sources = _megatron_sources(hf, layout, world, hf_tensors)
    expected = sglang_shards(hf, rollout_tp)
    assembled = []
    for engine_ranks in separate_pool_rounds(world, rollout_tp):
        assert set(engine_ranks) <= set(range(world))  # only trainer devices do the work
        plan = plan_megatron_to_sglang(hf, layout, world, rollout_tp, engine_ranks=engine_ranks)
        plan.check()
        destinations = {device: {k: torch.full(t.shape, float("nan")) for k, t in tensors.items()}
                        for device, tensors in plan.destinations.items()}
        execute_plan_in_memory(plan, sources, destinations)
        for device, rank in engine_ranks.items():
            reference = materialise(expected[rank], hf_tensors)
            assert destinations[device].keys() == reference.keys()
            for name, tensor in destinations[device].items():
                assert torch.equal(tensor, reference[name]), f"sglang rank {rank} {name}"
            assembled.append(rank)
    assert sorted(assembled) == list(range(rollout_tp))


@pytest.mark.parametrize("rollout_tp", [1, 2])
@pytest.mark.parametrize("layout_name", ["tp1", "tp2_pp2", "pp2_vpp2"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2-untied", "tiny-qwen3"])
def test_te_named_actor_plans_the_same_copies_as_the_local_spec(model, layout_name, rollout_tp):
    """An actor of the Transformer Engine layer spec (norms fused into linear_qkv / linear_fc1:
    other parameter names) plans the weight sync exactly as one of the local spec: the same
    copies, boxes, bytes and zero fills, only the source keys renamed (``model_specs.megatron_name``);
    executed from TE-named sources it fills the same SGLang tensors."""
    import dataclasses

    from model_specs import megatron_name

    hf = hf_config_dict(model)
    layout, world = LAYOUTS[layout_name]
    local = plan_megatron_to_sglang(hf, layout, world, rollout_tp)
    te = plan_megatron_to_sglang(hf, layout, world, rollout_tp, layer_spec="te")
    te.check()
    assert te.copies == [dataclasses.replace(c, src_key=(c.src_key[0], megatron_name(c.src_key[1], "te")))
                         for c in local.copies]
    assert any(c.src_key[1].endswith(".linear_qkv.layer_norm_weight") for c in te.copies)
    assert any(c.src_key[1].endswith(".linear_fc1.layer_norm_weight") for c in te.copies)
    assert (te.zero_fills, te.destinations) == (local.zero_fills, local.destinations)
    assert (te.network_bytes, te.local_bytes, te.minimum_network_bytes) == (
        local.network_bytes, local.local_bytes, local.minimum_network_bytes)
    hf_tensors = random_hf_tensors(hf)
    filled = {}
    for spec, plan in (("local", local), ("te", te)):
        filled[spec] = {device: {k: torch.full(t.shape, float("nan")) for k, t in tensors.items()}
                        for device, tensors in plan.destinations.items()}
        execute_plan_in_memory(plan, _megatron_sources(hf, layout, world, hf_tensors, spec), filled[spec])
    for device, tensors in filled["te"].items():
        for name, tensor in tensors.items():
            assert torch.equal(tensor, filled["local"][device][name]), f"device {device} {name}"


def test_plan_check_catches_a_missing_copy():
    hf = hf_config_dict("tiny-llama")
    plan = plan_megatron_to_sglang(hf, MegatronLayout(tp=2), 2, 2)
    plan.copies.pop(3)
    with pytest.raises(ValueError, match="elements written"):
        plan.check()


def test_plan_check_catches_a_double_write():
    hf = hf_config_dict("tiny-llama")
    plan = plan_megatron_to_sglang(hf, MegatronLayout(tp=2), 2, 1)
    plan.copies.append(plan.copies[0])
    with pytest.raises(ValueError):
        plan.check()


def test_sglang_tp_that_does_not_fit_the_heads_is_refused():
    with pytest.raises(ValueError, match="pick tp from"):
        sglang_shards(hf_config_dict("tiny-llama"), 3)


@pytest.mark.parametrize("model, overrides, tp, ep, message", [
    ("tiny-qwen3-moe", {}, 2, 4, r"rollout ep=4: does not fit tp=2.* pick ep from \[1, 2\]"),
    ("tiny-qwen3-moe", {"num_experts": 6}, 4, 4, r"num_experts=6.* pick ep from \[1, 2\]"),
    ("tiny-llama", {}, 2, 2, "rollout ep=2: expert parallelism needs an MoE model"),
    ("tiny-mixtral", {}, 1, 1, "tie_word_embeddings=True, and SGLang.s MixtralForCausalLM has no tied embeddings"),
])
def test_sglang_expert_parallelism_that_does_not_fit_is_refused(model, overrides, tp, ep, message):
    with pytest.raises(ValueError, match=message):
        sglang_shards(hf_config_dict(model, **overrides), tp, ep)


@pytest.mark.parametrize("model, layout_kwargs, world, rollout_tp, rollout_ep", [
    ("tiny-qwen2-untied", {"tp": 2, "pp": 2}, 4, 2, 1), ("tiny-qwen2-untied", {"tp": 2}, 4, 4, 1),
    ("tiny-qwen2-untied", {"pp": 2, "vpp": 2}, 2, 2, 1), ("tiny-qwen3-moe", {"ep": 2}, 2, 2, 1)])
def test_plan_runs_over_gloo_from_real_megatron_shards(tmp_path, model, layout_kwargs, world, rollout_tp, rollout_ep):
    from model_specs.presets import save_tiny_hf_model
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.spawn import run_on_ranks
    from tests.parallel.reshard import rank_fns

    hf_dir = save_tiny_hf_model(model, tmp_path / "hf", seed=5)
    results = run_on_ranks(rank_fns.reshard_megatron_to_sglang, world, str(hf_dir), layout_kwargs, rollout_tp,
                           4096, rollout_ep, timeout_s=240)
    ckpt = HFCheckpoint(hf_dir)
    expected = sglang_shards(ckpt.config, rollout_tp, rollout_ep)
    for device, (buffers, _stats, _network_bytes) in enumerate(results):
        reference = materialise(expected[device % rollout_tp], {n: ckpt.read(n) for n in ckpt.names})
        assert buffers.keys() == reference.keys()
        for name, tensor in buffers.items():
            assert torch.equal(tensor, reference[name]), f"device {device} {name}"
    assert sum(r[1]["sent_bytes"] for r in results) == sum(r[1]["received_bytes"] for r in results) == results[0][2]
