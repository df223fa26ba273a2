"""The SGLang engines of a run and everything asked of them: their start and restart, the
generation of each step's batch (sync, or ahead of training through a ``RolloutStream``, in
partial chunks, or as multi-turn trajectories), and the weight sync from the actor's ranks.

One engine of ``rollout.tp`` ranks runs per ``rollout.tp`` ranks of the actor's pool (colocated)
or of the rollout's own pool (separate). A weight sync reshards the actor's parameters into every
engine rank's, in place, and each engine verifies what it received.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

from megarl.config.schema import RunConfig
from megarl.controller.worker_group import RunError, WorkerGroup, in_bundle, ready_placement_group, where_this_runs
from megarl.faults import FaultPlan
from megarl.metrics import Timeline
from megarl.rollout.stream import RolloutStream


def weight_sync_rounds(cfg: RunConfig, hf_config: dict, layer_spec: str = "local"
                       ) -> list[tuple[dict[int, int] | None, Any]]:
    """The checked resharding plans of one weight sync, in order: (device -> SGLang rank assembled
    there, plan) per round for engines on their own pool, or one (None, plan) when colocated (engine
    e's rank r assembled on device e * rollout.tp + r). ``layer_spec``: how the actor's parameters
    are named (what its workers built: "te" where Transformer Engine imports)."""
    from model_specs.base import dtype_from_name
    from parallel.reshard.plan import plan_megatron_to_sglang, separate_pool_rounds

    world, tp = cfg.world_size_for("actor"), cfg.rollout.tp
    rounds = separate_pool_rounds(world, tp) if cfg.rollout.placement == "separate" else [None]
    element_size = torch.tensor([], dtype=dtype_from_name(cfg.model.dtype)).element_size()
    plans = [(ranks, plan_megatron_to_sglang(hf_config, cfg.actor.layout, world, tp,
                                             engine_ranks=ranks, element_size=element_size, layer_spec=layer_spec,
                                             rollout_ep=cfg.rollout.ep))
             for ranks in rounds]
    for _, plan in plans:
        plan.check()
    return plans


def engines_share_gpus(cfg: RunConfig) -> bool:
    """Colocated engines on GPUs: they give their memory to Megatron while it computes."""
    return cfg.rollout.placement == "colocated" and cfg.cluster.device == "gpu"


def engine_settings(cfg: RunConfig, hf_config: dict) -> dict[str, Any]:
    """The ``SGLangEngine`` keyword arguments of every engine of the run (where each runs is added
    per engine). Engines start from dummy weights (SGLang's ``load_format="dummy"``: no checkpoint
    read); the manager syncs the actor's weights into them before their first generation.
    Colocated on GPUs, SGLang's memory saver makes ``release_memory`` free their memory."""
    from megarl.rollout.engine_worker import engine_timeouts
    from model_specs.arithmetic import total_parameters

    r = cfg.rollout
    startup_s, call_s = engine_timeouts(total_parameters(hf_config), r.max_new_tokens)
    settings: dict[str, Any] = {
        "random_seed": cfg.trainer.seed, "ep_size": r.ep, "load_format": "dummy",
        # said, not detected: an engine actor holds no GPU of Ray's, and a Ray that then hides every
        # GPU from it would silently start SGLang's CPU engine
        "device": "cuda" if cfg.cluster.device == "gpu" else "cpu",
        "startup_timeout_s": startup_s if r.startup_timeout_s is None else r.startup_timeout_s,
        "call_timeout_s": call_s if r.call_timeout_s is None else r.call_timeout_s}
    if cfg.actor.routing_replay:
        settings["enable_return_routed_experts"] = True
    if cfg.cluster.device == "gpu":
        settings["mem_fraction_static"] = r.mem_fraction_static
    if engines_share_gpus(cfg):
        settings["enable_memory_saver"] = True
    return settings


class RolloutManager:
    """The run's engines, started beside ``workers`` (whose actor ranks hold the weights), and
    the prompts of ``loader`` they generate from. ``agent``: the multi-turn loop, or None."""

    def __init__(self, cfg: RunConfig, log: Callable[[str], None], workers: WorkerGroup, model_dir: str,
                 hf_config: dict, actor_layer_spec: str, loader, tokenizer, agent, timeline: Timeline,
                 faults: FaultPlan):
        self.cfg, self.log, self.workers, self.model_dir = cfg, log, workers, model_dir
        self.loader, self.tokenizer, self.agent, self.timeline, self.faults = loader, tokenizer, agent, timeline, faults
        # rollout.mode one_step_off / streaming: generation ahead of training, and the data position
        # before each generated step's prompts were drawn (a checkpoint resumes from the first untrained)
        self.stream: RolloutStream | None = None
        self._data_lock = threading.Lock()
        self._data_before: dict[int, dict] = {}
        self._published = 0  # the updates in the newest weights published to the engines
        # False while the engines hold no weights of the actor's (dummy weights at start, or
        # released memory): the next generation syncs the actor's current weights first
        self._engines_hold_actor = False
        self._released = False  # the engines' memory is released (engines_share_gpus)
        self.engines = self._start_engines(engine_settings(cfg, hf_config))
        self.sync_rounds = weight_sync_rounds(cfg, hf_config, actor_layer_spec)
        self._call_engines("generate", [[1]], [{"max_new_tokens": 1}], None)  # the engines are up

    def _start_engines(self, engine_kwargs: dict[str, Any]) -> list:
        """One SGLang engine per ``rollout.tp`` ranks (colocated or on the rollout's pool), each
        started with ``engine_kwargs`` (``engine_settings``)."""
        import ray

        from megarl.rollout.engine_worker import RolloutWorker

        cfg, r = self.cfg, self.cfg.rollout
        gpu = cfg.cluster.device == "gpu"
        if not gpu:  # each engine rank gets a Megatron rank's share of the cores; without this it would
            # inherit the OMP_NUM_THREADS=1 (or =num_cpus) that Ray sets for its actors: 1.6x slower
            engine_kwargs["env"] = {"OMP_NUM_THREADS": str(self.workers.threads)}
        engine_args = (self.model_dir, r.tp, cfg.model.dtype, engine_kwargs)
        if r.placement == "separate":
            # One bundle per engine (all its ranks on one node); engine ranks get the resharded
            # weights from the trainer's devices through Ray's object store.
            num_engines = cfg.world_size_for("rollout") // r.tp
            pg = self.workers.placements[r.pool] = ready_placement_group(
                [{"GPU": r.tp, "CPU": 1} if gpu else {"CPU": r.tp}] * num_engines)
            engine_cls = ray.remote(num_cpus=1 if gpu else r.tp, num_gpus=r.tp if gpu else 0)(RolloutWorker)
            engines = [engine_cls.options(**in_bundle(pg, e)).remote(*engine_args) for e in range(num_engines)]
        else:
            engine_cls = ray.remote(num_cpus=0)(RolloutWorker)
            pg = self.workers.placements[cfg.actor.pool]
            if gpu:  # each engine on rollout.tp consecutive GPUs of one node, beside the ranks that hold them
                engines = [engine_cls.options(**in_bundle(pg, self.workers.bundles[cfg.actor.pool][p.ranks[0]])).remote(
                    self.model_dir, r.tp, cfg.model.dtype,
                    {**engine_kwargs, "base_gpu_id": p.base_gpu_id, "env": {"CUDA_VISIBLE_DEVICES": p.visible_devices}})
                    for p in self._gpu_placements()]
            else:  # one per rollout.tp of the actor's ranks
                engines = [engine_cls.options(**in_bundle(pg, self.workers.bundles[cfg.actor.pool][e * r.tp])).remote(
                    *engine_args)
                           for e in range(max(1, cfg.world_size_for("actor") // r.tp))]
        where = (f"on their own pool {r.pool!r}" if r.placement == "separate" else "colocated")
        rows = ("one per prompt, its samples as branches (shared prompts)" if cfg.shared_prompt_rows
                else "one packed row per micro-batch" if cfg.actor.sequence_packing else "one per sample")
        replay = "; routing replay: the actor's routers use the engines' experts" if cfg.actor.routing_replay else ""
        self.log(f"megarl: {len(engines)} SGLang engine(s) of TP={r.tp} {where}; rows: {rows}{replay}; deadlines: "
                 f"start {engine_kwargs['startup_timeout_s']:g} s, call {engine_kwargs['call_timeout_s']:g} s")
        return engines

    def _gpu_placements(self) -> list:
        """Colocated engines on GPUs: where each runs (``colocated_engine_placements``), from the node
        and GPU Ray gave each of the actor's ranks (``WorkerGroup.bundles``: rank i in bundle ``bundles[i]``)."""
        from megarl.controller.placement import PlacementError, colocated_engine_placements

        actor = self.workers.role_workers["actor"]
        reports = self.workers.gather([w.__ray_call__.remote(_where_rank_runs) for w in actor],
                                      self.workers.names("actor"), "engine placement")
        rank_gpus = []
        for rank, (node, gpu_ids) in enumerate(reports):
            if len(gpu_ids) != 1:
                raise RunError(f"engine placement: Megatron rank {rank} of the actor holds GPUs {gpu_ids} (Ray), "
                               "not one; each rank's bundle is {GPU: 1}")
            rank_gpus.append((node, gpu_ids[0]))
        try:
            placements = colocated_engine_placements(rank_gpus, self.cfg.rollout.tp)
        except PlacementError as exc:
            raise RunError(f"engine placement: {exc}") from None
        for e, p in enumerate(placements):
            self.log(f"megarl: SGLang engine {e} on node {p.node.split()[0]}, GPUs {list(p.gpu_ids)} (Megatron ranks "
                     f"{list(p.ranks)}; CUDA_VISIBLE_DEVICES={p.visible_devices}, base_gpu_id={p.base_gpu_id})")
        return placements

    def _engine_names(self) -> list[str]:
        return [f"SGLang engine {e}" for e in range(len(self.engines))]

    def _call_engines(self, method: str, *args) -> list:
        return self.workers.gather([getattr(e, method).remote(*args) for e in self.engines], self._engine_names(),
                                   method)

    def release_memory(self) -> None:
        """Colocated engines on GPUs give their weights, KV cache and CUDA graphs to Megatron until
        the next weight sync (or generation, which syncs first) takes them back. Nothing to do on
        CPU or with a separate rollout pool."""
        if engines_share_gpus(self.cfg) and not self._released:
            self._call_engines("release_memory")
            self._released, self._engines_hold_actor = True, False

    # ------------------------------------------------------------------ generation

    def next_batch(self, trained: int, draw: int = 0) -> dict:
        """The batch of the step after ``trained`` updates: its prompts drawn and generated now
        (``rollout.mode=sync``; ``draw``: the step's earlier draws, as dynamic sampling makes), or
        taken from the generation running ahead of training (``RolloutStream``, started at the
        first call)."""
        if not self._engines_hold_actor:  # a fresh run's engines (dummy weights), or released memory
            self.sync_weights(trained)
        if self.cfg.rollout.mode == "sync":
            return self.generate(self.loader.next_batch(), trained, draw=draw)
        if self.stream is None:
            self.stream = RolloutStream(self._generate_ahead, self._apply_weights,
                                        max_staleness=self.cfg.rollout.staleness, first_step=trained + 1,
                                        last_step=self.cfg.trainer.total_steps, version=trained)
        timeout_s = self.cfg.trainer.phase_timeout_s
        try:
            batch = self.stream.take(trained + 1, timeout_s)
        except TimeoutError as exc:
            raise RunError(f"generation: {exc}, trainer.phase_timeout_s={timeout_s:g} s: a hang, e.g. a stuck "
                           f"engine. {self.workers.then()}") from None
        with self._data_lock:
            self._data_before.pop(trained + 1, None)
        return batch

    def data_state(self, trained: int) -> dict:
        """The data position a checkpoint after ``trained`` updates keeps: before the prompts of any
        generation running ahead (a resumed run generates them again)."""
        with self._data_lock:
            return self._data_before.get(trained + 1) or self.loader.state_dict()

    def _generate_ahead(self, step: int, version: int) -> dict:
        """``RolloutStream``'s generation of (1-based) step ``step``'s batch by weights ``version``:
        its prompts are drawn here, in step order, and the data position before them kept."""
        with self._data_lock:
            self._data_before[step] = self.loader.state_dict()
            prompts = self.loader.next_batch()
        return self.generate(prompts, step - 1, version)

    def generate(self, prompts: dict, step: int, version: int | None = None, draw: int = 0) -> dict:
        """``rollout.n`` samples of every prompt from the engines (multi-turn trajectories with tool
        calls when ``rollout.multi_turn.enabled``): the batch (0-based) step ``step`` trains on,
        sampled with that step's seed (offset by ``draw``, the step's earlier draws of prompts) by
        the engines' current weights (their ``weight_version``: the updates synced into them;
        default ``step``)."""
        from megarl.rollout.engine_worker import engine_shares

        r = self.cfg.rollout
        n = r.n
        prompt_ids = [ids for ids in prompts["prompt_ids"] for _ in range(n)]
        params = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                  "max_new_tokens": r.max_new_tokens, "ignore_eos": r.ignore_eos}
        if r.stop_token_ids:
            params["stop_token_ids"] = list(r.stop_token_ids)
        shares = engine_shares(len(prompt_ids), len(self.engines))
        seed = self.cfg.trainer.seed * 100_003 + step + draw * 7_919
        version, started = step if version is None else version, time.time()
        extra: dict[str, list] = {}
        rollout_metrics: dict[str, float] = {}
        restarts = [0]  # engines restarted during this step (a list: the agent loop's callback adds to it)
        sample_versions = [version] * len(prompt_ids)  # the weights of each sample's oldest token
        if self.agent is None:
            seeds = [seed + e for e in range(len(self.engines))]
            if r.partial_rollout_tokens and self.stream is not None:
                responses, logprobs, versions = self._generate_in_chunks(prompt_ids, shares, params, seeds, step,
                                                                         restarts, version)
                rollout_metrics = partial_rollout_metrics(versions, step)
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

        from megarl.rollout.sglang.engine import EngineDiedError

        def ask(e: int):
            return self.engines[e].generate.remote(inputs[e], params[e], seeds[e], self.cfg.actor.routing_replay)

        if self.faults.fire("kill_engine", step + 1):
            self.kill_engine(0)
        pending = {e: ask(e) for e in range(len(self.engines)) if inputs[e]}
        outputs: list[list[dict]] = [[] for _ in self.engines]
        max_restarts, mode = self.cfg.rollout.max_engine_restarts, self.cfg.rollout.mode
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
                if restarts[0] >= max_restarts or mode != "sync":
                    raise RunError(f"step {step + 1}: SGLang engine {e} died during generation ({why}); "
                                   + ("restarts are not done with generation ahead of training (the sync would "
                                      "write newer weights than the batch's); use rollout.mode=sync"
                                      if mode != "sync" else
                                      f"rollout.max_engine_restarts={max_restarts} restarts this step already")
                                   + "; run the same command to resume from the last checkpoint") from exc
                restarts[0] += 1
                pid = ray.get(self.engines[e].restart.remote())
                self.log(f"megarl: step {step + 1}: SGLang engine {e} died during generation ({why}); restarted it "
                         f"(pid {pid}), resyncing the weights and retrying its {len(inputs[e])} request(s)")
                self._apply_weights(self._weight_payload())
                pending[e] = ask(e)
        return outputs

    def kill_engine(self, e: int) -> None:
        """Fault injection (``kill_engine``): SIGKILL engine ``e``'s processes, as a crash would."""
        import ray

        self.log(f"megarl: fault injection: killing engine {e} (pid {ray.get(self.engines[e].kill_engine.remote())})")

    # ------------------------------------------------------------------ weight sync

    def sync_weights(self, version: int) -> dict[str, float]:
        """Reshard the actor's weights (after ``version`` updates) into every engine rank's
        parameters, in place, verified; with generation ahead of training (``self.stream``) the
        engines take them before their next generation, and the metrics are those of the applies
        done since the last call."""
        if self._released:  # Megatron's cached free blocks go back to the device first
            self.workers.call("release_cached_memory")
        payload = self._weight_payload()
        self._published = version
        if self.stream is None:
            return self._apply_weights(payload)
        self.stream.publish(version, payload)
        applied = self.stream.take_applied()
        return applied[-1] if applied else {}

    def _weight_payload(self) -> list[list]:
        """Each engine's ``update_weights`` arguments: its ranks' SGLang tensors (Ray references),
        resharded from the actor's current weights.

        Colocated, engine e's rank r is assembled on device e * tp + r; on a separate pool each
        SGLang rank's shards are assembled once on a trainer device and every engine reads them."""
        tp = self.cfg.rollout.tp
        # colocated engines read the shards straight from the workers' buffers (CUDA IPC, shared memory)
        colocated = self.cfg.rollout.placement == "colocated"
        actor = self.workers.role_workers["actor"]
        rounds = [(ranks, [w.rollout_shards.remote(plan, colocated) for w in actor]) for ranks, plan in self.sync_rounds]
        if self.cfg.rollout.placement == "separate":
            per_rank = {rank: shards[device] for ranks, shards in rounds for device, rank in ranks.items()}
            return [[per_rank[r] for r in range(tp)]] * len(self.engines)
        [(_, shards)] = rounds
        return [shards[e * tp:(e + 1) * tp] for e in range(len(self.engines))]

    def _apply_weights(self, payload: list[list]) -> dict[str, float]:
        """The engines' part of a sync: each writes its ranks' tensors and verifies them."""
        started = time.time()
        results = self.workers.gather([engine.update_weights.remote(*args) for engine, args in zip(self.engines, payload)],
                                      self._engine_names(), "weight sync")
        self._engines_hold_actor, self._released = True, False
        if self.cfg.rollout.placement == "colocated" and self.cfg.cluster.device == "gpu":
            import ray  # the engines have loaded the actor's CUDA buckets: free them before generation

            ray.get([w.__ray_call__.remote(_free_sent_buckets) for w in self.workers.role_workers["actor"]])
        if self.stream is not None:
            self.timeline.span("apply weights", "rollout", started, time.time(), self._published)
        return {"sync/bytes": sum(r["bytes"] for r in results), "sync/buckets": results[0]["buckets"],
                "sync/push_s": max(r["push_s"] for r in results), "sync/verify_s": max(r["verify_s"] for r in results)}

    def close(self) -> None:
        """Stop the generation running ahead, then every engine (best effort: their processes are
        killed with Ray's)."""
        import ray

        if self.stream is not None:
            self.stream.close()
        for engine in self.engines:
            try:
                ray.get(engine.shutdown.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - best effort, then the process is killed
                pass


def _free_sent_buckets(worker) -> None:
    """In a Megatron worker (``__ray_call__``): free the CUDA buckets of the last sync, which every
    engine has loaded and released (torch keeps an exported block until then)."""
    import torch

    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()


def _where_rank_runs(worker) -> tuple[str, list[int]]:
    """In a Megatron worker (``__ray_call__``): ``worker_group.where_this_runs``."""
    return where_this_runs()


def partial_rollout_metrics(versions: list[list[int]], step: int) -> dict[str, float]:
    """Partial rollouts: the samples whose tokens come from more than one weight version, and the
    mean lag of a token's weights behind the weights (0-based) step ``step`` trains with."""
    tokens = [v for sample in versions for v in sample]
    return {"rollout/partial_samples": float(sum(len(set(sample)) > 1 for sample in versions)),
            "rollout/token_version_lag_mean": float(step - sum(tokens) / max(len(tokens), 1))}
