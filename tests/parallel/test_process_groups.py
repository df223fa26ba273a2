"""Process-group backends: one function chooses them, and the CPU part of the GPU choice serves
every collective the code runs on CPU tensors (a CPU wheel has no NCCL, so that part is what a
CPU machine can check)."""

import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from parallel.process_groups import distributed_backend
from parallel.spawn import run_on_ranks
from tests.parallel import rank_fns
from tests.processes import live_descendants


def _device_map(backend: str) -> dict[str, str]:
    return dict(BackendConfig(dist.Backend(backend)).get_device_backend_map())


def test_backend_is_gloo_for_cpu_tensors_and_nccl_for_cuda_ones_where_cuda_exists():
    # NCCL alone (the old choice on GPU) fails on the CPU tensors of the loss all-reduce, the
    # reshard buffers and the HF export's gathers.
    assert distributed_backend(cuda_available=True) == "cpu:gloo,cuda:nccl"
    assert _device_map(distributed_backend(cuda_available=True)) == {"cpu": "gloo", "cuda": "nccl"}
    assert distributed_backend(cuda_available=False) == "gloo"
    assert _device_map(distributed_backend(cuda_available=False))["cpu"] == "gloo"


def test_cpu_part_of_the_gpu_backend_serves_every_cpu_collective():
    cpu_part = f"cpu:{_device_map(distributed_backend(cuda_available=True))['cpu']}"
    results = run_on_ranks(rank_fns.cpu_collectives_rank, 2, cpu_part, timeout_s=120, init_distributed=False)
    for rank, result in enumerate(results):
        assert result["all_reduce"] == 2.0 and result["dtype"] == "torch.float64"
        assert result["received"] == [float(1 - rank)] * 3
        assert result["broadcast"] == {"from": 1}
        assert result["all_gather"] == [{"rank": 0}, {"rank": 1}]
    assert results[0]["sent_recv"] == [0.0, 1.0, 2.0, 3.0]
    assert results[0]["gather"] == [0, 10] and results[1]["gather"] is None
    assert live_descendants() == []


def test_megatron_worker_joins_with_local_rank_zero_not_its_global_rank():
    # Under Ray each GPU worker sees one GPU: its local rank (and device) is 0 at every rank.
    results = run_on_ranks(rank_fns.megatron_worker_env_rank, 2, timeout_s=120, init_distributed=False)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["local_rank"] for r in results] == ["0", "0"]
    assert all(r["backend"] == distributed_backend(cuda_available=False) and r["sum"] == 2.0 for r in results)
    assert live_descendants() == []
