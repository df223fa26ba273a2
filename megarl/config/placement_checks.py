"""Where the models of a run go, checked before anything starts: the pools each role names exist
and fit in the cluster, each role's Megatron layout fits its pool and the model, micro-batches
split the batch over data-parallel ranks, the engines' tensor parallelism fits the model and its
pool, and the valid placements a run does not implement yet. Called by ``megarl.config.validate``.
"""

from __future__ import annotations

from megarl.config.errors import Problems
from megarl.config.schema import RunConfig
from parallel.layout import LayoutError, MegatronLayout


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n >= 1 else []


def _check_layout(cfg: RunConfig, p: Problems, role: str, layout: MegatronLayout, world: int, pool: str,
                  hf_config: dict | None) -> bool:
    try:
        layout.validate(world, hf_config)
    except LayoutError as exc:
        msg = str(exc)
        key = f"{role}.layout" if getattr(cfg, role).layout is not None else "actor.layout"
        if msg.startswith("layout."):
            p.line(f"{key}.{msg[len('layout.'):]}" + (f" (the {role}'s layout)" if role != "actor" else ""))
        elif msg.startswith("world_size="):
            p.line(f"{key}: {msg} [world_size = the {pool!r} pool of the {role}: "
                   f"{_pool_origin(cfg, pool)}]")
        else:
            p.line(f"{key}: {msg}" + (f" (the {role}'s layout)" if role != "actor" else ""))
        return False
    return True


def _pool_origin(cfg: RunConfig, pool: str) -> str:
    c = cfg.cluster
    if c.pools:
        return f"cluster.pools.{pool}={c.pools[pool]}"
    per = f"cluster.gpus_per_node={c.gpus_per_node}" if c.gpus_per_node else f"cluster.cpu_ranks_per_node={c.cpu_ranks_per_node}"
    return f"cluster.nodes={c.nodes} x {per}; change these or the layout"


def _micro_batch_checks(cfg: RunConfig, p: Problems, role: str, layout: MegatronLayout, world: int) -> None:
    """Samples per optimizer step split evenly over DP ranks and micro-batches; VPP needs the
    micro-batch count to be a multiple of PP (megatron's interleaved 1F1B schedule)."""
    section = getattr(cfg, role)
    dp = world // (layout.tp * layout.pp * layout.cp)
    n = cfg.rollout.n
    mini = getattr(section, "mini_batch_size", None)
    prompts = cfg.data.batch_size if mini is None else mini
    prompts_key = "data.batch_size" if mini is None else f"{role}.mini_batch_size"
    what = "optimizer step" if role in ("actor", "critic") else "forward pass over the step's batch"
    samples = prompts * n
    vpp_key = f"{role}.layout.vpp" if section.layout is not None else "actor.layout.vpp"
    if getattr(section, "max_tokens_per_micro_batch", None) is not None:
        if layout.vpp is not None:
            p.add(vpp_key, layout.vpp,
                  f"with {role}.max_tokens_per_micro_batch the micro-batch count is decided per step from the data, "
                  f"but megatron's interleaved schedule needs it to be a multiple of pp={layout.pp}",
                  f"use {role}.micro_batch_size (set {role}.max_tokens_per_micro_batch=null) or vpp=null")
        elif samples < dp:
            p.add(prompts_key, prompts, f"{prompts} prompts x rollout.n={n} = {samples} samples per {what} cannot "
                  f"give each of the {role}'s {dp} data-parallel ranks a sample", f"use at least {-(-dp // n)} prompts")
        return
    if samples % dp:
        p.add(prompts_key, prompts,
              f"{prompts} prompts x rollout.n={n} = {samples} samples per {what} do not split evenly over the "
              f"{role}'s data-parallel size {dp} (world {world} / tp*pp*cp {layout.tp * layout.pp * layout.cp})",
              f"make {prompts_key} x rollout.n a multiple of {dp}")
        return
    per_rank = samples // dp
    mbs = section.micro_batch_size
    if per_rank % mbs:
        p.add(f"{role}.micro_batch_size", mbs,
              f"does not divide the {per_rank} samples each data-parallel rank gets per {what} "
              f"({samples} samples / dp {dp})", f"pick one of {divisors(per_rank)}")
        return
    micro_batches = per_rank // mbs
    if layout.vpp is not None and micro_batches % layout.pp:
        good = [d for d in divisors(per_rank) if (per_rank // d) % layout.pp == 0]
        fix = (f"set {role}.micro_batch_size to one of {good}" if good else
               f"make the samples per rank ({per_rank}) a multiple of pp={layout.pp} via {prompts_key} or rollout.n")
        p.add(vpp_key, layout.vpp,
              f"megatron's interleaved schedule needs the number of micro-batches per {what} to be a multiple of "
              f"pp={layout.pp}, but it is {micro_batches} ({per_rank} samples per rank / {role}.micro_batch_size {mbs})",
              f"{fix}, or set vpp=null")


def resource_checks(cfg: RunConfig, p: Problems, hf_config: dict | None, critic_hf: dict | None,
                     reward_hf: dict | None) -> None:
    c = cfg.cluster
    if c.nodes < 1 or c.ranks_per_node < 1:
        return  # reported by the bound checks
    sizes = c.pool_sizes()
    ok_pools = True
    for name, size in c.pools.items():
        if not p.check(size >= 1, f"cluster.pools.{name}", size, "a pool needs >= 1 rank", "remove it or give it ranks"):
            ok_pools = False
        elif size > c.ranks_per_node and size % c.ranks_per_node:
            p.add(f"cluster.pools.{name}", size, f"a pool larger than one node must span whole nodes "
                  f"({c.ranks_per_node} ranks each)", f"use a multiple of {c.ranks_per_node}")
            ok_pools = False
    if c.pools and sum(c.pools.values()) > c.world_size:
        p.add("cluster.pools", c.pools, f"the pools hold {sum(c.pools.values())} ranks but the cluster has "
              f"{c.world_size} ({c.nodes} nodes x {c.ranks_per_node})", "shrink the pools or add nodes")
        ok_pools = False

    roles = {"actor": ("actor.pool", cfg.actor.pool)}
    for role in ("critic", "ref", "reward_model"):
        section = getattr(cfg, role)
        if section.enabled and section.pool is not None:
            roles[role] = (f"{role}.pool", section.pool)
    r = cfg.rollout
    if r.placement == "separate":
        others = [name for name in sizes if name != cfg.actor.pool]
        if r.pool is None:
            fix = (f"set rollout.pool to one of {others}" if others else
                   "declare pools, e.g. cluster.pools={train: 2, rollout: 2} with actor.pool=train rollout.pool=rollout")
            p.add("rollout.pool", None, "rollout.placement=separate needs a pool of its own", fix)
        elif r.pool == cfg.actor.pool:
            p.add("rollout.pool", r.pool, "is the actor's pool, but rollout.placement=separate",
                  "use another pool, or set rollout.placement=colocated")
        else:
            roles["rollout"] = ("rollout.pool", r.pool)
    if r.mode != "sync" and r.placement != "separate":
        p.add("rollout.mode", r.mode, "generation overlaps training only on engines with ranks of their own "
              "(colocated engines share the actor's devices)",
              "set rollout.placement=separate with a rollout.pool, or rollout.mode=sync")
    if r.partial_rollout_tokens:
        if r.mode == "sync":
            p.add("rollout.partial_rollout_tokens", r.partial_rollout_tokens, "partial rollouts continue a batch "
                  "across a weight update, which happens only with generation ahead of training",
                  "set rollout.mode=one_step_off or streaming, or rollout.partial_rollout_tokens=0")
        if r.multi_turn.enabled or cfg.actor.routing_replay:
            field = "rollout.multi_turn.enabled" if r.multi_turn.enabled else "actor.routing_replay"
            p.add("rollout.partial_rollout_tokens", r.partial_rollout_tokens, f"partial rollouts are not done with "
                  f"{field}=true (a continued sample would mix turns or routes of two weight versions)",
                  f"set rollout.partial_rollout_tokens=0, or {field}=false")
    if r.mode != "streaming" and r.max_staleness != 1:
        p.add("rollout.max_staleness", r.max_staleness, f"only rollout.mode=streaming reads it (the mode is {r.mode!r}, "
              f"whose staleness is {r.staleness})", "set rollout.mode=streaming, or leave rollout.max_staleness out")
    if r.placement != "separate" and r.pool is not None and r.pool != cfg.actor.pool:
        p.add("rollout.pool", r.pool, f"a colocated rollout runs on the actor's pool ({cfg.actor.pool!r})",
              "set rollout.placement=separate, or rollout.pool=null")
    bad_pool = set()
    for role, (key, name) in roles.items():
        if name not in sizes:
            bad_pool.add(role)
            hint = ("declare it in cluster.pools" if c.pools else
                    f"without cluster.pools the only pool is {next(iter(sizes))!r}")
            p.add(key, name, f"is not a resource pool (pools: {', '.join(sizes)})", hint)
    if not ok_pools:
        return

    if "actor" not in bad_pool:
        world = cfg.world_size_for("actor")
        actor_ok = _check_layout(cfg, p, "actor", cfg.actor.layout, world, cfg.pool_for("actor"), hf_config)
        if actor_ok:
            before = len(p.lines)
            _micro_batch_checks(cfg, p, "actor", cfg.actor.layout, world)
            # A role on the actor's pool and layout would repeat the actor's batch-split problem.
            actor_ok = len(p.lines) == before
    else:
        actor_ok = False
    for role, model_cfg in (("critic", critic_hf), ("ref", hf_config), ("reward_model", reward_hf)):
        section = getattr(cfg, role)
        if not section.enabled or role in bad_pool or "actor" in bad_pool and section.pool is None:
            continue
        own = (section.layout is not None or section.pool is not None or getattr(section, "model_path", None))
        layout = cfg.layout_for(role)
        world = cfg.world_size_for(role)
        if own:
            if not _check_layout(cfg, p, role, layout, world, cfg.pool_for(role), model_cfg):
                continue
        elif not actor_ok:
            continue
        _micro_batch_checks(cfg, p, role, layout, world)

    if "rollout" not in bad_pool and r.tp >= 1:
        world = cfg.world_size_for("rollout") if r.placement == "separate" else (
            cfg.world_size_for("actor") if "actor" not in bad_pool else None)
        if world is not None and world % r.tp:
            p.add("rollout.tp", r.tp, f"the rollout pool {cfg.pool_for('rollout')!r} has {world} ranks, not a "
                  "multiple of the engines' tensor-parallel size", f"pick one of {divisors(world)}")
        if hf_config is not None:
            from parallel.shards import sglang_expert_problem, sglang_tp_problem

            cpu = cfg.cluster.device == "cpu"
            tp_problem = sglang_tp_problem(hf_config, r.tp, cpu=cpu)
            if tp_problem is not None:
                p.add("rollout.tp", r.tp, *tp_problem)
            expert_problem = sglang_expert_problem(hf_config, r.tp, r.ep, cpu=cpu)
            if expert_problem is not None:
                p.add("rollout.ep", r.ep, *expert_problem)


def not_implemented_checks(cfg: RunConfig, p: Problems) -> None:
    """Valid settings a run does not implement yet, each with what to set instead. Roles that
    share a pool share its processes (``RunConfig.megatron_pools``) and therefore one layout; SGLang
    engines run colocated with the actor or on a pool of their own, each engine within one node."""
    r = cfg.rollout
    per_node = cfg.cluster.ranks_per_node
    if r.placement == "separate" and per_node >= 1 and r.tp > per_node:
        p.add("rollout.tp", r.tp, f"an engine spanning nodes ({per_node} ranks each) on a separate pool is not "
              "implemented yet", f"use rollout.tp <= {per_node}")
    reported = any(line.startswith("rollout.tp=") for line in p.lines)  # e.g. not dividing the pool
    if r.placement == "colocated" and cfg.cluster.device == "gpu" and r.tp >= 1 and per_node % r.tp and not reported:
        # megarl.controller.placement cuts each node's GPUs into engines of rollout.tp consecutive ones
        p.add("rollout.tp", r.tp, f"colocated engines of {r.tp} GPUs do not divide a node's {per_node} GPUs "
              "(cluster.gpus_per_node): an engine would straddle two nodes",
              f"use a rollout.tp that divides {per_node} ({', '.join(map(str, divisors(per_node)))})")
    for pool, roles in cfg.megatron_pools().items():
        first = roles[0]
        for role in roles[1:]:
            layout, first_layout = cfg.layout_for(role), cfg.layout_for(first)
            if layout == first_layout:
                continue
            own = getattr(cfg, role).layout
            p.add(f"{role}.layout", None if own is None else str(own),
                  ("" if own is not None else f"(the actor's layout, {layout}) ") + f"differs from the {first}'s "
                  f"layout ({first_layout}) on the same pool {pool!r}, but roles sharing a pool share its processes "
                  "and so one layout", f"give the {role} a pool of its own ({role}.pool) or the {first}'s layout"
                  + (f" ({role}.layout=null)" if first_layout == cfg.actor.layout else ""))
        if r.placement == "separate" and pool == r.pool and pool != cfg.actor.pool:  # the actor's: resource_checks
            p.add("rollout.pool", pool, f"is also the {'/'.join(roles)}'s pool, but engines on a separate pool need "
                  "its ranks to themselves (sharing them is not implemented yet)", "give them a pool no Megatron role uses")
