"""One test per CPU compatibility patch (parallel/cpu/compat.py), each in a fresh process.

Where a patch fixes numbers rather than a crash, the test includes the negative control: the
result is wrong without it.
"""

import pytest

from parallel.spawn import run_on_ranks
from tests.parallel.cpu import rank_fns


@pytest.fixture(scope="module")
def observed():
    return run_on_ranks(rank_fns.compat_patches_in_isolation, 1, init_distributed=False, timeout_s=120)[0]


def test_patches_apply_on_a_machine_without_cuda(observed):
    assert observed["applied"] is True


def test_device_mode_maps_cuda_allocations_to_cpu_even_inside_backward(observed):
    assert observed["backward_grad"] == [1.0, 1.0, 1.0]  # the backward ran (it allocated on "cuda")
    assert observed["pinned"] is False


def test_moe_router_gemm_runs_without_transformer_engine(observed):
    assert observed["router_gemm"] is True  # megatron's own torch GEMM, not a NameError


def test_device_mode_maps_megatron_style_calls():
    devices = run_on_ranks(rank_fns.megatron_device_calls, 1, timeout_s=120)[0]
    assert devices == ["cpu", "cpu", "cpu"]


def test_cuda_runtime_calls_are_cpu_no_ops(observed):
    assert observed["runtime"] == (0, 0, True)


def test_rng_tracker_forks_the_cpu_generator(observed):
    assert observed["rng_default_untouched"]
    assert observed["rng_fork_is_seed_99"]


def test_tensor_type_reports_cuda_names_only_without_arguments(observed):
    assert observed["types"] == ("torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor", True)


def test_sequence_parallel_norm_is_built_and_tagged(observed):
    assert observed["sp_norm"] == ("RMSNorm", True, True)


@pytest.fixture(scope="module")
def tp1_grad_norm():
    return run_on_ranks(rank_fns.first_step_grad_norm, 1, {}, timeout_s=180)[0]


def test_sequence_parallel_norm_grads_need_the_tag(tp1_grad_norm):
    tagged = run_on_ranks(rank_fns.first_step_grad_norm, 2, {"tp": 2, "sequence_parallel": True}, timeout_s=180)
    untagged = run_on_ranks(
        rank_fns.first_step_grad_norm, 2, {"tp": 2, "sequence_parallel": True}, True, timeout_s=180
    )
    assert tagged[0] == pytest.approx(tp1_grad_norm, rel=1e-5)
    # Negative control: without the tag each TP rank keeps only its sequence shard's share.
    assert untagged[0]["norm_grad_norm"] != pytest.approx(tp1_grad_norm["norm_grad_norm"], rel=0.1)


def test_unbatched_p2p_keeps_interleaved_pipeline_exact(tp1_grad_norm):
    fixed = run_on_ranks(rank_fns.first_step_grad_norm, 2, {"pp": 2, "vpp": 2}, timeout_s=180)
    batched = run_on_ranks(
        rank_fns.first_step_grad_norm, 2, {"pp": 2, "vpp": 2}, False, {"batch_p2p_comm": True}, timeout_s=180
    )
    assert fixed[0]["grad_norm"] == pytest.approx(tp1_grad_norm["grad_norm"], rel=1e-5)
    assert batched[0]["grad_norm"] != pytest.approx(tp1_grad_norm["grad_norm"], rel=0.1)  # negative control: gloo swaps messages
