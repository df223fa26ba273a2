"""The compiled plan executor (merged strided runs, cached on the plan) writes exactly what a
plain per-copy execution of the same plan writes, and keeps doing so when the sources change."""

import pickle
import random

import pytest
import torch

from model_specs.presets import hf_config_dict
from parallel.layout import MegatronLayout
from parallel.reshard.execute import execute_plan_in_memory
from parallel.reshard.plan import Copy, Plan, megatron_device_positions, plan_megatron_to_sglang
from parallel.shards import LocalTensor, megatron_shards

LAYOUTS = {  # tools/bench_reshard.py's cases, plus replicas and virtual pipeline chunks
    "tp2-to-tp2": (MegatronLayout(tp=2), 2, 2), "tp2-to-tp1": (MegatronLayout(tp=2), 2, 1),
    "tp1-to-tp2": (MegatronLayout(tp=1), 2, 2), "tp2pp2-to-tp4": (MegatronLayout(tp=2, pp=2), 4, 4),
    "tp2pp2-to-tp2": (MegatronLayout(tp=2, pp=2), 4, 2), "tp2dp2-to-tp4": (MegatronLayout(tp=2), 4, 4),
    "pp2vpp2-to-tp2": (MegatronLayout(pp=2, vpp=2), 2, 2),
}
MODELS = ["tiny-llama", "tiny-qwen2-untied", "tiny-llama-tied"]  # padded vocab (zero fills), biases, tied


def reference_execution(plan, sources, destinations):
    """The obviously correct execution: every copy and zero fill on its own, by slicing boxes."""
    def region(tensor, box):
        return tensor[tuple(slice(a, b) for a, b in box)]

    for fill in plan.zero_fills:
        region(destinations[fill.dst][fill.dst_key], fill.dst_box).zero_()
    for copy in plan.copies:
        region(destinations[copy.dst][copy.dst_key], copy.dst_box).copy_(
            region(sources[copy.src][copy.src_key], copy.src_box))


def setup(model, layout_name, dtype=torch.bfloat16, seed=0):
    hf = hf_config_dict(model)
    layout, world, rollout_tp = LAYOUTS[layout_name]
    plan = plan_megatron_to_sglang(hf, layout, world, rollout_tp, element_size=torch.empty((), dtype=dtype).element_size())
    plan.check()
    shards = megatron_shards(hf, layout)
    generator = torch.Generator().manual_seed(seed)
    sources = {device: {(i, key): torch.randn(t.shape, generator=generator).to(dtype)
                        for i, chunk in enumerate(shards[position]) for key, t in chunk.items()}
               for device, position in megatron_device_positions(layout, world).items()}
    return plan, sources


def empty_destinations(plan, dtype=torch.bfloat16):
    return {device: {key: torch.full(t.shape, float("nan"), dtype=dtype) for key, t in tensors.items()}
            for device, tensors in plan.destinations.items()}


def assert_same(actual, expected):
    for device, tensors in expected.items():
        for key, tensor in tensors.items():
            assert not tensor.isnan().any(), f"reference left device {device} {key} unwritten"
            assert torch.equal(actual[device][key], tensor), f"device {device} {key}"


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("model", MODELS)
def test_compiled_execution_equals_per_copy_execution_and_follows_source_changes(model, layout_name):
    plan, sources = setup(model, layout_name)
    assert bool(plan.zero_fills) == (model != "tiny-llama-tied")  # vocab 200 and 250 are padded: zero fills
    expected, actual = empty_destinations(plan), empty_destinations(plan)
    reference_execution(plan, sources, expected)
    execute_plan_in_memory(plan, sources, actual)
    assert_same(actual, expected)

    # The next sync reuses the compiled runs and reads the sources' new values.
    compiled = dict(plan._compiled)
    for tensors in sources.values():
        for tensor in tensors.values():
            tensor.mul_(-2).add_(1)
    reference_execution(plan, sources, expected)
    execute_plan_in_memory(plan, sources, actual)
    assert_same(actual, expected)
    assert plan._compiled == compiled and all(plan._compiled[k] is v for k, v in compiled.items())


def test_a_pickled_plan_travels_without_its_compiled_runs_and_still_executes():
    plan, sources = setup("tiny-llama", "tp2pp2-to-tp2", dtype=torch.float32)
    execute_plan_in_memory(plan, sources, empty_destinations(plan, torch.float32))
    assert plan._compiled
    shipped = pickle.loads(pickle.dumps(plan))
    assert shipped._compiled == {} and shipped == plan
    expected, actual = empty_destinations(plan, torch.float32), empty_destinations(plan, torch.float32)
    reference_execution(plan, sources, expected)
    execute_plan_in_memory(shipped, sources, actual)
    assert_same(actual, expected)


def test_kept_views_read_new_values_and_are_rebuilt_for_new_tensors():
    """``reuse_views`` (a sync into the same staging buffer): later executions write the sources'
    new values; new destination tensors get views of their own, and the old ones are left alone.
    Without it no view outlives an execution (views keep their tensors' memory alive)."""
    plan, sources = setup("tiny-llama", "tp2pp2-to-tp2")  # zero fills too (a padded vocabulary)
    expected, actual = empty_destinations(plan), empty_destinations(plan)
    for _ in range(2):
        for tensors in sources.values():
            for tensor in tensors.values():
                tensor.mul_(-2).add_(1)
        reference_execution(plan, sources, expected)
        execute_plan_in_memory(plan, sources, actual, reuse_views=True)
        assert_same(actual, expected)
    [compiled] = plan._compiled.values()
    assert compiled.kept is not None
    before = {device: {key: t.clone() for key, t in tensors.items()} for device, tensors in actual.items()}
    fresh = empty_destinations(plan)
    for tensors in sources.values():
        for tensor in tensors.values():
            tensor.add_(3)
    reference_execution(plan, sources, expected)
    execute_plan_in_memory(plan, sources, fresh, reuse_views=True)
    assert_same(fresh, expected)
    assert_same(actual, before)
    execute_plan_in_memory(plan, sources, fresh)
    assert compiled.kept is None


def test_tensors_other_than_the_compiled_shapes_are_refused():
    plan, sources = setup("tiny-llama", "tp2-to-tp1")
    destinations = empty_destinations(plan)
    execute_plan_in_memory(plan, sources, destinations)
    key = next(k for k, t in destinations[0].items() if t.dim() == 2)
    destinations[0][key] = destinations[0][key].t().contiguous().t()  # same shape, column-major
    with pytest.raises(ValueError, match="compiled for"):
        execute_plan_in_memory(plan, sources, destinations)
    source_key = next(iter(sources[0]))
    sources[0][source_key] = torch.zeros(3, 5, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compiled for"):
        execute_plan_in_memory(plan, sources, empty_destinations(plan))


def check_row_copies(copies, rows=24, cols=6):
    """Run hand-made copies between (rows, cols) tensors ``w`` of devices 0 and 1 into device 0's
    ``w`` both ways and compare."""
    plan = Plan(copies, [], {0: {"w": LocalTensor("w", (rows, cols), ())}}, 4, 0)
    plan.check()
    sources = {device: {(0, "w"): torch.randn(rows, cols)} for device in (0, 1)}
    expected, actual = {0: {"w": torch.full((rows, cols), float("nan"))}}, {0: {"w": torch.full((rows, cols), float("nan"))}}
    reference_execution(plan, sources, expected)
    execute_plan_in_memory(plan, sources, actual)
    assert_same(actual, expected)


def row_copy(src, src_row, dst_row, n, cols=(0, 6)):
    a, b = cols
    return Copy(src, (0, "w"), ((src_row, src_row + n), (a, b)), 0, "w", ((dst_row, dst_row + n), (a, b)), n * (b - a) * 4)


@pytest.mark.parametrize("seed", range(20))
def test_runs_merged_from_arbitrary_row_and_column_boxes_copy_what_the_boxes_say(seed):
    """Random plans whose copies adjoin, repeat a step or break it, on one side or both: the
    merged runs copy exactly the boxes."""
    rng = random.Random(seed)
    rows, cols = 24, 6
    copies, dst_row = [], 0
    while dst_row < rows:
        n = min(rng.choice([1, 1, 2, 3]), rows - dst_row)
        src, src_row = rng.choice([0, 1]), rng.choice([dst_row, rng.randrange(rows - n + 1)])
        splits = [0, cols] if rng.random() < 0.7 else [0, rng.randrange(1, cols), cols]
        copies += [row_copy(src, src_row, dst_row, n, (a, b)) for a, b in zip(splits, splits[1:])]
        dst_row += n
    if rng.random() < 0.5:
        rng.shuffle(copies)
    check_row_copies(copies, rows, cols)


def test_a_step_that_holds_on_one_side_only_breaks_the_run():
    steps_on_the_source_only = [row_copy(0, s, d, 1) for s, d in [(0, 0), (2, 1), (4, 3)]]
    steps_on_the_destination_only = [row_copy(1, s, d, 1) for s, d in [(0, 5), (3, 7), (5, 9)]]
    rest = [row_copy(0, r, r, 1) for r in (2, 4, 6, 8)]
    check_row_copies(steps_on_the_source_only + steps_on_the_destination_only + rest, rows=10)


def test_column_blocks_join_into_one_run_only_when_they_fill_whole_rows():
    whole_rows = [row_copy(0, 0, 0, 4, (0, 2)), row_copy(1, 4, 0, 4, (2, 6))]
    part_rows = [row_copy(0, 4, 4, 4, (0, 2)), row_copy(1, 0, 4, 4, (2, 4))]
    part_rows += [row_copy(r % 2, r, r, 1, (4, 6)) for r in range(4, 8)]  # single rows from alternate sources: never joined
    check_row_copies(whole_rows + part_rows + [row_copy(0, 8, 8, 56)], rows=64)  # big enough not to be cut up
