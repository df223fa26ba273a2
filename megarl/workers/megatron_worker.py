"""One rank of the Megatron models of a run: actor (trained policy), reference, critic.

A ``MegatronWorker`` lives in its own process (a Ray actor in a run, a spawned rank in tests) and
joins torch.distributed with its peers (its group: the ranks of one resource pool); every public
method is called on all ranks of the group in lockstep. The models of one worker share megatron's
process groups, hence one layout: a reference or critic with the actor's pool lives next to the
actor (the hybrid placement, no extra processes); one on a pool of its own is a group of its own.

Log-probs, entropies and values are computed on the last pipeline stage from vocab-parallel
logits (``parallel.modules.vocab_parallel``), gathered over context parallelism, and returned by one
rank per data-parallel replica (last stage, TP rank 0, CP rank 0); the others return None.
Losses are scaled so that the gradient equals that of the loss aggregated over the WHOLE
mini-batch (``loss_agg_mode``), whatever the data-parallel size and micro-batch split: the
layout never changes the update. The losses themselves are in ``megarl.workers.losses``.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Callable

import torch

from megarl.config.schema import MEGATRON_ROLES, VALUE_ROLES, OptimSettings
from megarl.workers.batch import (
    MicroBatching,
    data_parallel_rows,
    input_lengths,
    make_micro_batch,
    make_packed_micro_batch,
    make_shared_prompt_micro_batch,
    on_device,
    packed_row_length,
    padded_length,
    prompt_groups,
    shared_prompt_row_length,
    without_last_tokens,
)
from megarl.workers.losses import LossSettings, actor_loss, critic_loss, loss_share
from model_specs import num_experts
from parallel.layout import MegatronLayout


@dataclasses.dataclass
class ModelSpec:
    """What to build for one role on every rank."""

    role: str
    hf_dir: str  # the initial weights (HF safetensors)
    layout: MegatronLayout
    batching: MicroBatching = dataclasses.field(default_factory=MicroBatching)
    optim: OptimSettings | None = None  # None = frozen (reference)
    total_optimizer_steps: int = 1  # for the learning-rate schedule
    loss: LossSettings = dataclasses.field(default_factory=LossSettings)
    dtype: str = "float32"
    # An MoE model's routers replay the batch's ``routed_experts`` (the rollout engine's choices)
    # instead of their own top-k (``parallel.modules.routing_replay``)
    routing_replay: bool = False
    # The run config's ``imports``: modules imported in the worker before the model is built, so
    # that the policy losses they register exist in this process too (the driver imported them
    # when it validated the config)
    imports: tuple[str, ...] = ()
    # megatron's MoE token dispatcher, "allgather" or "alltoall" (parallel.models; a dense model has none)
    moe_token_dispatcher: str = "allgather"
    recompute: str = "none"  # activation recompute in training: none | selective | full (parallel.models)
    overlap_grad_reduce: bool = False  # DP gradient reduction during the backward (megarl.training.wrap_ddp)


def learning_rate(optim: OptimSettings, step: int, total_steps: int) -> float:
    """``optim.lr`` after ``step`` optimizer steps: linear warm-up, then constant/linear/cosine
    decay towards ``optim.min_lr`` at ``total_steps``."""
    import math

    if step < optim.lr_warmup_steps:
        return optim.lr * (step + 1) / optim.lr_warmup_steps
    if optim.lr_schedule == "constant":
        return optim.lr
    span = max(1, total_steps - optim.lr_warmup_steps)
    progress = min(1.0, (step - optim.lr_warmup_steps) / span)
    factor = 1.0 - progress if optim.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.min_lr + (optim.lr - optim.min_lr) * factor


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse: blocks up to 1 GiB come from the heap
    (M_MMAP_THRESHOLD) and the heap is not trimmed below 2 GiB of free space (M_TRIM_THRESHOLD).

    On a CPU rank activations are host memory. By default glibc maps blocks above its mmap
    threshold (dynamic, at most 32 MiB: a 20M model's logits at L16 are 36 MiB) fresh from the
    kernel and unmaps them on free, so every training step faults the same memory in again: 0.4-1.0
    CPU-s of kernel time per update of the bench's 20M model, 0.1-0.2 s with this. The process
    keeps its peak footprint instead. Returns False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))
    except (OSError, AttributeError, TypeError):
        return False


class _Model:
    """One role's chunks on this rank (+ optimizer when trained)."""

    def __init__(self, spec: ModelSpec, chunks: list, optimizer, hf_config: dict):
        self.spec, self.chunks, self.optimizer, self.hf_config = spec, chunks, optimizer, hf_config
        self.optimizer_steps = 0

    @property
    def device(self) -> torch.device:
        """Where this model's parameters live (a GPU in a GPU run): its inputs go there."""
        return next(self.chunks[0].parameters()).device

    @property
    def modules(self) -> list:
        from parallel.models import unwrap_model

        return [unwrap_model(chunk) for chunk in self.chunks]


class MegatronWorker:
    """A rank: joins torch.distributed at construction; ``setup`` builds models."""

    def __init__(self, rank: int | None = None, world_size: int | None = None, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, threads: int | None = None, timeout_s: float = 600.0,
                 group: str = "global"):
        """Join torch.distributed as ``rank`` of ``world_size`` (unless this process already has);
        ``group`` names this set of ranks (its resource pool) in checkpoints."""
        import torch.distributed as dist

        from parallel.cpu import compat as cpu_compat

        if threads:
            torch.set_num_threads(threads)
        cpu_mode = cpu_compat.apply()
        if cpu_mode:
            keep_freed_host_memory()
        if not dist.is_initialized():
            from parallel.process_groups import distributed_backend

            # Ray gives a GPU worker one visible GPU: its local rank and device are 0, whatever its rank.
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                              WORLD_SIZE=str(world_size), LOCAL_RANK="0")
            if not cpu_mode:
                torch.cuda.set_device(0)
            dist.init_process_group(backend=distributed_backend(cuda_available=not cpu_mode),
                                    init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = group
        self.models: dict[str, _Model] = {}
        self.layout, self.seed = None, None
        self._staging = None  # shared-memory buffer of the rollout shards (rollout_shards(colocated=True), CPU)
        self._sync_plans: list = []  # resharding plans seen, whose compiled runs serve every later sync

    # ------------------------------------------------------------------ building

    def setup(self, spec: ModelSpec, seed: int) -> dict:
        """Build ``spec.role``'s model from ``spec.hf_dir`` (and its optimizer when trained)."""
        import importlib

        from megatron.core import parallel_state

        from megarl.training import build_optimizer, wrap_ddp
        from model_specs.base import dtype_from_name
        from parallel.checkpoint.convert import load_hf_into_chunks
        from parallel.checkpoint.hf_io import HFCheckpoint, chunks_layer_spec
        from parallel.models import build_model_chunks
        from parallel.process_groups import initialize_megatron

        if spec.role not in MEGATRON_ROLES:
            raise ValueError(f"unknown role {spec.role!r}; roles: {list(MEGATRON_ROLES)}")
        for module in spec.imports:
            importlib.import_module(module)
        if self.layout is None:
            initialize_megatron(spec.layout, seed=seed)
            self.layout, self.seed = spec.layout, seed
        elif spec.layout != self.layout:
            raise ValueError(f"{spec.role} layout {spec.layout} differs from this worker's {self.layout}; "
                             "models sharing a worker share its layout")
        ckpt = HFCheckpoint(spec.hf_dir)
        dtype = dtype_from_name(spec.dtype)
        # no random init: the HF load below writes every element
        build = dict(packed_sequences=spec.batching.packed, shared_prompts=spec.batching.shared_prompts,
                     moe_token_dispatcher=spec.moe_token_dispatcher, recompute=spec.recompute,
                     random_init=False)
        if spec.role in VALUE_ROLES:
            from parallel.checkpoint.convert import load_hf_into_value_chunks
            from parallel.models import build_value_model_chunks

            chunks = build_value_model_chunks(ckpt.config, spec.layout, params_dtype=dtype, **build)
            load_hf_into_value_chunks(chunks, ckpt, spec.layout)
        else:
            if spec.routing_replay and not num_experts(ckpt.config):
                raise ValueError(f"routing replay for {spec.role}: {spec.hf_dir} is not an MoE model (it has no "
                                 "routers); turn actor.routing_replay off")
            chunks = build_model_chunks(ckpt.config, spec.layout, params_dtype=dtype, **build,
                                        **({"moe_enable_routing_replay": True} if spec.routing_replay else {}))
            load_hf_into_chunks(chunks, ckpt, spec.layout)
        optimizer = None
        if spec.optim is not None:
            chunks = wrap_ddp(chunks, spec.layout, spec.overlap_grad_reduce)
            optimizer = build_optimizer(chunks, spec.optim, spec.layout)
        else:
            for chunk in chunks:
                chunk.requires_grad_(False)
        self.models[spec.role] = _Model(spec, chunks, optimizer, dict(ckpt.config))
        return {
            "rank": self.rank,
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "dp_size": parallel_state.get_data_parallel_world_size(),
            "output_rank": self._is_output_rank(),
            "layer_spec": chunks_layer_spec(chunks),  # what the weight-sync plan names the sources by
        }

    @staticmethod
    def _is_output_rank() -> bool:
        from megatron.core import parallel_state

        return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_context_parallel_rank() == 0)

    # ------------------------------------------------------------------ forward / update

    def _micro_batches(self, model: _Model, batch: dict) -> list[dict]:
        """This replica's micro-batches (see ``megarl.workers.batch``), padded to the shapes
        megatron needs: one common length and row count where ``common_micro_batch_shape`` says so
        (megatron's allgather MoE dispatcher under pipelining or across replicas, VPP on gloo), a length
        divisible by 2*CP (zig-zag) and by TP under sequence parallelism, and a micro-batch count
        divisible by PP for the interleaved schedule. Cut on the host, returned on the model's device."""
        return [on_device(mb, model.device) for mb in self._host_micro_batches(model, batch)]

    def _host_micro_batches(self, model: _Model, batch: dict) -> list[dict]:
        from megatron.core import parallel_state

        from parallel.models import common_micro_batch_shape

        layout = model.spec.layout
        if model.spec.role != "reward_model":  # only a reward model's output at the last token is used
            batch = without_last_tokens(batch)
        dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        plan = data_parallel_rows(batch, dp_size, model.spec.batching)
        multiple = (2 * layout.cp if layout.cp > 1 else 1) * (layout.tp if layout.sequence_parallel else 1)
        lengths = input_lengths(batch).tolist()
        common_shape = common_micro_batch_shape(layout, model.spec.moe_token_dispatcher if num_experts(model.hf_config) else None)
        longest_all = max(lengths)
        most_rows = max(len(rows) for share in plan for rows in share)
        mine = plan[dp_rank]
        if layout.vpp and len(mine) % layout.pp:
            mine = mine + [[] for _ in range(layout.pp - len(mine) % layout.pp)]
        if model.spec.batching.packed:  # one row per micro-batch; sequences in slots CP can split
            slot = 2 * layout.cp if layout.cp > 1 else 1
            row_multiple = layout.sequence_length_multiple()
            if common_shape:  # one shape for every micro-batch, all replicas'
                longest = max(packed_row_length(batch, rows, slot) for share in plan for rows in share)
                row_lengths = [longest] * len(mine)
            else:
                row_lengths = [packed_row_length(batch, rows, slot) for rows in mine]
            return [make_packed_micro_batch(batch, rows, padded_length(length, row_multiple), slot)
                    for rows, length in zip(mine, row_lengths)]
        if model.spec.batching.shared_prompts:  # one row per prompt, its samples as branches
            row_length = lambda gs: max([shared_prompt_row_length(batch, g) for g in gs] or [1])  # noqa: E731
            groups = [prompt_groups(batch, rows) for rows in mine]
            if common_shape:  # one shape for every micro-batch, all replicas'
                everyone = [prompt_groups(batch, rows) for share in plan for rows in share]
                shapes = [(max(map(row_length, everyone)), max(max(len(gs), 1) for gs in everyone))] * len(mine)
            else:
                shapes = [(row_length(gs), max(len(gs), 1)) for gs in groups]
            return [make_shared_prompt_micro_batch(batch, gs, padded_length(length, multiple), count)
                    for gs, (length, count) in zip(groups, shapes)]
        micro = []
        for rows in mine:
            longest = longest_all if common_shape else max([lengths[r] for r in rows] or [1])
            num_rows = most_rows if common_shape else max(len(rows), 1)
            micro.append(make_micro_batch(batch, rows, padded_length(longest, multiple), num_rows))
        return micro

    def _run(self, model: _Model, micro: list[dict], loss_of: Callable, forward_only: bool) -> list[dict]:
        """megatron's forward(-backward) schedule over ``micro``; ``loss_of(micro_batch, logits_or_values)``
        returns (loss, stats dict) on the last stage. Returns the stats of every micro-batch."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from parallel.models import unwrap_model
        from parallel.modules.context_parallel import split_for_context_parallel
        from parallel.modules.routing_replay import replay_routes

        moe = bool(num_experts(model.hf_config))

        def padding(mask: torch.Tensor) -> dict:
            """megatron's ``padding_mask`` argument for an MoE model: its load-balancing loss then
            leaves the padding out (the rest of the model never mixes it into real tokens)."""
            return {"padding_mask": mask} if moe else {}

        def replay(module, routes: torch.Tensor | None) -> None:
            """The rollout's experts for this micro-batch's tokens (this CP rank's positions)."""
            if model.spec.routing_replay:
                replay_routes(unwrap_model(module), routes)

        def forward_step(data_iterator, module):
            mb = next(data_iterator)
            if "packed" in mb:  # row positions of this CP rank's tokens; RoPE restarts per sequence
                packed = mb["packed"]
                mine = packed.local_positions().to(mb["tokens"].device)
                replay(module, mb["routes"][:, mine] if "routes" in mb else None)
                local = {"tokens": mb["tokens"][:, mine], "targets": mb["targets"][:, mine],
                         "position_ids": mine.unsqueeze(0)}
                output = module(local["tokens"], packed.position_ids[:, mine], attention_mask=None,
                                packed_seq_params=packed.packed_seq_params(), **padding(mb["padding_mask"][:, mine]))
                return output, lambda out: loss_of(mb, local, out)
            if "segments" in mb:  # shared-prompt rows: per-token RoPE positions, attention per branch
                from parallel.modules.shared_prefix import rotary_positions

                local = {"targets": mb["targets"], "position_ids": mb["position_ids"]}
                replay(module, mb.get("routes"))
                with rotary_positions(unwrap_model(module), mb["position_ids"]):
                    output = module(mb["tokens"], mb["position_ids"], attention_mask=mb["segments"],
                                    **padding(mb["padding_mask"]))
                return output, lambda out: loss_of(mb, local, out)
            tokens = mb["tokens"]
            positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
            local = split_for_context_parallel({"tokens": mb["tokens"], "targets": mb["targets"],
                                                "position_ids": positions, "padding_mask": mb["padding_mask"],
                                                **({"routes": mb["routes"]} if "routes" in mb else {})})
            replay(module, local.get("routes"))
            output = module(local["tokens"], local["position_ids"], attention_mask=None,
                            **padding(local["padding_mask"]))
            return output, lambda out: loss_of(mb, local, out)

        chunks = model.chunks
        for chunk in chunks:
            chunk.train(not forward_only)
        iterators = [iter(micro) for _ in chunks]
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro), seq_length=micro[0]["tokens"].shape[1],
            micro_batch_size=micro[0]["tokens"].shape[0], forward_only=forward_only,
        )

    def _token_outputs(self, model: _Model, mb: dict, local: dict, output: torch.Tensor,
                       with_entropy: bool) -> dict[str, torch.Tensor]:
        """Response-shaped ``[rows, R]`` log-probs/entropy (LM) or values of a micro-batch: the
        critic's before each response token (at the position predicting it), the reward model's
        after it (at the token itself: the last one's is the sequence's score)."""
        from parallel.modules.context_parallel import undo_context_parallel_split
        from parallel.modules.vocab_parallel import vocab_parallel_log_probs

        if model.spec.role in VALUE_ROLES:
            per_token = {"values": undo_context_parallel_split(output.squeeze(-1), local["position_ids"])}
        else:
            logp, entropy = vocab_parallel_log_probs(output, local["targets"], model.hf_config["vocab_size"],
                                                     with_entropy=with_entropy)
            per_token = {"logp": undo_context_parallel_split(logp, local["position_ids"])}
            if entropy is not None:
                per_token["entropy"] = undo_context_parallel_split(entropy, local["position_ids"])
        index = mb["gather_index"]  # [rows, R] positions; a packed micro-batch is one row of all
        if model.spec.role == "reward_model":
            index = index + 1
        if "segments" in mb:  # shared-prompt rows: positions in the flattened rows
            per_token = {key: value.reshape(1, -1) for key, value in per_token.items()}
        return {key: value.expand(len(index), -1).gather(1, index) for key, value in per_token.items()}

    @torch.no_grad()
    def forward(self, role: str, batch: dict, with_entropy: bool = False) -> dict | None:
        """Per-response-token log-probs (``logp``, ``entropy``) or values (critic) of every row of
        ``batch`` (0 past each response's end); returned by this replica's output rank as
        {"rows", <field>: [n, R]}, else None."""
        model = self.models[role]
        micro = self._micro_batches(model, batch)

        def loss_of(mb, local, output):
            outputs = self._token_outputs(model, mb, local, output, with_entropy)
            real = mb["response_mask"].bool()  # past a response's end: 0, whatever was gathered
            outputs = {key: torch.where(real, value, torch.zeros_like(value)) for key, value in outputs.items()}
            return output.sum() * 0.0, {"rows": mb["rows"], **outputs}

        collected = self._run(model, micro, loss_of, forward_only=True)
        if not self._is_output_rank():
            return None
        collected = [{key: value.cpu() for key, value in item.items()} for item in collected]  # for the driver
        rows = torch.cat([item["rows"] for item in collected])
        real = rows >= 0
        return {key: torch.cat([item[key] for item in collected])[real] for key in collected[0]}

    def update(self, role: str, batch: dict, global_counts: dict[str, float]) -> dict[str, float]:
        """One optimizer step of ``role`` ("actor" or "critic") on ``batch`` (this mini-batch,
        the same on every rank). ``global_counts`` = {"tokens", "sequences"} of the mini-batch,
        the denominators of the loss aggregation. Returns metrics (on every rank)."""
        from megatron.core import parallel_state

        model = self.models[role]
        if model.optimizer is None:
            raise ValueError(f"{role} is frozen (built without optimizer settings)")
        lr = learning_rate(model.spec.optim, model.optimizer_steps, model.spec.total_optimizer_steps)
        for group in model.optimizer.param_groups:
            group["lr"] = lr
        micro = self._micro_batches(model, batch)
        scale = len(micro) * parallel_state.get_data_parallel_world_size()
        loss_fn = critic_loss if role == "critic" else actor_loss

        def loss_of(mb, local, output):
            outputs = self._token_outputs(model, mb, local, output, with_entropy=role == "actor")
            weight = loss_share(model.spec.loss.loss_agg_mode, mb["response_mask"], global_counts)
            loss, stats = loss_fn(model.spec.loss, mb, outputs)
            weighted = {key: float(value) * weight for key, value in stats.items()}
            return loss * weight * scale, {"weighted": weighted, "weight": weight}

        for chunk in model.chunks:
            chunk.zero_grad_buffer()
        model.optimizer.zero_grad()
        collected = self._run(model, micro, loss_of, forward_only=False)
        update_successful, grad_norm, _ = model.optimizer.step()
        model.optimizer_steps += 1
        metrics = _reduce_weighted(collected)
        metrics.update({"grad_norm": float(grad_norm or 0.0), "lr": lr, "update_ok": float(bool(update_successful))})
        return {f"{role}/{key}": value for key, value in metrics.items()}

    # ------------------------------------------------------------------ weight sync

    def rollout_shards(self, plan, colocated: bool = False, bucket_bytes: int = 256 << 20):
        """Run this rank's part of the actor -> SGLang resharding ``plan`` into flat buckets (of
        about ``bucket_bytes``) on the device of the actor's parameters; returns the SGLang rank's
        ``megarl.rollout.weight_sync.RankShards`` assembled on this device (None if none is).
        ``colocated`` (the engine rank runs on this device): each bucket travels as one handle of
        its buffer, a CUDA IPC handle on a GPU, this worker's shared-memory staging buffer on CPU,
        and the engine's schedulers copy straight out of it; otherwise its bytes go through Ray."""
        import torch.distributed as dist

        from megarl.rollout.sglang.transport import SharedMemoryStaging, bucket_layouts, flat_views
        from megarl.rollout.weight_sync import allocate_flats, pack_rank_shards
        from parallel.reshard.execute import execute_plan

        device = dist.get_rank()
        for known in self._sync_plans:  # the trainer sends the same plans at every sync
            if known == plan:
                plan = known
                break
        else:
            self._sync_plans.append(plan)
        modules = self.models["actor"].modules
        sources = {(i, name): p.data for i, module in enumerate(modules) for name, p in module.named_parameters()}
        wanted = plan.destinations.get(device, {})
        if not wanted:
            return None
        first = next(iter(sources.values()))
        if first.is_cuda:
            torch.cuda.ipc_collect()  # the last sync's buckets, which the engine has loaded and released
        elif colocated:
            self._staging = self._staging or SharedMemoryStaging()
        layouts = bucket_layouts({name: (t.shape, first.dtype) for name, t in wanted.items()}, bucket_bytes)
        flats = allocate_flats(layouts, first.device, self._staging if colocated else None)
        buffers = {name: view for layout, flat in zip(layouts, flats) for name, view in flat_views(flat, layout).items()}
        # a persistent staging buffer is the same storage at every sync: keep the views
        execute_plan(plan, device, sources, buffers, reuse_views=flats[0].is_shared() and not first.is_cuda)
        return pack_rank_shards(layouts, flats, named=colocated)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str) -> None:
        """Collective: every trained model's weights and optimizer state as Megatron distributed
        checkpoints (loadable at any layout) under ``directory/<role>`` and
        ``directory/optimizer/<role>``, and this rank's optimizer step counts and RNG states
        (``megarl.workers.rank_state``). Frozen models (the reference) are not saved: a resumed run
        rebuilds them from their initial weights."""
        from pathlib import Path

        from megarl.workers.rank_state import rank_state_file, save_rank_state
        from parallel.checkpoint.dist_ckpt import save_megatron_checkpoint, save_optimizer_checkpoint

        for role, model in self.models.items():
            if model.optimizer is not None:
                save_megatron_checkpoint(model.chunks, Path(directory) / role, model.hf_config, model.spec.layout)
                save_optimizer_checkpoint(model.optimizer, model.chunks, Path(directory) / "optimizer" / role)
        save_rank_state(rank_state_file(directory, self.group, self.rank), self.layout, self.world_size,
                        {role: m.optimizer_steps for role, m in self.models.items()})
        torch.distributed.barrier()

    def load_checkpoint(self, directory: str) -> bool:
        """Collective: restore what ``save_checkpoint`` wrote, at the layout and world size it was
        saved at or at others (elastic resume): weights and optimizer states reshard through the
        distributed checkpoints, step counts are global, RNG states are restored or re-seeded
        (``megarl.workers.rank_state.restore_rng``). Returns whether they were restored (the resume
        is then exact)."""
        from pathlib import Path

        from megarl.workers.rank_state import load_rank_state, restore_rng
        from parallel.checkpoint.dist_ckpt import load_megatron_checkpoint, load_optimizer_checkpoint

        state = load_rank_state(directory, self.group, self.rank)
        for role, model in self.models.items():
            if model.optimizer is not None:
                load_megatron_checkpoint(model.chunks, Path(directory) / role)
                load_optimizer_checkpoint(model.optimizer, model.chunks, Path(directory) / "optimizer" / role)
            model.optimizer_steps = state["optimizer_steps"][role]
        return restore_rng(state, self.layout, self.world_size, self.seed, self.rank)

    def export_hf(self, target: str) -> None:
        """Collective: the actor's weights as an HF checkpoint at ``target`` (atomic)."""
        from parallel.checkpoint.convert import export_hf_checkpoint

        model = self.models["actor"]
        export_hf_checkpoint(model.chunks, model.hf_config, model.spec.layout, target)

    def release_cached_memory(self) -> None:
        """Give the CUDA caching allocator's free blocks back to the device (after an update), so
        that colocated SGLang engines can take their memory back; nothing to do without CUDA."""
        torch.cuda.empty_cache()

    def shutdown(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _reduce_weighted(collected: list[dict]) -> dict[str, float]:
    """Mini-batch means of the per-micro-batch stats (weights sum to 1 over all replicas),
    summed over data parallelism and shared from the last pipeline stage with every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    names = sorted({key for item in collected for key in item["weighted"]})
    local = torch.tensor([sum(item["weighted"].get(name, 0.0) for item in collected) for name in names],
                         dtype=torch.float64)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if not last:
        local = torch.zeros(0, dtype=torch.float64)
    # Names travel with the values: stages other than the last do not know them.
    shared = [None]
    if last:
        dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
        shared = [dict(zip(names, local.tolist()))]
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    last_rank = parallel_state.get_pipeline_model_parallel_last_rank()
    dist.broadcast_object_list(shared, src=last_rank, group=pp_group)
    return shared[0]
