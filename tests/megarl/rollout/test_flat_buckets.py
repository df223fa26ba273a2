"""The weight path's pieces that need no engine: flat buckets (a plan writes views of one buffer
per bucket, the description that travels rebuilds bit-identical tensors on the other side) and
the parity probe's fingerprint (exact: checked against the closed-form sum in Python integers;
any single changed element or bit changes it)."""

import pytest
import torch

from megarl.rollout.sglang.patches import weight_checksum
from megarl.rollout.sglang.transport import (
    ALIGN,
    FLAT_PREFIX,
    FlatLayout,
    SharedMemoryStaging,
    bucket_layouts,
    expand_flat_entries,
    flat_views,
    staged_tensors,
)
from megarl.rollout.weight_sync import allocate_flats, pack_rank_shards
from parallel.reshard.execute import execute_plan_in_memory
from tests.parallel.reshard.test_executor import empty_destinations, setup


def test_layout_description_round_trips_and_buckets_stay_bounded():
    spec = {"a": ((3, 5), torch.bfloat16), "b": ((7,), torch.float32), "c": ((0, 4), torch.float32),
            "d": ((), torch.int64), "big": ((64, 64), torch.float32)}
    layout = FlatLayout.of(spec)
    assert FlatLayout.decode(layout.encode()) == layout
    assert [offset % ALIGN for *_, offset in layout.entries] == [0] * len(spec)
    assert layout.names == list(spec)
    layouts = bucket_layouts(spec, 1024)
    assert [name for part in layouts for name in part.names] == list(spec)  # order kept, none lost
    assert all(part.nbytes <= 1024 or len(part.names) == 1 for part in layouts)
    assert [part.names for part in layouts][-1] == ["big"]  # 16 KB: a bucket of its own


@pytest.mark.parametrize("named", [False, True])
def test_views_rebuilt_from_the_description_are_what_the_plan_assembled(named, tmp_path):
    """A resharding plan run into views of flat buckets writes what it writes into separate tensors;
    what travels (the layout and the buffer's bytes, or the name of its shared-memory segment)
    rebuilds those tensors bit for bit, and each fingerprint sent with them is theirs."""
    plan, sources = setup("tiny-qwen2-untied", "tp2-to-tp2", dtype=torch.bfloat16)
    expected = empty_destinations(plan)
    execute_plan_in_memory(plan, sources, expected)
    staging = SharedMemoryStaging() if named else None
    for device, wanted in plan.destinations.items():
        layouts = bucket_layouts({name: (t.shape, torch.bfloat16) for name, t in wanted.items()}, 64 << 10)
        assert len(layouts) > 2
        flats = allocate_flats(layouts, torch.device("cpu"), staging)
        assert all(flat.is_shared() for flat in flats) == named
        views = {name: view for layout, flat in zip(layouts, flats) for name, view in flat_views(flat, layout).items()}
        destinations = {d: (views if d == device else empty_destinations(plan)[d]) for d in plan.destinations}
        execute_plan_in_memory(plan, sources, destinations)
        shards = pack_rank_shards(layouts, flats, named=named)
        received = {}
        for bucket in shards.buckets:
            assert (bucket.payload is not None) == named and (bucket.data is None) == named
            received.update(staged_tensors(bucket.payload) if named else bucket.inline_tensors())
        assert list(received) == list(wanted)
        for name, tensor in expected[device].items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), (device, name)
            assert shards.checksums[name] == weight_checksum(tensor), (device, name)


def test_a_named_bucket_is_one_entry_that_sglang_decodes_and_expands(tmp_path):
    """The payload of a shared-memory bucket is one (name, buffer) entry of a few hundred bytes;
    SGLang's own whitelisting deserializer decodes it in another process, and the expansion the
    patched direct loader runs there gives back the tensors, which are the trainer's memory."""
    import subprocess
    import sys

    from megarl.rollout.sglang.engine import child_env

    staging = SharedMemoryStaging()
    want = {"w": torch.randn(256, 128), "b": torch.randn(9).to(torch.bfloat16), "ids": torch.arange(7)}
    payload = staging.payload(0, want)
    assert payload is not None and len(payload) < 4096  # the tensors hold 128 KB
    (tmp_path / "payload.bin").write_bytes(payload)
    torch.save(want, tmp_path / "expected.pt")
    decode = (
        "import sys, torch\n"
        "from sglang.srt.utils.common import MultiprocessingSerializer\n"
        "from megarl.rollout.sglang.transport import FLAT_PREFIX, expand_flat_entries\n"
        "entries = MultiprocessingSerializer.deserialize(open(sys.argv[1], 'rb').read())\n"
        "assert len(entries) == 1 and entries[0][0].startswith(FLAT_PREFIX), [n[:40] for n, _ in entries]\n"
        "got, want = expand_flat_entries(entries), torch.load(sys.argv[2])\n"
        "assert [n for n, _ in got] == list(want), [n for n, _ in got]\n"
        "for n, t in got:\n"
        "    assert t.dtype == want[n].dtype and torch.equal(t, want[n]), n\n"
        "print('decoded', len(got))\n")
    done = subprocess.run([sys.executable, "-c", decode, str(tmp_path / "payload.bin"), str(tmp_path / "expected.pt")],
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "decoded 3" in done.stdout, done.stderr[-3000:]
    buffer = staging._buffers[0]
    assert staging.payload(0, {"w": torch.ones(256, 128)}) is not None and staging._buffers[0] is buffer  # reused
    assert bool(staged_tensors(payload)["w"].eq(1.0).all())  # the same memory: the engine reads what is there now
    assert expand_flat_entries([("plain", torch.ones(2))])[0][0] == "plain"  # inline entries pass through
    assert not "plain".startswith(FLAT_PREFIX)


def test_flat_buckets_survive_a_ray_hop():
    """A bucket's bytes inline (bfloat16 has no numpy type; a 0-d tensor has no last dim) come back
    bit-identical from a real Ray hop between two processes."""
    import ray

    want = {"bf16": torch.randn(3, 4).to(torch.bfloat16), "f32": torch.randn(5, 2), "i64": torch.arange(4),
            "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    layouts = [FlatLayout.of({name: (t.shape, t.dtype) for name, t in want.items()})]
    flats = allocate_flats(layouts, torch.device("cpu"))
    for name, view in flat_views(flats[0], layouts[0]).items():
        view.copy_(want[name])
    shards = pack_rank_shards(layouts, flats, named=False)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        echoed = ray.get(ray.remote(lambda packed: packed).remote(shards))
    finally:
        ray.shutdown()
    [bucket] = echoed.buckets
    back = bucket.inline_tensors()
    assert list(back) == list(want) and echoed.checksums == shards.checksums
    for name, tensor in want.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name


def closed_form_fingerprint(tensor: torch.Tensor) -> str:
    """The fingerprint's definition in Python integers: per lane, sum over elements i of
    (1 + i mod 2048) * (the element's bits as a signed int), modulo 2**50."""
    word = {1: torch.int8, 2: torch.int16}.get(tensor.element_size(), torch.int32)
    lanes = tensor.contiguous().reshape(-1).view(word).view(tensor.numel(), -1).t().tolist()
    sums = [sum((1 + i % 2048) * v for i, v in enumerate(lane)) % (1 << 50) for lane in lanes]
    return f"{tensor.dtype}:{tuple(tensor.shape)}:" + "".join(f"{s:013x}" for s in sums)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int8, torch.float64]


def _sample(dtype, shape=(37, 211), seed=0):
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=generator, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprint_is_the_closed_form_sum_exactly(dtype):
    tensor = _sample(dtype, (5000,))  # more than two blocks of 2048, and a tail
    assert weight_checksum(tensor) == closed_form_fingerprint(tensor)
    extreme = torch.full((4099,), torch.iinfo(torch.int32).min if dtype == torch.int32 else -1, dtype=dtype)
    assert weight_checksum(extreme) == closed_form_fingerprint(extreme)  # the largest products


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprint_sees_any_single_changed_bit(dtype):
    """Every bit of a few elements (first, in a middle block, last) flipped on its own changes the
    fingerprint. The same values in another memory layout, or summed by another number of
    threads, fingerprint alike."""
    tensor = _sample(dtype)
    digest = weight_checksum(tensor)
    bits = tensor.view(torch.uint8).view(-1)
    for element in (0, 4097, tensor.numel() - 1):
        for bit in range(tensor.element_size() * 8):
            flipped = bits.clone()
            flipped[element * tensor.element_size() + bit // 8] ^= 1 << (bit % 8)
            assert weight_checksum(flipped.view(dtype).view(tensor.shape)) != digest, (element, bit)
    assert weight_checksum(tensor.t().contiguous().t()) == digest
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert weight_checksum(tensor) == digest
    finally:
        torch.set_num_threads(threads)


def test_fingerprint_names_dtype_and_shape():
    weight = torch.randn(64, 48)
    others = [weight.view(torch.int32), weight.reshape(48, 64), weight.reshape(-1)]
    assert len({weight_checksum(weight), *map(weight_checksum, others)}) == 1 + len(others)
    assert weight_checksum(torch.zeros(0, 4)) != weight_checksum(torch.zeros(4, 0))
    assert weight_checksum(torch.ones(3, dtype=torch.bool)) == closed_form_fingerprint(torch.ones(3, dtype=torch.bool))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprint_on_a_gpu_equals_the_cpu_one(dtype):
    tensor = _sample(dtype, (4096, 1031))
    assert weight_checksum(tensor.cuda()) == weight_checksum(tensor)
