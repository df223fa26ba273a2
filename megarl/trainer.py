"""The single controller of an RL run: one driver process that owns no model weights.

It starts Ray, places one ``MegatronWorker`` per rank of each resource pool a Megatron role uses
(roles sharing a pool share its processes and layout: by default actor, reference and critic all
run on the actor's) and one ``RolloutWorker`` (an SGLang engine of ``rollout.tp`` ranks) per
``rollout.tp`` ranks of the actor's pool (colocated) or of the rollout's own pool (separate), and
then runs the algorithm step by step::

    generate -> reward -> reference / critic forward -> advantages -> update -> weight sync

``rl_step`` is that dataflow; GRPO and PPO differ only in the critic's phases it runs. Every
step logs its metrics (console, TensorBoard, ``metrics.jsonl``), and every
``trainer.save_every`` steps a checkpoint is written atomically; ``trainer.resume: auto`` continues
from the newest complete one. SIGTERM makes the driver save before it exits.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from megarl.config.schema import RunConfig
from megarl.faults import FaultPlan
from megarl.metrics import MetricsLogger, Timeline
from megarl.rollout.stream import RolloutStream

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
TIMELINE_FILE = "timeline.json"


class RunError(RuntimeError):
    """The run cannot continue (a resume mismatch, a failed weight sync, ...); says why and the fix."""


# ----------------------------------------------------------------------------- model and data


def materialize_model(cfg: RunConfig) -> str:
    """The HF directory the run starts from: ``model.path`` itself, or for a preset name a tiny
    randomly initialised model with the character tokenizer, made once under the output dir."""
    from model_specs.presets import PRESETS, save_tiny_hf_model
    from model_specs.tokenizer import save_char_tokenizer
    from parallel.checkpoint.atomic import atomic_directory, partial_dir

    if Path(cfg.model.path).is_dir() or cfg.model.path not in PRESETS:
        return cfg.model.path
    target = Path(cfg.trainer.output_dir) / "initial_model"
    if not (target / "config.json").is_file():
        with atomic_directory(target, partial=partial_dir(target)) as partial:
            save_tiny_hf_model(cfg.model.path, partial, seed=cfg.trainer.seed, eos_token_id=1, pad_token_id=0)
            save_char_tokenizer(partial)
    return str(target)


def load_tokenizer(cfg: RunConfig, model_dir: str):
    from model_specs.tokenizer import load_tokenizer

    return load_tokenizer(cfg.model.tokenizer or model_dir)


def config_fingerprint(cfg: RunConfig) -> dict:
    """What a checkpoint is resumed against: the model, which roles run, and where (the layouts and
    cluster, ``ELASTIC_KEYS``: those may change, see ``Trainer._maybe_resume``)."""
    return {"model": cfg.model.path, "dtype": cfg.model.dtype,
            "actor_layout": dataclasses.asdict(cfg.actor.layout), "cluster": dataclasses.asdict(cfg.cluster),
            "critic_layout": dataclasses.asdict(cfg.layout_for("critic")) if cfg.critic.enabled else None,
            "critic": cfg.critic.enabled, "ref": cfg.ref.enabled}


def resume_changes(saved: dict, cfg: RunConfig, path: Path) -> str:
    """What ``cfg`` changes of the fingerprint a checkpoint at ``path`` was ``saved`` with, as one
    line ("" if nothing): only where the models run (``ELASTIC_KEYS``) may change; RunError
    naming anything else."""
    changed = {k: (saved.get(k), v) for k, v in config_fingerprint(cfg).items() if saved.get(k) != v}

    def line(keys) -> str:
        return "; ".join(f"{k}: checkpoint {changed[k][0]!r}, config {changed[k][1]!r}" for k in keys)

    fixed = [k for k in changed if k not in ELASTIC_KEYS]
    if fixed:
        raise RunError(f"cannot resume from {path}: the config changed ({line(fixed)}). Resume with the "
                       "checkpoint's settings, or set trainer.resume=none / a new trainer.output_dir")
    return line(changed)


ELASTIC_KEYS = ("actor_layout", "critic_layout", "cluster")  # fingerprint keys an elastic resume may change
ELASTIC_NOTE = (
    "Models and optimizer states are resharded by Megatron's distributed checkpoints (the same values); the "
    "step, learning-rate schedule, data position and KL controller are global and restored. Not identical to an "
    "uninterrupted run: rollout sampling when the number of engines changed, and the fp32 rounding of reductions "
    "split over other ranks")


def weight_sync_rounds(cfg: RunConfig, hf_config: dict, layer_spec: str = "local"
                       ) -> list[tuple[dict[int, int] | None, Any]]:
    """The checked resharding plans of one weight sync, in order: (device -> SGLang rank assembled
    there, plan) per round for engines on their own pool, or one (None, plan) when colocated (engine
    e's rank r assembled on device e * rollout.tp + r). ``layer_spec``: how the actor's parameters
    are named (what its workers built: "te" where Transformer Engine imports)."""
    from parallel.reshard.plan import plan_megatron_to_sglang, separate_pool_rounds

    world, tp = cfg.world_size_for("actor"), cfg.rollout.tp
    rounds = separate_pool_rounds(world, tp) if cfg.rollout.placement == "separate" else [None]
    element_size = torch.tensor([], dtype=_dtype(cfg.model.dtype)).element_size()
    plans = [(ranks, plan_megatron_to_sglang(hf_config, cfg.actor.layout.to_megatron(), world, tp,
                                             engine_ranks=ranks, element_size=element_size, layer_spec=layer_spec,
                                             rollout_ep=cfg.rollout.ep))
             for ranks in rounds]
    for _, plan in plans:
        plan.check()
    return plans


# ----------------------------------------------------------------------------- the controller


def worker_groups(cfg: RunConfig) -> dict[str, list[str]]:
    """Resource pool -> the Megatron roles its ranks run (one torch.distributed group per pool);
    the actor's pool first."""
    groups: dict[str, list[str]] = {}
    for role in cfg.megatron_roles:
        groups.setdefault(cfg.pool_for(role), []).append(role)
    return groups


def not_yet_supported(cfg: RunConfig) -> list[str]:
    """Valid settings the trainer does not implement yet, each with what to set instead. Roles that
    share a pool share its processes and therefore one layout; SGLang engines run colocated with the
    actor or on a pool of their own, each engine within one node."""
    problems = []
    r = cfg.rollout
    if r.placement == "separate" and r.tp > cfg.cluster.ranks_per_node:
        problems.append(f"rollout.tp={r.tp} on a separate pool: an engine spanning nodes "
                        f"({cfg.cluster.ranks_per_node} ranks each) is not implemented; use rollout.tp <= "
                        f"{cfg.cluster.ranks_per_node}")
    for pool, roles in worker_groups(cfg).items():
        first = roles[0]
        for role in roles[1:]:
            if cfg.layout_for(role) != cfg.layout_for(first):
                problems.append(f"{role}.layout ({cfg.layout_for(role)}) differs from the {first}'s on the same pool "
                                f"{pool!r}: roles sharing a pool share its processes and layout; give the {role} a "
                                f"pool of its own ({role}.pool) or set {role}.layout=null")
        if r.placement == "separate" and pool == r.pool:
            problems.append(f"rollout.pool={pool} is also the {'/'.join(roles)}'s pool: engines on a separate pool "
                            "need its ranks to themselves; give them a pool no Megatron role uses")
    return problems


class Trainer:
    """Builds the workers of ``cfg`` (validated) and runs ``trainer.total_steps`` RL steps."""

    HEADLINE = ("reward/mean", "reward")  # the metric the console line summarises

    def __init__(self, cfg: RunConfig, log=print):
        problems = not_yet_supported(cfg)
        if problems:
            raise RunError("this configuration is valid but the trainer does not run it yet:\n  " + "\n  ".join(problems))
        self.cfg, self.log = cfg, log
        self.out = Path(cfg.trainer.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.model_dir = materialize_model(cfg)
        self.tokenizer = load_tokenizer(cfg, self.model_dir)
        self._stop_requested = False
        self.step = 0
        self.timeline = Timeline(self.out / TIMELINE_FILE)
        try:
            self.faults = FaultPlan()
        except ValueError as exc:
            raise RunError(str(exc)) from None
        # rollout.mode one_step_off / streaming: generation ahead of training, and the data position
        # before each generated step's prompts were drawn (a checkpoint resumes from the first untrained)
        self.stream: RolloutStream | None = None
        self._data_lock = threading.Lock()
        self._data_before: dict[int, dict] = {}
        self._build_data()
        self._start_workers()

    # ------------------------------------------------------------------ setup

    def _build_data(self) -> None:
        from megarl.algorithms import AdaptiveKLController, FixedKLController
        from megarl.data.dataset import PromptDataset, PromptLoader
        from megarl.rewards.dispatch import RewardRunner

        d = self.cfg.data
        m = self.cfg.rollout.multi_turn
        self.agent = None
        if m.enabled:  # multi-turn rollouts with tools: the prompts show the tools' schemas
            from megarl.agent import AgentLoop, AgentSettings, ToolLimits, ToolRegistry

            limits = ToolLimits(timeout_s=m.tool_timeout_s, memory_mb=m.tool_memory_mb, cpu_s=m.tool_timeout_s,
                                max_output_chars=m.tool_max_output_chars)
            self.agent = AgentLoop(self.tokenizer, ToolRegistry.from_names(m.tools, limits),
                                   AgentSettings(m.max_turns, m.max_total_tokens, m.tool_format, d.chat_template))
        dataset = PromptDataset(d.train_files, self.tokenizer, prompt_key=d.prompt_key,
                                ground_truth_key=d.ground_truth_key, data_source_key=d.data_source_key,
                                default_data_source=d.default_data_source, extra_info_key=d.extra_info_key,
                                prompt_template=d.prompt_template, chat_template=d.chat_template,
                                max_prompt_length=d.max_prompt_length, tools=self.agent.schemas if self.agent else None)
        self.loader = PromptLoader(dataset, d.batch_size, seed=d.seed, shuffle=d.shuffle)
        r = self.cfg.reward
        self.rewards = RewardRunner(r.functions, r.default, r.timeout_s, r.backend, r.num_workers)
        kl = self.cfg.algorithm.kl_penalty
        self.kl_controller = (AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.controller == "adaptive"
                              else FixedKLController(kl.coef))

    def _start_workers(self) -> None:
        import ray

        from megarl.workers.megatron_worker import MegatronWorker
        from parallel.checkpoint.hf_io import HFCheckpoint

        cfg = self.cfg
        gpu = cfg.cluster.device == "gpu"
        cpus = len(os.sched_getaffinity(0))  # what this process may use (Slurm/cgroup/taskset), not the host's count
        on_cluster = bool(os.environ.get("RAY_ADDRESS"))
        if not ray.is_initialized():
            if on_cluster:
                ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
            else:
                # "local": a Ray of our own even when another one runs on this host (Ray would join it)
                ranks = cfg.cluster.world_size
                ray.init(address="local", num_cpus=max(cpus, ranks), num_gpus=ranks if gpu else 0,
                         include_dashboard=False, log_to_driver=False, logging_level="WARNING")
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        # CPU ranks split their node's CPUs (nodes of a Ray cluster assumed alike this one)
        threads = None if gpu else max(1, cpus // (cfg.cluster.ranks_per_node if on_cluster else cfg.cluster.world_size))
        worker_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(MegatronWorker)
        self.placements, self.groups = {}, {}  # pool -> its placement group, its Megatron workers
        for pool, _roles in worker_groups(cfg).items():
            size = cfg.cluster.pool_sizes()[pool]
            pg = self.placements[pool] = _ready_placement_group([bundle] * size)
            # max_calls=1: the task's worker process exits after it (idle, it would keep ~200 MB of imports)
            address, port = ray.get(ray.remote(num_cpus=0, max_calls=1)(_address).options(**_in_bundle(pg, 0)).remote())
            self.groups[pool] = [worker_cls.options(**_in_bundle(pg, rank)).remote(
                rank, size, address, port, threads, group=pool) for rank in range(size)]
        self.role_workers = {role: self.groups[cfg.pool_for(role)] for role in cfg.megatron_roles}
        self.workers = self.role_workers["actor"]
        specs = self.model_specs()
        built = self.gather([w.setup.remote(spec, cfg.trainer.seed) for spec in specs for w in self.role_workers[spec.role]],
                            [name for spec in specs for name in self._worker_names(spec.role)], "model setup")
        self.actor_layer_spec = built[0]["layer_spec"]  # model_specs()[0] is the actor's
        self.hf_config = HFCheckpoint(self.model_dir).config
        pools = "; ".join(f"pool {pool!r}: {len(self.groups[pool])} rank(s) of {'+'.join(roles)} "
                          f"(layout {cfg.layout_for(roles[0])})" for pool, roles in worker_groups(cfg).items())
        threading = "" if gpu else f" ({threads} CPU thread(s) per rank)"
        self.log(f"megarl: Megatron {pools}{threading}; model {self.model_dir}")
        self._start_engines(threads)

    def _start_engines(self, threads: int | None) -> None:
        """One SGLang engine per ``rollout.tp`` ranks (colocated or on the rollout's pool), and the
        resharding plans of the weight sync into them; ``threads``: CPU threads per rank."""
        import ray

        from megarl.rollout.engine_worker import RolloutWorker

        cfg = self.cfg
        world = cfg.world_size_for("actor")
        gpu = cfg.cluster.device == "gpu"
        r = cfg.rollout
        engine_kwargs: dict[str, Any] = {"random_seed": cfg.trainer.seed, "ep_size": r.ep}
        if cfg.actor.routing_replay:
            engine_kwargs["enable_return_routed_experts"] = True
        if gpu:
            engine_kwargs["mem_fraction_static"] = r.mem_fraction_static
        else:  # each engine rank gets a Megatron rank's share of the cores; without this it would
            # inherit the OMP_NUM_THREADS=1 (or =num_cpus) that Ray sets for its actors: 1.6x slower
            engine_kwargs["env"] = {"OMP_NUM_THREADS": str(threads)}
        engine_args = (self.model_dir, r.tp, cfg.model.dtype, engine_kwargs)
        if r.placement == "separate":
            # One bundle per engine (all its ranks on one node); engine ranks get the resharded
            # weights from the trainer's devices through Ray's object store.
            num_engines = cfg.world_size_for("rollout") // r.tp
            pg = self.placements[r.pool] = _ready_placement_group(
                [{"GPU": r.tp, "CPU": 1} if gpu else {"CPU": r.tp}] * num_engines)
            engine_cls = ray.remote(num_cpus=1 if gpu else r.tp, num_gpus=r.tp if gpu else 0)(RolloutWorker)
            self.engines = [engine_cls.options(**_in_bundle(pg, e)).remote(*engine_args) for e in range(num_engines)]
        else:
            num_engines = max(1, world // r.tp)  # one engine per rollout.tp of the actor's ranks
            engine_cls = ray.remote(num_cpus=0)(RolloutWorker)
            pg = self.placements[cfg.actor.pool]
            self.engines = [engine_cls.options(**_in_bundle(pg, e * r.tp)).remote(*engine_args)
                            for e in range(num_engines)]
        self.sync_rounds = weight_sync_rounds(cfg, self.hf_config, self.actor_layer_spec)
        self._call_engines("generate", [[1]], [{"max_new_tokens": 1}], None)  # the engines are up
        where = (f"on their own pool {r.pool!r}" if r.placement == "separate" else "colocated")
        rows = ("one per prompt, its samples as branches (shared prompts)" if cfg.shared_prompt_rows
                else "one packed row per micro-batch" if cfg.actor.sequence_packing else "one per sample")
        replay = "; routing replay: the actor's routers use the engines' experts" if cfg.actor.routing_replay else ""
        self.log(f"megarl: {num_engines} SGLang engine(s) of TP={r.tp} {where}; rows: {rows}{replay}")

    def model_specs(self) -> list:
        """The ``ModelSpec`` of every Megatron model the run builds, the actor's first."""
        from megarl.workers.batch import MicroBatching
        from megarl.workers.losses import LossSettings
        from megarl.workers.megatron_worker import ModelSpec

        cfg = self.cfg
        a = cfg.actor
        layout = a.layout.to_megatron()
        steps_per_rl_step = a.ppo_epochs * self._minibatches_per_step(a.mini_batch_size)
        kl, correction = a.kl_loss, cfg.algorithm.rollout_correction
        actor_loss = LossSettings(policy_loss=a.policy_loss, loss_agg_mode=a.loss_agg_mode,
                                  max_len=cfg.max_response_length, clip_ratio_low=a.clip_ratio_low,
                                  clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
                                  entropy_coef=a.entropy_coef, kl_coef=kl.coef if kl.enabled else 0.0,
                                  kl_estimator=kl.estimator, kl_clamp=kl.clamp,
                                  mismatch_bounds=None if _recomputes_old_logp(self) else (correction.low, correction.high))
        packed, shared = a.sequence_packing, cfg.shared_prompt_rows
        specs = [ModelSpec("actor", self.model_dir, layout,
                           MicroBatching(a.micro_batch_size, a.max_tokens_per_micro_batch, packed, shared),
                           a.optim, cfg.trainer.total_steps * steps_per_rl_step, actor_loss, cfg.model.dtype,
                           routing_replay=a.routing_replay)]
        if cfg.needs_reference:
            specs.append(ModelSpec("ref", self.model_dir, cfg.layout_for("ref").to_megatron(),
                                   MicroBatching(cfg.ref.micro_batch_size, packed=packed, shared_prompts=shared),
                                   dtype=cfg.model.dtype))
        if cfg.critic.enabled:
            c = cfg.critic
            specs.append(ModelSpec("critic", c.model_path or self.model_dir, cfg.layout_for("critic").to_megatron(),
                                   MicroBatching(c.micro_batch_size, c.max_tokens_per_micro_batch, packed, shared), c.optim,
                                   cfg.trainer.total_steps * c.ppo_epochs * self._minibatches_per_step(c.mini_batch_size),
                                   LossSettings(loss_agg_mode=c.loss_agg_mode, value_clip=c.value_clip,
                                                max_len=cfg.max_response_length), cfg.model.dtype))
        if cfg.reward_model.enabled:
            rm = cfg.reward_model
            specs.append(ModelSpec("reward_model", rm.model_path, cfg.layout_for("reward_model").to_megatron(),
                                   MicroBatching(rm.micro_batch_size, packed=packed, shared_prompts=shared),
                                   dtype=cfg.model.dtype))
        return specs

    def _minibatches_per_step(self, mini_batch_size: int | None) -> int:
        return max(1, self.cfg.data.batch_size // (mini_batch_size or self.cfg.data.batch_size))

    # ------------------------------------------------------------------ worker calls

    def gather(self, refs: list, who: list[str], phase: str) -> list:
        """``gather`` within ``trainer.phase_timeout_s``, errors ending with how to resume."""
        return gather(refs, who, phase, self.cfg.trainer.phase_timeout_s, self._resume_hint)

    def _resume_hint(self) -> str:
        found = self.checkpoints()
        return (f"The newest complete checkpoint is {found[-1]}: run the same command to resume from it" if found
                else "No checkpoint was saved yet")

    def _worker_names(self, role: str | None = None) -> list[str]:
        """How errors name the Megatron workers of ``role`` (default: all), in ``_call_workers`` order."""
        pools = [self.cfg.pool_for(role)] if role else list(self.groups)
        return [f"Megatron rank {rank} of pool {pool!r}" for pool in pools for rank in range(len(self.groups[pool]))]

    def _engine_names(self) -> list[str]:
        return [f"SGLang engine {e}" for e in range(len(self.engines))]

    def _call_workers(self, method: str, *args, role: str | None = None) -> list:
        """``method`` on every rank of ``role``'s group (default: every Megatron worker), in lockstep."""
        workers = self.role_workers[role] if role else [w for group in self.groups.values() for w in group]
        return self.gather([getattr(w, method).remote(*args) for w in workers], self._worker_names(role), method)

    def _call_engines(self, method: str, *args) -> list:
        return self.gather([getattr(e, method).remote(*args) for e in self.engines], self._engine_names(), method)

    def engines_hold_memory(self, hold: bool) -> None:
        """Hybrid engine on GPUs: colocated engines free their weights and KV cache while Megatron
        trains (``hold=False``) and take them back before the weight sync refills them. Nothing
        to do on CPU or with a separate rollout pool."""
        if self.cfg.rollout.placement == "colocated" and self.cfg.cluster.device == "gpu":
            self._call_engines("resume_memory" if hold else "release_memory")

    def forward(self, batch: dict, wanted: dict[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
        """Forward-only outputs for the whole batch, in row order: ``wanted`` maps a batch key to
        (role, output), e.g. ``{"ref_logp": ("ref", "logp")}``. All roles are asked at once, so
        roles on pools of their own compute concurrently."""
        import ray

        shared = ray.put(batch)  # serialized once for every rank and role
        pending = {key: [w.forward.remote(role, shared, False) for w in self.role_workers[role]]
                   for key, (role, _) in wanted.items()}
        outputs = {}
        for key, refs in pending.items():
            parts = [p for p in self.gather(refs, self._worker_names(wanted[key][0]), f"forward ({key})") if p is not None]
            order = torch.cat([p["rows"] for p in parts]).argsort()
            outputs[key] = torch.cat([p[wanted[key][1]] for p in parts])[order]
        return outputs

    # ------------------------------------------------------------------ the dataflow pieces

    def next_rollout(self) -> dict:
        """This step's training batch: generated now (``rollout.mode=sync``), or taken from the
        generation running ahead of training (``RolloutStream``, started at the first step)."""
        if self.cfg.rollout.mode == "sync":
            return self.generate(self.loader.next_batch(), self.step)
        if self.stream is None:
            self.stream = RolloutStream(self._generate_ahead, self._apply_weights,
                                        max_staleness=self.cfg.rollout.staleness, first_step=self.step + 1,
                                        last_step=self.cfg.trainer.total_steps, version=self.step)
        timeout_s = self.cfg.trainer.phase_timeout_s
        try:
            batch = self.stream.take(self.step + 1, timeout_s)
        except TimeoutError as exc:
            raise RunError(f"generation: {exc}, trainer.phase_timeout_s={timeout_s:g} s: a hang, e.g. a stuck "
                           f"engine. {self._resume_hint()}") from None
        with self._data_lock:
            self._data_before.pop(self.step + 1, None)
        return batch

    def _generate_ahead(self, step: int, version: int) -> dict:
        """``RolloutStream``'s generation of (1-based) step ``step``'s batch by weights ``version``:
        its prompts are drawn here, in step order, and the data position before them kept."""
        with self._data_lock:
            self._data_before[step] = self.loader.state_dict()
            prompts = self.loader.next_batch()
        return self.generate(prompts, step - 1, version)

    def generate(self, prompts: dict, step: int, version: int | None = None) -> dict:
        """``rollout.n`` samples of every prompt from the engines (multi-turn trajectories with tool
        calls when ``rollout.multi_turn.enabled``): the batch (0-based) step ``step`` trains on,
        sampled with that step's seed by the engines' current weights (their ``weight_version``:
        the number of updates synced into them; default ``self.step``)."""
        from megarl.rollout.engine_worker import engine_shares

        r = self.cfg.rollout
        n = r.n
        prompt_ids = [ids for ids in prompts["prompt_ids"] for _ in range(n)]
        params = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                  "max_new_tokens": r.max_new_tokens, "ignore_eos": r.ignore_eos}
        if r.stop_token_ids:
            params["stop_token_ids"] = list(r.stop_token_ids)
        shares = engine_shares(len(prompt_ids), len(self.engines))
        seed = self.cfg.trainer.seed * 100_003 + step
        version, started = self.step if version is None else version, time.time()
        extra: dict[str, list] = {}
        rollout_metrics: dict[str, float] = {}
        restarts = [0]  # engines restarted during this step (a list: the agent loop's callback adds to it)
        sample_versions = [version] * len(prompt_ids)  # the weights of each sample's oldest token
        if self.agent is None:
            seeds = [seed + e for e in range(len(self.engines))]
            if r.partial_rollout_tokens and self.stream is not None:
                responses, logprobs, versions = self._generate_in_chunks(prompt_ids, shares, params, seeds, step,
                                                                         restarts, version)
                rollout_metrics = _partial_rollout_metrics(versions, step)
                sample_versions = [min(v, default=version) for v in versions]
            else:
                per_engine = self._generate_on_engines([[prompt_ids[i] for i in share] for share in shares],
                                                       [[params] * len(share) for share in shares], seeds, step,
                                                       restarts)
                outputs: list[dict] = [None] * len(prompt_ids)
                for share, results in zip(shares, per_engine):
                    for i, out in zip(share, results):
                        outputs[i] = out
                responses = [out["output_ids"][: r.max_new_tokens] for out in outputs]
                logprobs = [out["output_logprobs"][: len(resp)] for out, resp in zip(outputs, responses)]
            masks = None
        else:
            from megarl.agent import trajectory_metrics

            trajectories = self.agent.run(self._engine_turns(seed, step, restarts), prompt_ids,
                                          [e for e, share in enumerate(shares) for _ in share], len(self.engines), params)
            responses = [t.response_ids for t in trajectories]
            logprobs = [t.logprobs for t in trajectories]
            masks = [t.loss_mask for t in trajectories]
            extra = {"tool_calls": [t.tool_calls for t in trajectories], "finish": [t.finish for t in trajectories]}
            rollout_metrics = trajectory_metrics(trajectories, self.agent.tools.take_counts())
        lengths = [len(p) + max(len(resp), 1) for p, resp in zip(prompt_ids, responses)]
        ids = torch.zeros(len(prompt_ids), max(lengths), dtype=torch.long)
        width = max(max(len(resp) for resp in responses), 1)
        rollout_logp = torch.zeros(len(prompt_ids), width)
        loss_mask = torch.zeros(len(prompt_ids), width)
        for i, (p, resp, logp) in enumerate(zip(prompt_ids, responses, logprobs)):
            ids[i, : len(p) + len(resp)] = torch.tensor(p + resp, dtype=torch.long)
            rollout_logp[i, : len(resp)] = torch.tensor(logp, dtype=torch.float32)
            if masks is not None:
                loss_mask[i, : len(resp)] = torch.tensor(masks[i], dtype=torch.float32)
        if self.cfg.actor.routing_replay:
            from megarl.workers.batch import routed_experts

            extra["routed_experts"] = routed_experts([out["routed_experts"] for out in outputs], ids.shape[1])
        repeat = lambda values: [v for v in values for _ in range(n)]  # noqa: E731
        batch = {
            "input_ids": ids,
            "prompt_lengths": torch.tensor([len(p) for p in prompt_ids]),
            "response_lengths": torch.tensor([len(resp) for resp in responses]),
            "rollout_logp": rollout_logp,
            "uid": repeat(range(len(prompts["prompt_ids"]))),
            "responses": [self.tokenizer.decode(resp, skip_special_tokens=True) for resp in responses],
            "data_source": repeat(prompts["data_source"]),
            "ground_truth": repeat(prompts["ground_truth"]),
            "extra_info": repeat(prompts["extra_info"]),
            "weight_version": torch.tensor(sample_versions),
            **extra,
        }
        ended = time.time()
        self.timeline.span("generate", "rollout", started, ended, step + 1)
        batch["rollout_metrics"] = {**rollout_metrics, "time/generation_s": ended - started,
                                    "rollout/engine_restarts": float(restarts[0])}
        if masks is not None:
            batch["loss_mask"] = loss_mask
        return batch

    def _generate_in_chunks(self, prompt_ids: list[list[int]], shares: list[list[int]], params: dict,
                            seeds: list[int], step: int, restarts: list[int], version: int):
        """Partial rollouts (``rollout.partial_rollout_tokens``): every sample's response in chunks of
        that many tokens, each chunk asked of the engines as the continuation of the sample so far
        (re-seeded on the first chunk only, so without new weights the sampling goes on as in one
        call); before every later chunk the engines take the newest published weights
        (``RolloutStream.refresh``). Returns each sample's response ids, their log-probs and the
        weight version that sampled each token."""
        chunk, most = self.cfg.rollout.partial_rollout_tokens, params["max_new_tokens"]
        ids: list[list[int]] = [[] for _ in prompt_ids]
        logprobs: list[list[float]] = [[] for _ in prompt_ids]
        versions: list[list[int]] = [[] for _ in prompt_ids]
        active, first = [list(share) for share in shares], True
        while any(active):
            if not first:
                version = self.stream.refresh()
            per_engine = self._generate_on_engines(
                [[prompt_ids[i] + ids[i] for i in share] for share in active],
                [[{**params, "max_new_tokens": min(chunk, most - len(ids[i]))} for i in share] for share in active],
                seeds if first else [None] * len(self.engines), step, restarts)
            going = set()
            for share, results in zip(active, per_engine):
                for i, out in zip(share, results):
                    new = out["output_ids"][: most - len(ids[i])]
                    ids[i] += new
                    logprobs[i] += out["output_logprobs"][: len(new)]
                    versions[i] += [version] * len(new)
                    if new and out["finish_reason"] == "length" and len(ids[i]) < most:
                        going.add(i)
            active, first = [[i for i in share if i in going] for share in active], False
        return ids, logprobs, versions

    def _engine_turns(self, seed: int, step: int, restarts: list[int]):
        """The agent loop's ``generate``: every engine's requests of one turn at once; sampling is
        re-seeded on the first turn only, so later turns find the earlier ones in the engines'
        prefix caches (each trajectory stays on its engine)."""
        first = [True]

        def generate(inputs: list[list[list[int]]], params: list[list[dict]]) -> list[list[dict]]:
            seeds = [seed + e if first[0] else None for e in range(len(self.engines))]
            first[0] = False
            return self._generate_on_engines(inputs, params, seeds, step, restarts)

        return generate

    def _generate_on_engines(self, inputs: list[list[list[int]]], params: list[list[dict]], seeds: list[int | None],
                             step: int, restarts: list[int]) -> list[list[dict]]:
        """Engine e's outputs for ``inputs[e]`` (all engines at once). An engine that dies is
        restarted, given the current weights by a full (checksum-verified) sync and asked again
        with the same seed, so it samples what it would have; at most ``rollout.max_engine_restarts``
        times per step (``restarts[0]`` counts them), and never while the actor trains beside the
        generation (generation ahead of training: the sync would write other weights than the batch's)."""
        import ray

        from megarl.rollout.engine import EngineDiedError

        def ask(e: int):
            return self.engines[e].generate.remote(inputs[e], params[e], seeds[e], self.cfg.actor.routing_replay)

        if self.faults.fire("kill_engine", step + 1):
            self.log(f"megarl: fault injection: killing engine 0 (pid {ray.get(self.engines[0].kill_engine.remote())})")
        pending = {e: ask(e) for e in range(len(self.engines)) if inputs[e]}
        outputs: list[list[dict]] = [[] for _ in self.engines]
        while pending:
            e, ref = next(iter(pending.items()))
            try:
                outputs[e] = ray.get(ref)
                del pending[e]
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", exc)
                if not isinstance(cause, EngineDiedError):
                    raise
                why = str(cause).splitlines()[0]
                if restarts[0] >= self.cfg.rollout.max_engine_restarts or self.cfg.rollout.mode != "sync":
                    raise RunError(f"step {step + 1}: SGLang engine {e} died during generation ({why}); "
                                   + ("restarts are not done with generation ahead of training (the sync would "
                                      "write newer weights than the batch's); use rollout.mode=sync"
                                      if self.cfg.rollout.mode != "sync" else
                                      f"rollout.max_engine_restarts={self.cfg.rollout.max_engine_restarts} restarts "
                                      "this step already") + "; run the same command to resume from the last checkpoint"
                                   ) from exc
                restarts[0] += 1
                pid = ray.get(self.engines[e].restart.remote())
                self.log(f"megarl: step {step + 1}: SGLang engine {e} died during generation ({why}); restarted it "
                         f"(pid {pid}), resyncing the weights and retrying its {len(inputs[e])} request(s)")
                self.sync_weights()
                pending[e] = ask(e)
        return outputs

    def score(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """One score per sample: the reward model's output at the sample's last token when
        ``reward_model.enabled``, else the data source's reward function."""
        if self.cfg.reward_model.enabled:
            values = self.forward(batch, {"score": ("reward_model", "values")})["score"]
            last = (batch["response_lengths"] - 1).clamp(min=0)
            return values[torch.arange(len(last)), last].float(), {}
        if self.faults.fire("kill_reward_worker", self.step + 1):
            self.log(f"megarl: fault injection: a reward worker dies as it is to score step {self.step + 1}")
            self.rewards.crash_a_worker_in_the_next_batch()
        scores, stats = self.rewards(batch["data_source"], batch["responses"], batch["ground_truth"],
                                     batch["extra_info"])
        return scores.float(), stats

    def advantages(self, batch: dict, scores: torch.Tensor, metrics: dict) -> None:
        """Token rewards (score on the last token, minus a KL penalty if configured) -> the
        configured estimator's advantages and returns, written into ``batch``."""
        from megarl.algorithms import (
            advantage_spec,
            apply_kl_penalty,
            masked_mean,
            rollout_correction_weights,
            rollout_mismatch_metrics,
            scores_to_token_rewards,
        )
        from megarl.config.validate import RUN_ADVANTAGE_INPUTS
        from megarl.workers.batch import response_mask

        alg = self.cfg.algorithm
        mask = response_mask(batch)
        token_rewards = scores_to_token_rewards(scores, mask)
        if alg.kl_penalty.enabled:
            token_rewards, kl = apply_kl_penalty(token_rewards, batch["old_logp"], batch["ref_logp"], mask,
                                                 self.kl_controller.value, alg.kl_penalty.estimator)
            metrics["kl_penalty/kl"] = float(kl["kl"])
            metrics["kl_penalty/coef"] = float(kl["kl_coef"])
            self.kl_controller.update(float(kl["kl"]), n_steps=len(scores))
        # what a run has for the estimator's declared inputs (None: not in this run); config
        # validation refuses an estimator that declares others (megarl.config.validate.RUN_ADVANTAGE_INPUTS)
        supplied = dict(index=batch["uid"], values=batch.get("old_values"), gamma=alg.gamma, lam=alg.lam,
                        norm_by_std=alg.norm_adv_by_std)
        assert tuple(supplied) == RUN_ADVANTAGE_INPUTS, (tuple(supplied), RUN_ADVANTAGE_INPUTS)
        adv, returns = advantage_spec(alg.advantage)(token_rewards=token_rewards, response_mask=mask, **supplied)
        correction = alg.rollout_correction
        if "old_logp" in batch and not correction.bypass:  # the pre-update policy vs the engine's
            mismatch = rollout_mismatch_metrics(batch["old_logp"], batch["rollout_logp"], mask,
                                                correction.low, correction.high)
            metrics.update({f"actor/mismatch/{key}": float(value) for key, value in mismatch.items()})
        if correction.method != "none":
            weights = rollout_correction_weights(correction.method, batch["old_logp"], batch["rollout_logp"], mask,
                                                 correction.low, correction.high)
            adv = adv * weights
            metrics["rollout_correction/weight_mean"] = float(masked_mean(weights, mask))
            metrics["rollout_correction/zeroed_fraction"] = float(masked_mean((weights == 0).float(), mask))
        batch["advantages"], batch["returns"] = adv, returns

    def update(self, batch: dict) -> dict[str, float]:
        """``ppo_epochs`` passes over mini-batches: one optimizer step of the actor (and critic)
        each; metrics are averaged over the steps. Every call is queued at once: a worker runs its
        calls in order, and a critic on a pool of its own trains while the actor does."""
        import ray

        from megarl.workers.batch import response_mask

        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        rows = len(batch["uid"])
        calls = []  # each update call's replies, one per rank (rank 0's: the mini-batch's metrics)
        if self.faults.fire("kill_megatron_worker", self.step + 1):
            victim = len(self.role_workers["actor"]) - 1
            self.log(f"megarl: fault injection: Megatron rank {victim} of the actor dies as step {self.step + 1}'s "
                     "update begins")
            # queued ahead of its update call: the other ranks start the update and wait for it
            self.role_workers["actor"][victim].__ray_call__.remote(lambda worker: os.kill(os.getpid(), signal.SIGKILL))
        roles = [("actor", self.cfg.actor)] + ([("critic", self.cfg.critic)] if self.cfg.critic.enabled else [])
        for role, section in roles:
            size = (section.mini_batch_size or self.cfg.data.batch_size) * self.cfg.rollout.n
            for _ in range(section.ppo_epochs):
                for start in range(0, rows, size):
                    mini = {k: v[start:start + size] for k, v in tensors.items()}
                    mask = response_mask(mini)
                    counts = {"tokens": float(mask.sum()), "sequences": float((mask.sum(-1) > 0).sum())}
                    shared = ray.put(mini)  # serialized once for every rank
                    calls.append((role, [w.update.remote(role, shared, counts) for w in self.role_workers[role]]))
        seen: dict[str, list[float]] = {}
        for role, refs in calls:
            for key, value in self.gather(refs, self._worker_names(role), f"update ({role})")[0].items():
                seen.setdefault(key, []).append(value)
        return {key: sum(values) / len(values) for key, values in seen.items()}

    def sync_weights(self) -> dict[str, float]:
        """Reshard the actor's weights into every engine rank's parameters, in place, verified; with
        generation ahead of training (``self.stream``) the engines take them before their next
        generation, and the metrics are those of the applies done since the last step."""
        payload = self._weight_payload()
        if self.stream is None:
            return self._apply_weights(payload)
        self.stream.publish(self.step + 1, payload)
        applied = self.stream.take_applied()
        return applied[-1] if applied else {}

    def _weight_payload(self) -> list[list]:
        """Each engine's ``update_weights`` arguments: its ranks' SGLang tensors (Ray references),
        resharded from the actor's current weights.

        Colocated, engine e's rank r is assembled on device e * tp + r; on a separate pool each
        SGLang rank's shards are assembled once on a trainer device and every engine reads them."""
        tp = self.cfg.rollout.tp
        # colocated CPU engines read the shards straight from the workers' shared memory
        staged = self.cfg.rollout.placement == "colocated" and self.cfg.cluster.device == "cpu"
        rounds = [(ranks, [w.rollout_shards.remote(plan, staged) for w in self.workers])
                  for ranks, plan in self.sync_rounds]
        if self.cfg.rollout.placement == "separate":
            per_rank = {rank: shards[device] for ranks, shards in rounds for device, rank in ranks.items()}
            return [[per_rank[r] for r in range(tp)]] * len(self.engines)
        [(_, shards)] = rounds
        return [shards[e * tp:(e + 1) * tp] for e in range(len(self.engines))]

    def _apply_weights(self, payload: list[list]) -> dict[str, float]:
        """The engines' part of a sync: each writes its ranks' tensors and verifies them."""
        started = time.time()
        results = self.gather([engine.update_weights.remote(*args) for engine, args in zip(self.engines, payload)],
                              self._engine_names(), "weight sync")
        if self.stream is not None:
            self.timeline.span("apply weights", "rollout", started, time.time(), self.step + 1)
        return {"sync/bytes": sum(r["bytes"] for r in results), "sync/buckets": results[0]["buckets"],
                "sync/push_s": max(r["push_s"] for r in results), "sync/verify_s": max(r["verify_s"] for r in results)}

    # ------------------------------------------------------------------ the algorithms

    def fit(self) -> list[dict[str, float]]:
        """Run (or continue) until ``trainer.total_steps``; returns this process's step metrics."""
        cfg = self.cfg
        self._maybe_resume()
        history = []
        logger = MetricsLogger(self.out, cfg.trainer.loggers, total_steps=cfg.trainer.total_steps,
                               headline=self.HEADLINE, first_step=self.step)
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            while self.step < cfg.trainer.total_steps:
                metrics = self.train_step()
                self.step += 1
                metrics["step"] = self.step
                history.append(metrics)
                if self.step % cfg.trainer.log_every == 0 or self.step == cfg.trainer.total_steps:
                    logger.log(metrics)
                last = self.step == cfg.trainer.total_steps
                if self._stop_requested or last or (cfg.trainer.save_every and self.step % cfg.trainer.save_every == 0):
                    self.save_checkpoint()
                if self._stop_requested:
                    self.log(f"megarl: SIGTERM: saved step {self.step}, exiting")
                    break
        finally:
            signal.signal(signal.SIGTERM, previous)
            logger.close()
        return history

    def train_step(self) -> dict[str, float]:
        """One step of the algorithm (``rl_step``); its metrics."""
        return rl_step(self)

    def _on_sigterm(self, signum, frame) -> None:
        self._stop_requested = True
        self.log("megarl: SIGTERM received: finishing this step, then saving a checkpoint")

    def save_rollouts(self, batch: dict, scores: torch.Tensor, step: int) -> Path:
        """This step's samples as ``rollouts/step_<k>.jsonl``: one line per sample with its prompt
        and response token ids, the response text, its score and advantage at the first token (with
        routing replay its routed experts [positions][layers][top-k]; for multi-turn trajectories
        the loss mask, the tool calls and how it ended)."""
        from parallel.checkpoint.atomic import atomic_file

        target = self.out / "rollouts" / f"step_{step:06d}.jsonl"
        lines = []
        for i, text in enumerate(batch["responses"]):
            prompt, response = int(batch["prompt_lengths"][i]), int(batch["response_lengths"][i])
            ids = batch["input_ids"][i].tolist()
            line = {"uid": batch["uid"][i], "prompt_ids": ids[:prompt], "response_ids": ids[prompt:prompt + response],
                    "response": text, "score": float(scores[i]), "advantage": float(batch["advantages"][i, 0])}
            if "routed_experts" in batch:  # routing replay: the experts of every position the engine ran
                line["routed_experts"] = batch["routed_experts"][i, : prompt + response - 1].tolist()
            if "tool_calls" in batch:  # multi-turn: which response tokens the policy wrote, its tool calls
                line.update(loss_mask=batch["loss_mask"][i, :response].int().tolist(),
                            tool_calls=batch["tool_calls"][i], finish=batch["finish"][i])
            lines.append(json.dumps(line))
        with atomic_file(target) as partial:
            partial.write_text("\n".join(lines) + "\n")
        return target

    # ------------------------------------------------------------------ checkpoints

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        root = self.out / CHECKPOINT_DIR
        done = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()] if root.is_dir() else []
        return sorted(done, key=lambda p: int(p.name.split("_")[1]))

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_<k>`` atomically (the hidden ``.step_<k>.partial``, renamed
        when complete; a killed save's is removed by the next) with a manifest of its files'
        checksums, written last, and keep the last K. A failed save (a full disk) keeps the
        previous checkpoints and stops the run (RunError) saying so."""
        from parallel.checkpoint.atomic import atomic_directory, partial_dir
        from parallel.checkpoint.manifest import write_manifest

        target = self.out / CHECKPOINT_DIR / f"step_{self.step:06d}"
        if target.exists():
            return target
        try:
            with atomic_directory(target, partial=partial_dir(target)) as partial:
                self._call_workers("save_checkpoint", str(partial))
                if self.faults.fire("kill_driver_during_save", self.step):
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.faults.fire("checkpoint_enospc", self.step):
                    raise OSError(errno.ENOSPC, "No space left on device (injected: MEGARL_FAULTS)", str(partial))
                state = {"step": self.step, "fingerprint": config_fingerprint(self.cfg), **self.run_state()}
                (partial / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
                write_manifest(partial, checksums=self.cfg.trainer.checkpoint_checksums)
        except Exception as exc:  # noqa: BLE001 - a worker's OSError arrives wrapped by Ray
            previous = self.checkpoints()
            kept = f"the newest complete checkpoint, {previous[-1]}, is intact" if previous else "no checkpoint was kept"
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]  # Ray's: the traceback's last line
            raise RunError(f"saving {target} failed ({why}); nothing "
                           f"of it was kept and {kept}. Free space under {target.parent} (or lower trainer.keep_last) "
                           "and run the same command to resume") from exc
        for old in self.checkpoints()[: -self.cfg.trainer.keep_last or None]:
            shutil.rmtree(old, ignore_errors=True)
        self.log(f"megarl: saved {target}")
        return target

    def run_state(self) -> dict:
        """What a checkpoint keeps beside the models: the data position (before the prompts of any
        generation running ahead: a resumed run generates them again) and the KL controller."""
        with self._data_lock:
            data = self._data_before.get(self.step + 1) or self.loader.state_dict()
        return {"data": data, "kl_controller": self.kl_controller.state_dict()}

    def load_run_state(self, state: dict) -> None:
        self.loader.load_state_dict(state["data"])
        self.kl_controller.load_state_dict(state["kl_controller"])

    def resume_checkpoint(self) -> Path | None:
        """The checkpoint ``trainer.resume`` names, checked against its manifest: with ``auto`` the
        newest intact one (each newer one skipped is logged with what is wrong with it, and moved
        aside to ``.step_<k>.damaged``); RunError if the named one, or every one found, is damaged."""
        from parallel.checkpoint.manifest import manifest_problem

        resume = self.cfg.trainer.resume
        if resume == "none":
            return None
        found = self.checkpoints()
        if resume != "auto":
            problem = (f"{STATE_FILE} is missing" if not (Path(resume) / STATE_FILE).is_file()
                       else manifest_problem(resume))
            if problem:
                raise RunError(f"trainer.resume={resume}: not an intact megarl checkpoint: {problem}; pick one of "
                               f"{[str(p) for p in found]} or set trainer.resume=none")
            return Path(resume)
        problems, damaged = [], []
        for path in reversed(found):
            problem = manifest_problem(path)
            if problem is None:
                for bad in damaged:  # aside, so that this run's save of that step can take its place
                    aside = bad.with_name(f".{bad.name}.damaged")
                    shutil.rmtree(aside, ignore_errors=True)
                    bad.rename(aside)
                    self.log(f"megarl: moved the damaged checkpoint {bad} to {aside}")
                return path
            problems.append(f"{path.name}: {problem}")
            damaged.append(path)
            self.log(f"megarl: skipping checkpoint {path}: {problem}")
        if problems:
            raise RunError(f"no intact checkpoint in {self.out / CHECKPOINT_DIR} to resume from ({'; '.join(problems)}); "
                           "restore one, or set trainer.resume=none to start over")
        return None

    def _maybe_resume(self) -> None:
        path = self.resume_checkpoint()
        if path is None:
            return
        state = json.loads((path / STATE_FILE).read_text())
        changed = resume_changes(state["fingerprint"], self.cfg, path)
        rng_restored = all(self._call_workers("load_checkpoint", str(path)))
        if changed:
            rng = "" if rng_restored else ", and RNG states (re-seeded from (seed, optimizer steps, rank))"
            self.log(f"megarl: elastic resume from {path}: {changed}. {ELASTIC_NOTE}{rng}")
        self.load_run_state(state)
        self.step = state["step"]
        self.sync_weights()
        self.log(f"megarl: resumed from {path} (step {self.step})")

    def export_hf(self, target: str | None = None) -> str:
        """The actor as an HF checkpoint (default ``<output_dir>/hf_final``)."""
        target = target or str(self.out / "hf_final")
        if Path(target).exists():
            shutil.rmtree(target)
        self._call_workers("export_hf", target, role="actor")
        self.tokenizer.save_pretrained(target)
        return target

    def close(self) -> None:
        """Stop every engine and worker (and Ray, if this trainer started it)."""
        import ray

        if getattr(self, "stream", None) is not None:  # a generation running ahead ends with the engines
            self.stream.close()
        for engine in getattr(self, "engines", []):
            try:
                ray.get(engine.shutdown.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - best effort, then the process is killed
                pass
        if hasattr(self, "rewards"):
            self.rewards.close()
        if ray.is_initialized():
            ray.shutdown()


def gather(refs: list, who: list[str], phase: str, timeout_s: float, then: Callable[[], str] = str) -> list:
    """The results of Ray ``refs`` (one per worker named in ``who``) within ``timeout_s``. A worker
    that died, or that does not answer in time (a hang, e.g. a collective waiting for a dead rank),
    raises RunError naming it and the phase, followed by ``then()`` (what to do, asked only then):
    never a silent hang. Results are taken as they come, so the first death or error stops the
    phase at once, while the other ranks may still wait for the dead one in a collective."""
    import ray

    deadline = time.monotonic() + timeout_s
    names = dict(zip(refs, who))
    results, pending = {}, list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise RunError(f"{phase}: {', '.join(names[ref] for ref in pending)} did not finish within "
                           f"trainer.phase_timeout_s={timeout_s:g} s ({len(refs) - len(pending)} of {len(refs)} "
                           f"did): a hang, e.g. a collective waiting for a dead or stuck rank. {then()}".strip())
        try:
            results[done[0]] = ray.get(done[0])
        except ray.exceptions.RayActorError as exc:
            raise RunError(f"{phase}: {names[done[0]]} died ({str(exc).strip().splitlines()[0]}). "
                           f"{then()}".strip()) from exc
    return [results[ref] for ref in refs]


def _ready_placement_group(bundles: list[dict]):
    """A placement group of ``bundles`` (packed onto as few nodes as possible), once Ray has
    reserved it; fails after 5 minutes if the cluster cannot hold it."""
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group([dict(b) for b in bundles], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=300)
    except ray.exceptions.GetTimeoutError:
        raise RunError(f"Ray could not reserve {len(bundles)} x {bundles[0]} within 300 s (cluster resources: "
                       f"{ray.cluster_resources()}); check cluster.nodes / pools against the Ray cluster") from None
    return group


def _in_bundle(group, index: int) -> dict:
    """Ray options that run an actor or task in bundle ``index`` of placement group ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, index)}


def _address() -> tuple[str, int]:
    """(IP, free port) of the node this runs on: rank 0's torch.distributed rendezvous."""
    import ray

    from parallel.spawn import free_port

    return ray.util.get_node_ip_address(), free_port()


def _dtype(name: str) -> torch.dtype:
    from model_specs.base import dtype_from_name

    return dtype_from_name(name)


# ----------------------------------------------------------------------------- algorithm steps


class _Timer:
    """``with timed(phase):`` records the phase's duration as ``time/<phase>_s`` and its span on
    the controller's lane of the timeline."""

    def __init__(self, metrics: dict, timeline: Timeline, step: int):
        self.metrics, self.timeline, self.step = metrics, timeline, step

    def __call__(self, phase: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.start = time.time()

            def __exit__(self, *exc):
                end = time.time()
                timer.metrics[f"time/{phase}_s"] = end - self.start
                timer.timeline.span(phase, "controller", self.start, end, timer.step)

        return _Phase()


def _recomputes_old_logp(t: Trainer) -> bool:
    """Whether the actor recomputes the pre-update log-probs (a forward pass before the update):
    off-policy passes (several epochs or mini-batches), the KL reward penalty, PPO with a critic
    and a rollout correction use them; a single on-policy GRPO pass uses the update's own forward
    (detached) instead of a second one; with ``rollout_correction.bypass`` the rollout's are used."""
    a, alg = t.cfg.actor, t.cfg.algorithm
    if alg.rollout_correction.bypass:
        return False
    return (a.ppo_epochs * t._minibatches_per_step(a.mini_batch_size) > 1 or alg.kl_penalty.enabled
            or t.cfg.critic.enabled or alg.rollout_correction.method != "none" or t.cfg.rollout.staleness > 0)


def _partial_rollout_metrics(versions: list[list[int]], step: int) -> dict[str, float]:
    """Partial rollouts: the samples whose tokens come from more than one weight version, and the
    mean lag of a token's weights behind the weights (0-based) step ``step`` trains with."""
    tokens = [v for sample in versions for v in sample]
    return {"rollout/partial_samples": float(sum(len(set(sample)) > 1 for sample in versions)),
            "rollout/token_version_lag_mean": float(step - sum(tokens) / max(len(tokens), 1))}


def _common_metrics(batch: dict, scores: torch.Tensor, reward_stats: dict, metrics: dict) -> None:
    lengths = batch["response_lengths"].float()
    metrics.update({
        "reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
    })
    metrics.update({f"reward/{k}": float(v) for k, v in reward_stats.items() if isinstance(v, (int, float))})


def rl_step(t: Trainer) -> dict[str, float]:
    """generate -> reward -> reference (+ critic values) -> advantages -> update(s) -> weight sync.

    GRPO-style runs (no critic) take the group baseline from the rewards; PPO (``critic.enabled``)
    adds the critic's values, GAE, and the critic update inside ``Trainer.update``."""
    metrics: dict[str, float] = {}
    timed = _Timer(metrics, t.timeline, t.step + 1)
    start = time.perf_counter()
    with timed("generate"):  # ahead of training: the wait for the batch generated meanwhile
        batch = t.next_rollout()
    t.engines_hold_memory(False)
    with timed("reward"):
        scores, reward_stats = t.score(batch)
    wanted = {}  # batch key -> (role, output) of the forward-only passes
    if t.cfg.needs_reference:
        wanted["ref_logp"] = ("ref", "logp")
    if _recomputes_old_logp(t):
        wanted["old_logp"] = ("actor", "logp")
    elif t.cfg.algorithm.rollout_correction.bypass:
        batch["old_logp"] = batch["rollout_logp"]
    if t.cfg.critic.enabled:
        wanted["old_values"] = ("critic", "values")
    if wanted:
        with timed("forward"):
            batch.update(t.forward(batch, wanted))
    t.advantages(batch, scores, metrics)
    if t.cfg.trainer.save_rollouts_every and (t.step + 1) % t.cfg.trainer.save_rollouts_every == 0:
        t.save_rollouts(batch, scores, t.step + 1)
    with timed("update"):
        metrics.update(t.update(batch))
    with timed("sync"):
        t.engines_hold_memory(True)
        metrics.update(t.sync_weights())
    _finish_metrics(t, batch, scores, reward_stats, metrics, start)
    return metrics


def _finish_metrics(t: Trainer, batch: dict, scores, reward_stats, metrics: dict, start: float) -> None:
    _common_metrics(batch, scores, reward_stats, metrics)
    metrics.update(batch["rollout_metrics"])
    lag = t.step - batch["weight_version"]  # updates between the generating weights and the trained ones
    metrics.update({"rollout/version_lag_mean": float(lag.float().mean()), "rollout/version_lag_max": float(lag.max())})
    metrics.update({f"rollout/version_lag/{int(v)}": float((lag == v).sum()) for v in lag.unique()})
    elapsed = time.perf_counter() - start
    tokens = float((batch["prompt_lengths"] + batch["response_lengths"]).sum())
    metrics.update({"time/step_s": elapsed, "throughput/samples_per_s": len(scores) / elapsed,
                    "throughput/tokens_per_s": tokens / elapsed,
                    "throughput/generated_tokens_per_s": float(batch["response_lengths"].sum())
                    / metrics["time/generation_s"]})
    flops = _flops_per_token(t)
    if flops:
        metrics["perf/train_tflops_per_s"] = 3 * flops * tokens / metrics["time/update_s"] / 1e12


def _flops_per_token(t: Trainer) -> float:
    """Forward FLOPs per token (2 x parameters), from the model config."""
    hf = t.hf_config
    h, f, layers, v = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["vocab_size"]
    kv = hf.get("num_key_value_heads", hf["num_attention_heads"]) * hf.get("head_dim", h // hf["num_attention_heads"])
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * f
    return 2.0 * (layers * per_layer + h * v)
