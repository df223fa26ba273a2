"""The dry run of a launch: what a run config asks of a cluster, before any node is allocated.

``megarl plan <config> [overrides] [--gpu-memory-gib N]`` loads and validates the config, then
states per role (actor, reference, critic, reward model, rollout) its pool, world, layout and data-parallel
size, the core attention its Megatron model will build (``parallel.models.core_attention_kind``,
the choice ``parallel.models.transformer_layer_spec`` makes), and the per-GPU memory
(``parallel.memory``) of each role and of each pool over the phases of a step, against a
per-GPU budget (``cluster.gpu_memory_gib``, or ``--gpu-memory-gib``), with a verdict. The sbatch
scripts in ``launch_scripts/`` run it first (and only it, with ``--dry-run``), so a layout that
cannot work or memory that cannot fit fails on a laptop rather than after the queue.

Phases of a pool (what is on a GPU at the same time):

* resident: the states of every role on the pool: the actor's and critic's parameters,
  fp32 gradients and Adam states, the reference's and reward model's parameters. megarl keeps them on the GPU for
  the whole run (no offloading).
* generate: resident + SGLang's static reservation (colocated rollout).
* <role> update / forward: resident + that role's activations (and logits) + SGLang's
  reservation. The trainer asks colocated engines to release their memory while Megatron
  trains (``RolloutManager.release_memory``), but that is not yet tested on GPUs, so the plan
  still counts it (conservative).
* plus ``parallel.memory.RUNTIME_RESERVE_BYTES`` (CUDA context, NCCL, fragmentation) everywhere.

SGLang's reservation is ``mem_fraction_static`` of the memory free when the engines start,
after the colocated Megatron workers have built their models and optimizers.

Each role contributes its own busiest rank (the first pipeline stage for a trained model: most
activations in flight; the last for a forward-only one: the logits), and a pool adds them up as
if they were on one GPU: conservative by at most the embedding/output-layer shard and the logits.
The plan follows the config's pools, as ``megarl train`` places its workers.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from typing import Any

from megarl.config.schema import TRAINED_ROLES, VALUE_ROLES, RunConfig
from parallel.memory import (
    DTYPE_BYTES,
    RUNTIME_RESERVE_BYTES,
    GiB,
    MemoryEstimate,
    ModelShape,
    RolloutMemory,
    rollout_memory,
    training_memory,
)


@dataclasses.dataclass
class RolePlan:
    role: str
    pool: str
    world: int
    layout: str  # human-readable
    dp: int
    batching: str  # human-readable micro-batching / engine load
    memory: MemoryEstimate | None = None
    rollout: RolloutMemory | None = None
    engines: int = 0
    attention: str | None = None  # the Megatron model's core attention (parallel.models.core_attention_kind)


@dataclasses.dataclass
class PoolPlan:
    name: str
    ranks: int
    roles: list[str]
    resident: int
    phases: dict[str, int]  # phase -> bytes per GPU (runtime reserve included)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def peak(self) -> int:
        return self.phases[self.peak_phase]


@dataclasses.dataclass
class LaunchPlan:
    config: RunConfig
    budget: int
    recompute: str
    roles: list[RolePlan]
    pools: list[PoolPlan]
    problems: list[str]  # the run does not fit: one line each, naming the key and the fix
    warnings: list[str]  # it fits, but something is worth knowing (slow, tight)

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        roles = {}
        for r in self.roles:
            entry: dict[str, Any] = {"pool": r.pool, "world": r.world, "dp": r.dp, "layout": r.layout}
            if r.memory is not None:
                entry.update(attention=r.attention, memory_bytes=dict(r.memory.components))
            if r.rollout is not None:
                entry.update(engines=r.engines, weights_bytes=r.rollout.weights, kv_pool_bytes=r.rollout.kv_pool,
                             kv_capacity_tokens=r.rollout.kv_capacity_tokens, tokens_needed=r.rollout.tokens_needed)
            roles[r.role] = entry
        return {"budget_bytes": self.budget, "fits": self.fits, "roles": roles,
                "pools": {p.name: {"ranks": p.ranks, "roles": p.roles, "phases_bytes": p.phases,
                                   "peak_bytes": p.peak} for p in self.pools},
                "problems": self.problems, "warnings": self.warnings}


def _micro_batching(cfg: RunConfig, role: str, dp: int, seq: int) -> tuple[int, int, str]:
    """(tokens per micro-batch, micro-batches per optimizer step and DP rank, description)."""
    section = getattr(cfg, role)
    mini = getattr(section, "mini_batch_size", None) or cfg.data.batch_size
    samples_per_rank = max(1, mini * cfg.rollout.n // dp)
    budget = getattr(section, "max_tokens_per_micro_batch", None)
    if budget is not None:
        micro = max(1, math.ceil(samples_per_rank * seq / budget))
        return budget, micro, f"token budget {budget}, ~{micro} micro-batches/step/rank"
    mbs = section.micro_batch_size
    micro = max(1, samples_per_rank // mbs)
    return mbs * seq, micro, f"{mbs} x {seq} tokens, {micro} micro-batches/step/rank"


def plan_run(cfg: RunConfig, gpu_memory_gib: float | None = None, recompute: str | None = None) -> LaunchPlan:
    """The launch plan of a validated config (``megarl.config.load_config``) against GPUs of
    ``gpu_memory_gib`` GiB (None: the config's ``cluster.gpu_memory_gib``), with activation
    ``recompute`` (None: the config's ``actor.recompute``)."""
    from megarl.config.validate import model_hf_config
    from parallel.models import core_attention_kind, default_layer_spec

    hf = model_hf_config(cfg.model.path)
    dtype = cfg.model.dtype
    layer_spec = default_layer_spec(hf)  # what a build on this machine uses: TE where it imports
    budget = int((cfg.cluster.gpu_memory_gib if gpu_memory_gib is None else gpu_memory_gib) * GiB)
    seq = cfg.data.max_prompt_length + cfg.max_response_length
    recompute = cfg.actor.recompute if recompute is None else recompute
    roles: list[RolePlan] = []
    problems: list[str] = []
    warnings: list[str] = []

    for role in cfg.megatron_roles:
        trainable = role in TRAINED_ROLES
        layout = cfg.layout_for(role)
        world = cfg.world_size_for(role)
        dp = world // (layout.tp * layout.pp * layout.cp)
        own_model = getattr(getattr(cfg, role), "model_path", None)
        model_hf = model_hf_config(own_model) if own_model else hf
        tokens, micro, text = _micro_batching(cfg, role, dp, seq)
        attention = core_attention_kind(layout, cfg.actor.sequence_packing, cfg.shared_prompt_rows, layer_spec)
        estimate = training_memory(model_hf, layout, dp=dp, dtype=dtype, tokens_per_micro_batch=tokens,
                                   micro_batches=micro, trainable=trainable,
                                   value_head=role in VALUE_ROLES, recompute=recompute, role=role,
                                   attention=attention, sequence_length=seq)
        roles.append(RolePlan(role, cfg.pool_for(role), world, str(layout), dp, text, memory=estimate,
                              attention=attention))

    # Pools: resident training states first (SGLang sizes itself from what is left).
    r = cfg.rollout
    rollout_pool = cfg.pool_for("rollout")
    pools: dict[str, PoolPlan] = {}
    for plan in roles:
        pool = pools.setdefault(plan.pool, PoolPlan(plan.pool, cfg.cluster.pool_sizes()[plan.pool], [], 0, {}))
        pool.roles.append(plan.role)
        m = plan.memory.components
        pool.resident += m["params"] + m.get("grads", 0) + m.get("optimizer", 0)

    rollout_world = cfg.world_size_for("rollout")
    engines = max(1, rollout_world // r.tp)
    sequences = math.ceil(cfg.data.batch_size * r.n / engines)
    pool = pools.setdefault(rollout_pool, PoolPlan(rollout_pool, cfg.cluster.pool_sizes()[rollout_pool], [], 0, {}))
    pool.roles.append("rollout")
    free = budget - RUNTIME_RESERVE_BYTES - pool.resident
    rm = rollout_memory(hf, r.tp, dtype=dtype, free_bytes=max(free, 0), mem_fraction_static=r.mem_fraction_static,
                        sequences_per_engine=sequences, tokens_per_sequence=seq)
    roles.append(RolePlan("rollout", rollout_pool, rollout_world,
                          f"SGLang tp={r.tp}{f' ep={r.ep}' if r.ep > 1 else ''} ({r.placement})",
                          engines, f"{sequences} sequences/engine x {seq} tokens", rollout=rm, engines=engines))

    for pool in pools.values():
        base = pool.resident + RUNTIME_RESERVE_BYTES
        sglang = rm.reserved if "rollout" in pool.roles else 0
        if "rollout" in pool.roles:
            pool.phases["generate"] = base + sglang
        for plan in roles:
            if plan.pool != pool.name or plan.memory is None:
                continue
            m = plan.memory.components
            phase = f"{plan.role} {'update' if plan.role != 'ref' else 'forward'}"
            pool.phases[phase] = base + m["activations"] + m["logits"] + sglang

    # Verdicts.
    if rm.kv_pool <= 0:
        one = math.ceil(100 * (rm.weights + rm.kv_per_token * seq) / max(free, 1)) / 100
        step = math.ceil(100 * (rm.weights + rm.kv_per_token * rm.tokens_needed) / max(free, 1)) / 100
        fix = (f"raise it to at least {one:.2f} (one sequence at a time; {step:.2f} holds a whole step)" if one < 1
               else "free memory for the engines (smaller training states: a larger actor.layout.tp/pp)")
        problems.append(
            f"rollout.mem_fraction_static={r.mem_fraction_static}: SGLang would reserve "
            f"{r.mem_fraction_static * max(free, 0) / GiB:.1f} GiB "
            f"({r.mem_fraction_static} of the {max(free, 0) / GiB:.1f} GiB free when it starts) but its weights alone "
            f"take {rm.weights / GiB:.1f} GiB per GPU at rollout.tp={r.tp}; {fix}, raise rollout.tp, "
            "or give the rollout its own pool (rollout.placement=separate)")
    elif rm.concurrency_fraction < 1:
        waves = math.ceil(rm.tokens_needed / max(rm.kv_capacity_tokens, 1))
        warnings.append(
            f"rollout: the KV pool holds {rm.kv_capacity_tokens} tokens per engine but a step's {sequences} sequences "
            f"x {seq} tokens need {rm.tokens_needed}: generation runs in ~{waves} waves (slower, not an error); "
            "raise rollout.mem_fraction_static or rollout.tp to avoid it")
    for pool in pools.values():
        margin = budget - pool.peak
        if margin < 0:
            problems.append(
                f"pool {pool.name!r} ({', '.join(pool.roles)}): {pool.peak_phase} needs {pool.peak / GiB:.1f} GiB per GPU, "
                f"over the {budget / GiB:.0f} GiB budget by {-margin / GiB:.1f} GiB; "
                + _fixes(cfg, pool))
        elif margin < 0.05 * budget:
            warnings.append(f"pool {pool.name!r}: {pool.peak_phase} leaves only {margin / GiB:.1f} GiB of "
                            f"{budget / GiB:.0f} GiB; allocator fragmentation may still run it out of memory")
    return LaunchPlan(cfg, budget, recompute, roles, list(pools.values()), problems, warnings)


def _fixes(cfg: RunConfig, pool: PoolPlan) -> str:
    fixes = ["lower actor.micro_batch_size (or set actor.max_tokens_per_micro_batch)",
             "raise actor.layout.tp or actor.layout.pp (more GPUs per model copy)"]
    if not cfg.actor.layout.use_distributed_optimizer:
        fixes.insert(0, "set actor.layout.use_distributed_optimizer=true (shards Adam over data parallel)")
    if "rollout" in pool.roles and cfg.rollout.placement == "colocated":
        fixes.append("lower rollout.mem_fraction_static, or give the rollout its own pool "
                     "(cluster/gpu-32x8-split: rollout.placement=separate)")
    return "fix: " + "; or ".join(fixes)


def _count(n: float) -> str:
    return next(f"{n / d:.2f}{u}" for d, u in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, "")) if n >= d or d == 1)


def _gib(n: float) -> str:
    return f"{n / GiB:6.1f}"


def format_plan(plan: LaunchPlan) -> str:
    cfg = plan.config
    from megarl.config.validate import model_hf_config

    shape = ModelShape.from_hf(model_hf_config(cfg.model.path))
    c = cfg.cluster
    unit = "GPUs" if c.device == "gpu" else "CPU ranks"
    out = [f"model {cfg.model.path}: {_count(shape.total_params())} parameters ({cfg.model.dtype}), "
           f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads} query / {shape.kv_heads} KV heads, "
           f"vocab {shape.vocab}"
           + (f"; MoE: {shape.experts} experts of intermediate size {shape.expert_ffn}, top-{shape.topk}, "
              f"{_count(shape.active_params())} active per token" if shape.experts else ""),
           f"cluster: {c.nodes} nodes x {c.ranks_per_node} {unit} = {c.world_size} ranks; pools: "
           + ", ".join(f"{k}={v}" for k, v in c.pool_sizes().items()),
           f"sequence: {cfg.data.max_prompt_length} prompt + {cfg.max_response_length} response tokens; "
           f"{cfg.data.batch_size} prompts x {cfg.rollout.n} samples per step",
           "", "layout:"]
    for r in plan.roles:
        out.append(f"  {r.role:8s} pool {r.pool!r:10s} {r.world:5d} ranks  {r.layout:34s} "
                   f"{'engines' if r.rollout else 'dp'} {r.dp:<4d} {r.batching}"
                   + (f"; {r.attention} attention" if r.attention else ""))
    out += ["", f"memory per GPU (GiB, busiest rank; assumptions: parallel/memory.py; recompute={plan.recompute}):"]
    for r in plan.roles:
        if r.memory is not None:
            m = r.memory.components
            parts = "  ".join(f"{k} {m[k] / GiB:.2f}" for k in ("params", "grads", "optimizer", "activations", "logits")
                              if k in m)
            out.append(f"  {r.role:8s} {parts}  = {r.memory.gib():.2f}")
            if r.memory.expert_params:
                out.append(f"  {'':8s} of the params, experts {r.memory.expert_params * DTYPE_BYTES[cfg.model.dtype] / GiB:.2f}"
                           f" ({r.memory.expert_params:,} on an expert-parallel rank)")
        else:
            rm = r.rollout
            out.append(f"  {r.role:8s} reserved {rm.reserved / GiB:.2f} = weights {rm.weights / GiB:.2f} + KV pool "
                       f"{max(rm.kv_pool, 0) / GiB:.2f} ({rm.kv_per_token} B/token: {rm.kv_capacity_tokens} tokens; "
                       f"a step needs {rm.tokens_needed} per engine)")
    out += ["", f"per pool and phase (GiB per GPU, incl. {RUNTIME_RESERVE_BYTES / GiB:.0f} GiB runtime reserve) "
                f"vs budget {plan.budget / GiB:.0f} GiB:"]
    for p in plan.pools:
        out.append(f"  pool {p.name!r} ({p.ranks} ranks: {', '.join(p.roles)}), resident states {p.resident / GiB:.2f}")
        for phase, size in p.phases.items():
            mark = "  <- peak" if phase == p.peak_phase else ""
            out.append(f"    {phase:16s} {_gib(size)}{mark}")
        verdict = "fits" if p.peak <= plan.budget else "DOES NOT FIT"
        out.append(f"    peak {p.peak / GiB:.1f} of {plan.budget / GiB:.0f} GiB: {verdict} "
                   f"(margin {(plan.budget - p.peak) / GiB:+.1f} GiB)")
    for w in plan.warnings:
        out.append(f"warning: {w}")
    for problem in plan.problems:
        out.append(f"DOES NOT FIT: {problem}")
    out.append("verdict: " + ("fits in memory" if plan.fits else "does NOT fit (see above)"))
    return "\n".join(out)


def driver_command(config_path: str, overrides: list[str]) -> str:
    """The training command the Ray-on-Slurm bootstrap runs on the head node."""
    return shlex.join(["megarl", "train", config_path, *overrides])


def slurm_geometry_problems(cfg: RunConfig, nodes: int | None, gpus_per_node: int | None) -> list[str]:
    """Mismatches between the Slurm allocation (sbatch --nodes / --gpus-per-node) and cluster.*."""
    problems = []
    c = cfg.cluster
    if nodes is not None and nodes != c.nodes:
        problems.append(f"cluster.nodes={c.nodes}: the Slurm allocation has {nodes} nodes; pass cluster.nodes={nodes} "
                        f"(with a layout that divides the new world) or submit with sbatch --nodes={c.nodes}")
    if gpus_per_node is not None and c.device == "gpu" and gpus_per_node != c.gpus_per_node:
        problems.append(f"cluster.gpus_per_node={c.gpus_per_node}: the Slurm allocation has {gpus_per_node} GPUs per "
                        f"node; pass cluster.gpus_per_node={gpus_per_node} or sbatch --gpus-per-node={c.gpus_per_node}")
    return problems


CONVERT_PROCESS_BYTES = 0.4 * GiB  # a conversion rank's imports and meta model (measured on CPU, 2026-12)


def conversion_plan(cfg: RunConfig, ranks_per_node: int, verify: bool = True) -> str:
    """What ``megarl convert`` at the actor's layout holds per rank and node (host memory).

    Conversion streams (``parallel/checkpoint/stream.py``): a rank holds one stored shard at a time
    (fp32, plus its serialised copy while it is written or read), and rank 0 of an export also
    the full HF tensor it is assembling. Only the logit probe of the verification builds the
    model (the rank's stage in fp32); it is skipped above 2B parameters. A layout needs tp*pp*cp
    ranks (no data parallel).
    """
    import math

    from megarl.config.validate import model_hf_config
    from parallel.memory import ModelShape, megatron_stage_params
    from parallel.shards import hf_tensor_shapes, megatron_shards

    hf = model_hf_config(cfg.model.path)
    shape = ModelShape.from_hf(hf)
    layout = cfg.actor.layout
    world = cfg.cluster.world_size
    shard = 4 * max(math.prod(t.shape) for chunks in megatron_shards(hf, layout).values()
                    for chunk in chunks for t in chunk.values())
    tensor = 4 * max(math.prod(s) for s in hf_tensor_shapes(hf).values())
    probe = verify and shape.total_params() <= 2e9
    per_rank = CONVERT_PROCESS_BYTES + 2 * shard + (
        max(megatron_stage_params(shape, layout, s) for s in range(layout.pp)) * 4 if probe else 0)
    export_rank0 = per_rank + tensor
    return "\n".join([
        f"conversion of {cfg.model.path} ({_count(shape.total_params())} parameters) at tp={layout.tp} "
        f"pp={layout.pp} vpp={layout.vpp or '-'}: {world} ranks ({world // ranks_per_node} nodes x {ranks_per_node})",
        f"host memory (streamed, one shard at a time): {per_rank / GiB:.1f} GiB per rank (largest shard "
        f"{shard / GiB:.2f} GiB fp32, twice while serialised, + ~{CONVERT_PROCESS_BYTES / GiB:.1f} GiB process"
        f"{' + the logit probe' + chr(39) + 's model stage' if probe else ''}), rank 0 of megatron-to-hf "
        f"{export_rank0 / GiB:.1f} GiB (with the largest HF tensor, {tensor / GiB:.2f} GiB, being assembled), "
        f"{(per_rank * ranks_per_node + tensor) / GiB:.0f} GiB per node",
    ])
