"""SGLang's own answer to "what does TP rank r of an SGLang engine hold?" (a test oracle only).

For an HF checkpoint directory, :func:`sglang_rank_parameters` builds SGLang's OWN model class for
the checkpoint's architecture (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``MistralForCausalLM`` from ``sglang.srt.models``) as TP rank ``rank`` of ``tp_size``, loads the
HF tensors with the model's own ``load_weights`` and returns every named parameter. Nothing of
megarl's layout code is involved: the fused QKV (``[q_r; k_r; v_r]``, KV heads replicated when
``tp_size`` > KV heads), stacked ``gate_up_proj``, the vocab padding and the TP slices are
SGLang's.

How one process plays every rank (see docs/cpu.md): no torch.distributed. For
each rank, publish ``ServerArgs(device="cpu", tp_size=t)`` with role ``"test"`` and
``SpawnRanks(world_rank=r)``, stamp fake group handles (rank_in_group / world_size / ranks) for
every group SGLang reads, construct, load, read ``named_parameters()``, then ``clear_stamp()``
before the next rank. A fake group has no communication methods: a model that tried a
collective during construction or loading would fail loudly, not silently.

Deliberately WITHOUT ``SGLANG_USE_CPU_ENGINE``: with it SGLang's loaders zero-pad splits that do
not divide (a CPU-only behaviour), so this oracle states the layout of SGLang's GPU path. For the
tiny presets (every split divides) the two layouts are the same. Without the CPU platform,
SGLang's rotary embedding imports ``vllm._custom_ops.rotary_embedding`` at construction (its
non-CUDA fallback kernel); the oracle process gets a placeholder module that raises if called.
It is never called: nothing runs a forward pass here.

Everything runs in a fresh subprocess (SGLang's published config, its process-wide stamps, the
CPU import stubs and the vllm placeholder stay out of the caller, e.g. pytest), which computes
all ranks of one or more ``(hf_dir, tp_size)`` at once (:func:`sglang_oracle_batch`); the result
is cached in the caller per checkpoint file state, so asking for rank 1 after rank 0 is free. One
process takes ~10 s (SGLang's imports dominate; building and loading a rank takes ~0.02 s), so
a test that needs many checkpoints and TP sizes asks for them in one batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

_PROJECT_ROOT = Path(__file__).resolve().parents[1]

# HF architecture -> the sglang.srt.models module defining SGLang's class of that name. Importing
# the module directly skips SGLang's model registry, which imports every model (~4 s).
ARCHITECTURE_MODULES = {
    "LlamaForCausalLM": "sglang.srt.models.llama",
    "Qwen2ForCausalLM": "sglang.srt.models.qwen2",
    "Qwen3ForCausalLM": "sglang.srt.models.qwen3",
    "MistralForCausalLM": "sglang.srt.models.mistral",
    "Qwen3MoeForCausalLM": "sglang.srt.models.qwen3_moe",
    "MixtralForCausalLM": "sglang.srt.models.mixtral",
}

# Groups SGLang's models and layers read through get_parallel(); which of them have width tp_size
# (the expert groups split it: moe_ep_group ep_size wide, moe_tp_group tp_size / ep_size; the rest
# are width 1: no context/pipeline parallelism).
_TP_WIDE_GROUPS = ("world_group", "tp_group", "attn_tp_group", "shared_experts_tp_group")
_SINGLETON_GROUPS = ("moe_dp_group", "attn_cp_group", "pp_group")


def sglang_rank_parameters(hf_dir: str | os.PathLike, tp_size: int, rank: int) -> dict[str, torch.Tensor]:
    """Every named parameter of SGLang's model for ``hf_dir`` as TP rank ``rank`` of ``tp_size``
    holds it after loading the checkpoint: ``{name: tensor}`` (fresh copies, in
    ``named_parameters()`` order, SGLang's names such as ``model.layers.0.self_attn.qkv_proj.weight``).

    Tied embeddings: ``named_parameters()`` lists a shared parameter once, so with
    ``tie_word_embeddings`` there is NO ``lm_head.weight`` entry (SGLang's ``lm_head`` is the
    ``model.embed_tokens`` module itself); untied checkpoints have a separate ``lm_head.weight``.
    """
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not a rank of tp_size {tp_size}")
    return {k: v.clone() for k, v in sglang_all_rank_parameters(hf_dir, tp_size)[rank].items()}


def sglang_all_rank_parameters(hf_dir: str | os.PathLike, tp_size: int, ep_size: int = 1) -> list[dict[str, torch.Tensor]]:
    """:func:`sglang_rank_parameters` for every rank (index = rank); an MoE model's experts under
    SGLang's expert parallelism ``ep_size`` (``--ep-size``, inside the TP group). Cached per
    checkpoint state: do not modify the returned tensors."""
    return sglang_oracle_batch([(hf_dir, tp_size, ep_size)])[0]


_CACHE: dict[tuple, list[dict[str, torch.Tensor]]] = {}


def sglang_oracle_batch(requests: list[tuple]) -> list[list[dict[str, torch.Tensor]]]:
    """:func:`sglang_all_rank_parameters` for each ``(hf_dir, tp_size)`` or ``(hf_dir, tp_size,
    ep_size)``; the uncached ones are computed together in ONE oracle process, so SGLang's imports
    (~10 s) are paid once, not per request."""
    keys = [_cache_key(*request) for request in requests]
    missing = list(dict.fromkeys(key for key in keys if key not in _CACHE))
    if missing:
        _CACHE.update(zip(missing, _run_oracle([(hf_dir, tp_size, ep_size) for hf_dir, tp_size, ep_size, _ in missing])))
    return [_CACHE[key] for key in keys]


def _cache_key(hf_dir: str | os.PathLike, tp_size: int, ep_size: int = 1) -> tuple:
    hf_dir = os.path.realpath(hf_dir)
    stamp = tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size)
                         for p in Path(hf_dir).iterdir() if p.suffix in (".safetensors", ".json")))
    return hf_dir, int(tp_size), int(ep_size), stamp


def _run_oracle(requests: list[tuple[str, int, int]]) -> list[list[dict[str, torch.Tensor]]]:
    from megarl.rollout.sglang.engine import child_env

    env = child_env()
    env.pop("SGLANG_USE_CPU_ENGINE", None)  # the GPU path's layout, see the module docstring
    env.setdefault("OMP_NUM_THREADS", "1")
    args = [str(item) for request in requests for item in request]
    with tempfile.TemporaryDirectory(prefix="megarl-sglang-oracle-") as tmp:
        out = os.path.join(tmp, "ranks.pt")
        res = subprocess.run([sys.executable, "-m", "tests.sglang_oracle", out, *args],
                             env=env, cwd=str(_PROJECT_ROOT), capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"SGLang oracle failed for {requests} "
                               f"(exit {res.returncode}):\n{res.stderr[-4000:]}")
        return torch.load(out, weights_only=True)


# ---------------------------------------------------------------------- the oracle process


def _install_vllm_placeholder() -> None:
    import types

    def rotary_embedding(*args, **kwargs):
        raise RuntimeError("sglang oracle: the vllm rotary-embedding placeholder was called")

    vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding
    vllm._custom_ops = ops
    sys.modules.setdefault("vllm", vllm)
    sys.modules.setdefault("vllm._custom_ops", ops)


def _fake_group(name: str, rank: int, size: int):
    """A group handle with the bookkeeping SGLang reads and no communication methods."""
    import types

    return types.SimpleNamespace(
        unique_name=name, rank_in_group=rank, world_size=size, ranks=list(range(size)),
        rank=rank, local_rank=rank, first_rank=0, last_rank=size - 1,
        is_first_rank=rank == 0, is_last_rank=rank == size - 1,
        next_rank=(rank + 1) % size, prev_rank=(rank - 1) % size,
        cpu_group=None, device_group=None)


def _hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _build_rank(hf_dir: str, tp_size: int, ep_size: int, rank: int, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import importlib

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    parallel = get_parallel()
    parallel.clear_stamp()
    server_args = ServerArgs(model_path=hf_dir, device="cpu", tp_size=tp_size, ep_size=ep_size, dtype="float32",
                             skip_tokenizer_init=True)
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=rank))
    moe_tp_size = tp_size // ep_size  # SGLang's moe_tp group: consecutive blocks of the TP group
    parallel.override_permanently(
        **{g: _fake_group(g, rank, tp_size) for g in _TP_WIDE_GROUPS},
        moe_ep_group=_fake_group("moe_ep_group", rank // moe_tp_size, ep_size),
        moe_tp_group=_fake_group("moe_tp_group", rank % moe_tp_size, moe_tp_size),
        **{g: _fake_group(g, 0, 1) for g in _SINGLETON_GROUPS})
    assert (parallel.tp_rank, parallel.tp_size) == (rank, tp_size), (parallel.tp_rank, parallel.tp_size)
    assert (parallel.moe_ep_rank, parallel.moe_ep_size) == (rank // moe_tp_size, ep_size), \
        (parallel.moe_ep_rank, parallel.moe_ep_size)

    model_config = ModelConfig.from_server_args(server_args)
    archs = model_config.hf_config.architectures or []
    known = [a for a in archs if a in ARCHITECTURE_MODULES]
    if not known:
        raise ValueError(f"{hf_dir}: architectures {archs}; the oracle knows {sorted(ARCHITECTURE_MODULES)}")
    model_class = getattr(importlib.import_module(ARCHITECTURE_MODULES[known[0]]), known[0])
    with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        model = model_class(config=model_config.hf_config, quant_config=None)
    model.load_weights(iter(hf.items()))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    parallel.clear_stamp()
    return params


def _main(out: str, requests: list[tuple[str, int, int]]) -> None:
    from megarl.rollout.sglang.cpu.stubs import install

    install()
    _install_vllm_placeholder()
    if os.environ.get("SGLANG_USE_CPU_ENGINE"):
        raise SystemExit("the SGLang oracle must run without SGLANG_USE_CPU_ENGINE")
    results = []
    for hf_dir, tp_size, ep_size in requests:
        hf = _hf_tensors(hf_dir)
        results.append([_build_rank(hf_dir, tp_size, ep_size, r, hf) for r in range(tp_size)])
    torch.save(results, out)


if __name__ == "__main__":  # out.pt hf_dir tp_size ep_size [hf_dir tp_size ep_size ...]
    _main(sys.argv[1], [(sys.argv[i], int(sys.argv[i + 1]), int(sys.argv[i + 2])) for i in range(2, len(sys.argv), 3)])
