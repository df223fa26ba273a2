"""The worker feeds its model on the model's device and hands the driver host tensors.

On a GPU the model lives on ``cuda`` while batches are cut on the host and the driver may have
no GPU at all. Here the ``meta`` device stands in for the GPU (``tests.megarl.workers.stand_in_gpu``):
a worker whose micro-batches stayed on the CPU stops at its first forward with "Tensor on device
cpu is not on the expected device meta", as it would on a GPU."""

import dataclasses

import torch

from megarl.workers.batch import (
    make_micro_batch,
    make_packed_micro_batch,
    make_shared_prompt_micro_batch,
    on_device,
    prompt_groups,
)
from parallel.spawn import run_on_ranks
from tests.megarl.workers.rank_fns import worker_forward_on_a_stand_in_gpu
from tests.megarl.workers.stand_in_gpu import META
from tests.megarl.workers.test_megatron_worker import rollout_batch


def test_the_worker_feeds_its_model_on_its_device_and_returns_host_tensors(tiny_hf_model):
    batch = rollout_batch(vocab_size=128)
    rows, width = len(batch["input_ids"]), int(batch["response_lengths"].max())
    out = run_on_ranks(worker_forward_on_a_stand_in_gpu, 1, tiny_hf_model("tiny-llama"), batch, 3, timeout_s=240)[0]
    assert "error" not in out, out["error"]
    assert out == {"rows": ("cpu", (rows,)), "logp": ("cpu", (rows, width)), "entropy": ("cpu", (rows, width))}


def _tensors(value, path="") -> dict[str, torch.Tensor]:
    """Every tensor reachable from a micro-batch value (dict entries, dataclass fields), by path."""
    if isinstance(value, torch.Tensor):
        return {path: value}
    if isinstance(value, dict):
        return {k: t for key, item in value.items() for k, t in _tensors(item, f"{path}/{key}").items()}
    if dataclasses.is_dataclass(value):
        return {k: t for field in dataclasses.fields(value)
                for k, t in _tensors(getattr(value, field.name), f"{path}.{field.name}").items()}
    return {}


def test_every_tensor_of_every_micro_batch_kind_moves():
    batch = rollout_batch(vocab_size=128)
    rows = [0, 1, 2, 3]
    kinds = {
        "padded": make_micro_batch(batch, rows, 16, 4),
        "packed": make_packed_micro_batch(batch, rows, 32, 1),
        "shared prompts": make_shared_prompt_micro_batch(batch, prompt_groups(batch, rows), 16, 2),
    }
    for kind, micro_batch in kinds.items():
        host = _tensors(micro_batch)
        moved = _tensors(on_device(micro_batch, META))
        assert moved.keys() == host.keys(), kind
        assert {path: t.device for path, t in moved.items()} == dict.fromkeys(host, META), kind
        assert {path: (t.shape, t.dtype) for path, t in moved.items()} == {
            path: (t.shape, t.dtype) for path, t in host.items()}, kind
