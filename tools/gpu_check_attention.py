"""The ``attention`` phase of tools/gpu_check.py: shared-prompt rows' attention on one GPU.

``parallel.modules.shared_prefix.branch_attention`` at a GQA shape, Llama-70B's 64 query and 8
KV heads of 128 at tp=8 (8 and 1 on a rank), one row of a 1024-token prompt and 8 branches of
2048 tokens, bf16: forward and backward, where on CUDA it may run only torch's memory-efficient
kernel (a refusal raises, failing the phase). Recorded: its time; the memory it keeps for the
backward (allocated after the forward, the returned context included) and its peak, against
``parallel.memory``'s count for the same shape (q/k/v/output per token plus the core attention's
own), the phase's pass mark being that the count covers what is kept; a small case's agreement
with the CPU in float64 (a wrong mask is off by far more); which of torch's fused kernels take
the masked call with the K/V heads as they are (enable_gqa) and expanded; and what the masked
GQA call keeps when torch picks its kernel itself (the math kernel's score matrix, where no
fused kernel takes it). Skipped without CUDA: the kernel and the allocator's counters are CUDA's.
"""

from __future__ import annotations

import time

import torch

SHAPE = dict(preset="llama3-70b", tp=8, prompt=1024, branches=8, branch_len=2048)
SMALL = dict(prompt=16, branches=3, branch_len=24)  # the accuracy check's row
ACCURACY_ATOL = 1e-2  # fp32 kernels (TF32 inside) vs float64: ~1e-3; a wrong mask: ~1e-1 and more


def branch_row(heads: int, kv_heads: int, head_dim: int, prompt: int, branches: int, branch_len: int,
               dtype: torch.dtype, device: torch.device, seed: int = 0):
    """One shared-prefix row in megatron's layout: q [s, 1, heads, d], k and v [s, 1, kv_heads, d]
    (standard normal, requiring grad) and its segments [1, s], s = prompt + branches * branch_len."""
    from parallel.modules.shared_prefix import PREFIX

    segments = torch.cat([torch.full((prompt,), PREFIX)] + [torch.full((branch_len,), b + 1) for b in range(branches)])
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(len(segments), 1, h, head_dim, generator=generator).to(device, dtype).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    return q, k, v, segments[None].to(device)


def planned_bytes(preset: str, tp: int, prompt: int, branches: int, branch_len: int, dtype_size: int) -> float:
    """``parallel.memory``'s count of what one layer's attention keeps for the row: q, k, v and
    the output per token plus the shared-prefix attention's own, over the tokens of ``branches``
    padded rows of prompt + branch_len (the plan's tokens for these samples)."""
    from model_specs.presets import hf_config_dict
    from parallel.memory import ModelShape

    shape = ModelShape.from_hf(hf_config_dict(preset))
    sequence = prompt + branch_len
    tokens = branches * sequence
    return (shape.attention_elements_per_token(tp) * tokens * dtype_size
            + shape.core_attention_bytes("shared_prefix", tp=tp, cp=1, dtype_size=dtype_size, tokens=tokens,
                                         sequence_length=sequence))


def fused_kernels_taking(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Which of torch's fused SDPA kernels run a small masked call (4 branches of 64 queries over
    128 keys) on ``device``, with the K/V heads as they are (enable_gqa) and expanded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    q = torch.randn(4, heads, 64, head_dim, device=device, dtype=dtype)
    k = torch.randn(4, kv_heads, 128, head_dim, device=device, dtype=dtype)
    mask = torch.ones(4, 1, 64, 128, device=device, dtype=torch.bool).tril(64)
    taken: dict = {"masked_gqa": [], "masked_expanded": []}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        for case, keys, gqa in (("masked_gqa", k, kv_heads != heads),
                                ("masked_expanded", k.repeat_interleave(heads // kv_heads, 1), False)):
            try:
                with sdpa_kernel([backend]):
                    scaled_dot_product_attention(q, keys, keys, attn_mask=mask, enable_gqa=gqa)
                taken[case].append(backend.name)
            except RuntimeError:  # "No available kernel"
                pass
    return taken


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _kept_by_masked_gqa(heads: int, kv_heads: int, head_dim: int, prompt: int, branches: int, branch_len: int,
                        dtype: torch.dtype, device: torch.device) -> int:
    """Bytes the row's branches keep after the forward of one masked SDPA call with the K/V heads as
    they are (enable_gqa) and the kernel left to torch, its output included."""
    from torch.nn.functional import scaled_dot_product_attention

    queries = torch.randn(branches, heads, branch_len, head_dim, device=device, dtype=dtype, requires_grad=True)
    keys = torch.randn(branches, kv_heads, prompt + branch_len, head_dim, device=device, dtype=dtype,
                       requires_grad=True)
    # a branch query sees the whole prompt and its own branch up to itself
    mask = torch.ones(branch_len, prompt + branch_len, device=device, dtype=torch.bool).tril(prompt)
    mask = mask.expand(branches, 1, -1, -1).contiguous()
    before = _allocated()
    out = scaled_dot_product_attention(queries, keys, keys, attn_mask=mask, enable_gqa=True)
    kept = _allocated() - before
    del out
    return kept


def attention_check(device: torch.device, preset: str, tp: int, prompt: int, branches: int, branch_len: int,
                    dtype: torch.dtype = torch.bfloat16, reps: int = 3) -> dict:
    """The phase's measurements on ``device`` (memory only on CUDA) at this shape."""
    from model_specs.presets import hf_config_dict
    from parallel.modules.shared_prefix import branch_attention, branch_index

    hf = hf_config_dict(preset)
    heads, kv_heads = hf["num_attention_heads"] // tp, max(hf["num_key_value_heads"] // tp, 1)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    scale = head_dim ** -0.5
    cuda = device.type == "cuda"
    result = {"phase": "attention", "shape": dict(preset=preset, tp=tp, heads=heads, kv_heads=kv_heads,
                                                  head_dim=head_dim, prompt=prompt, branches=branches,
                                                  branch_len=branch_len, dtype=str(dtype).removeprefix("torch."))}
    result["fused_kernels"] = fused_kernels_taking(heads, kv_heads, head_dim, dtype, device)

    q, k, v, segments = branch_row(heads, kv_heads, head_dim, prompt, branches, branch_len, dtype, device)
    branch_index(segments)  # built once per forward and shared by the layers: not the layer's memory
    grad = torch.randn(q.shape[0], 1, heads * head_dim, device=device, dtype=dtype)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = _allocated()
    out = branch_attention(q, k, v, segments, scale)
    if cuda:
        result["kept_bytes"] = _allocated() - before
    out.backward(grad)
    if cuda:
        result["peak_bytes"] = torch.cuda.max_memory_allocated() - before
    del out
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        branch_attention(q, k, v, segments, scale).backward(grad)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result["forward_backward_ms"] = round(1000 * sorted(times)[len(times) // 2], 2)
    result["planned_bytes"] = int(planned_bytes(preset, tp, prompt, branches, branch_len, q.element_size()))
    del q, k, v, grad

    small = branch_row(heads, kv_heads, head_dim, **SMALL, dtype=torch.float64, device=torch.device("cpu"), seed=1)
    expected = branch_attention(*small[:3], small[3], scale)
    got = branch_attention(*(t.detach().to(device, torch.float32) for t in small[:3]), small[3].to(device), scale)
    result["small_max_abs_diff"] = float((got.double().cpu() - expected.detach()).abs().max())

    if cuda:
        result["masked_gqa_left_to_torch_kept_bytes"] = _kept_by_masked_gqa(
            heads, kv_heads, head_dim, prompt, branches, branch_len, dtype, device)
        result["kept_within_plan"] = result["kept_bytes"] <= result["planned_bytes"]
    result["ok"] = result["small_max_abs_diff"] <= ACCURACY_ATOL and result.get("kept_within_plan", True)
    return result


def attention_phase() -> dict:
    """The phase: ``attention_check`` at ``SHAPE`` on this GPU (a few seconds); skipped without CUDA."""
    if not torch.cuda.is_available():
        return {"phase": "attention", "ok": True,
                "skipped": "no CUDA device: the memory-efficient kernel and the allocator's counters are CUDA's"}
    result = attention_check(torch.device("cuda", torch.cuda.current_device()), **SHAPE)
    torch.cuda.empty_cache()
    return result


def report_line(r: dict) -> str:
    """The phase's line in gpu_check's report."""
    if r.get("skipped"):
        return f"attention skipped: {r['skipped']}"
    s, gib = r["shape"], 2**30
    memory = (f"kept {r['kept_bytes'] / gib:.2f} GiB (plan {r['planned_bytes'] / gib:.2f} GiB, "
              f"{'covered' if r['kept_within_plan'] else 'NOT covered'}), peak {r['peak_bytes'] / gib:.2f} GiB; "
              f"masked GQA left to torch keeps {r['masked_gqa_left_to_torch_kept_bytes'] / gib:.2f} GiB"
              if "kept_bytes" in r else "no memory counters")
    return (f"attention {s['heads']}/{s['kv_heads']} heads x {s['head_dim']}, prompt {s['prompt']} + "
            f"{s['branches']} x {s['branch_len']} {s['dtype']}: {r['forward_backward_ms']} ms fwd+bwd; {memory}; "
            f"small case vs CPU {r['small_max_abs_diff']:.1e}; fused kernels taking masked GQA "
            f"{r['fused_kernels']['masked_gqa']}, expanded {r['fused_kernels']['masked_expanded']}")
