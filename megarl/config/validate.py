"""Semantic checks of a typed RunConfig, before any process, model or engine exists.

Each problem is one self-contained line ``<dotted.key>=<value>: <what is wrong>; <the fix>``;
all problems are collected and raised together as one ``ConfigError``. What is checked:

* each field's own bounds, declared next to it in ``megarl.config.schema`` (learning rate > 0,
  rollout.n >= 1, temperature >= 0, clip ratios, ...), and bounds between fields (min_lr <= lr, ...);
* registry names (advantage estimator, policy loss, loss aggregation mode, KL estimators,
  reward functions, reward backend), listing the valid names;
* the model: a preset name or a local directory with config.json, of a supported family;
* resources: the pools each role names exist and fit in the cluster;
* Megatron layouts of actor / critic / reference against their pool's size and the model
  (``parallel.layout.MegatronLayout.validate``: TP*PP*CP divides the world, heads and KV heads
  divisible by TP, layers by PP*VPP);
* micro-batches: the batch splits over data-parallel ranks and micro-batches, and with VPP the
  micro-batch count is a multiple of PP (megatron's interleaved schedule);
* the rollout's SGLang tensor parallelism against the model's heads and its pool;
* cross-section needs: GAE needs a critic, a KL term needs the reference, group-based
  estimators and dynamic sampling need rollout.n >= 2, prompt + response fit the model's
  positions, an MoE model on CPU ranks needs the allgather dispatcher;
* valid settings a run does not implement yet: two layouts on one pool, an engine spanning nodes
  or sharing ranks with a Megatron role on a separate pool, colocated engines on GPUs whose
  rollout.tp does not divide a node's GPUs (``placement_checks.not_implemented_checks``),
  dynamic sampling with generation ahead of training;
* files: data files and a resume checkpoint exist (``check_files=False`` skips this).

The checks of where the models run (resources, layouts, micro-batches, engines, what is not
implemented) are ``megarl.config.placement_checks``'s.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from megarl.config.errors import ConfigError, Problems, field_problems, show
from megarl.config.placement_checks import divisors, not_implemented_checks, resource_checks
from megarl.config.schema import MEGATRON_ROLES, RunConfig

DATA_SUFFIXES = (".parquet", ".jsonl")
# Keys whose bad values make the parallel-size cross-checks meaningless.
_SIZE_KEYS = ("rollout.n=", "rollout.tp=", "data.batch_size=", "cluster.") + tuple(
    f"{role}.{k}=" for role in MEGATRON_ROLES for k in ("micro_batch_size", "mini_batch_size")
)


def model_hf_config(path: str) -> dict:
    """The HF config dict of ``model.path``: a local directory's config.json, else a preset.

    ValueError (one line) if it is neither, or the file is unreadable.
    """
    from model_specs.presets import PRESETS, hf_config_dict

    local = Path(path).expanduser()
    if local.is_dir():
        config_json = local / "config.json"
        if not config_json.is_file():
            raise ValueError("the directory has no config.json; point it at an HF model directory")
        try:
            return json.loads(config_json.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{config_json} cannot be read as JSON ({exc}); fix or re-download it") from None
    if path in PRESETS:
        return hf_config_dict(path)
    import difflib

    close = difflib.get_close_matches(path, list(PRESETS), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"is neither a local model directory nor a model preset; {hint}presets: {', '.join(sorted(PRESETS))} "
        "(download a hub model first, e.g. with huggingface-cli download, and give its directory)"
    )


def _response_key(cfg: RunConfig) -> str:
    """The setting that bounds the tokens after a prompt (``RunConfig.max_response_length``)."""
    return "rollout.multi_turn.max_total_tokens" if cfg.rollout.multi_turn.enabled else "rollout.max_new_tokens"


def _multi_turn_checks(cfg: RunConfig, p: Problems) -> None:
    """Tools that exist and a call format the parser knows, checked before anything starts."""
    from megarl.agent import TOOL_CALL_FORMATS, ToolRegistry

    m = cfg.rollout.multi_turn
    if not m.enabled:
        return
    p.check(m.tool_format in TOOL_CALL_FORMATS, "rollout.multi_turn.tool_format", m.tool_format,
            "is not a known tool-call format", f"use one of {sorted(TOOL_CALL_FORMATS)}")
    try:
        ToolRegistry.from_names(m.tools)
    except ValueError as exc:
        p.add("rollout.multi_turn.tools", m.tools, str(exc), "list built-in tools (calculator, python) or module:function")
    p.check(m.max_total_tokens >= cfg.rollout.max_new_tokens, "rollout.multi_turn.max_total_tokens", m.max_total_tokens,
            f"is below one turn's rollout.max_new_tokens={cfg.rollout.max_new_tokens}",
            f"use at least {cfg.rollout.max_new_tokens} (several turns' worth)")


def _bound_checks(cfg: RunConfig, p: Problems) -> None:
    """Bounds that involve more than one field (each field's own bounds are declared next to it
    in ``megarl.config.schema`` and reported by ``field_problems``)."""
    for role in ("actor", "critic"):
        section = getattr(cfg, role)
        if role == "critic" and not section.enabled:
            continue
        o = section.optim
        p.check(0 <= o.min_lr <= max(o.lr, 0), f"{role}.optim.min_lr", o.min_lr, f"must be in [0, lr={o.lr}]",
                "use 0.0 or a fraction of lr")
        budget = section.max_tokens_per_micro_batch
        if budget is not None:
            need = cfg.data.max_prompt_length + cfg.max_response_length
            p.check(budget >= need, f"{role}.max_tokens_per_micro_batch", budget,
                    f"a full sequence (data.max_prompt_length + {_response_key(cfg)} = {need} tokens) must fit "
                    "in one micro-batch", f"set it to at least {need}, or null to use micro_batch_size")
        mini = section.mini_batch_size
        if mini is not None and mini >= 1:
            p.check(cfg.data.batch_size % mini == 0, f"{role}.mini_batch_size", mini,
                    f"must divide data.batch_size={cfg.data.batch_size} (optimizer steps per RL step = "
                    "batch_size / mini_batch_size)",
                    f"pick one of {divisors(cfg.data.batch_size)} or null")

    a = cfg.actor
    if a.clip_ratio_c is not None:
        p.check(a.policy_loss == "ppo", "actor.clip_ratio_c", a.clip_ratio_c,
                f"dual-clip only applies to actor.policy_loss='ppo' (got {a.policy_loss!r})", "set it to null")
    r = cfg.rollout
    buffer_len = cfg.algorithm.overlong_penalty.buffer_len
    if buffer_len is not None:
        p.check(1 <= buffer_len <= r.max_new_tokens, "algorithm.overlong_penalty.buffer_len", buffer_len,
                f"must be in [1, rollout.max_new_tokens={r.max_new_tokens}]",
                "use null (20% of max_new_tokens) or a smaller value")
    p.check(bool(cfg.data.train_files), "data.train_files", cfg.data.train_files, "no training prompt files",
            "set data.train_files=[path.parquet] (tools/prepare_data.py writes them)")
    c = cfg.cluster
    if c.gpus_per_node == 0:
        p.check(c.cpu_ranks_per_node >= 1, "cluster.cpu_ranks_per_node", c.cpu_ranks_per_node,
                "must be >= 1 on a CPU cluster", "use e.g. 2")


def _registry_checks(cfg: RunConfig, p: Problems) -> None:
    from megarl.algorithms import KL_ESTIMATORS, LOSS_AGG_MODES, list_advantages, list_policy_losses, list_rollout_corrections

    def one_of(key: str, value: str, valid: list[str] | tuple[str, ...], what: str) -> bool:
        import difflib

        if value in valid:
            return True
        close = difflib.get_close_matches(value, list(valid), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        p.add(key, value, f"unknown {what}", f"{hint}valid: {', '.join(valid)}")
        return False

    one_of("algorithm.advantage", cfg.algorithm.advantage, list_advantages(), "advantage estimator")
    one_of("actor.policy_loss", cfg.actor.policy_loss, list_policy_losses(), "policy loss")
    one_of("actor.loss_agg_mode", cfg.actor.loss_agg_mode, LOSS_AGG_MODES, "loss aggregation mode")
    if cfg.critic.enabled:
        one_of("critic.loss_agg_mode", cfg.critic.loss_agg_mode, LOSS_AGG_MODES, "loss aggregation mode")
    one_of("actor.kl_loss.estimator", cfg.actor.kl_loss.estimator, KL_ESTIMATORS, "KL estimator")
    one_of("algorithm.kl_penalty.estimator", cfg.algorithm.kl_penalty.estimator, KL_ESTIMATORS, "KL estimator")
    correction = cfg.algorithm.rollout_correction
    one_of("algorithm.rollout_correction.method", correction.method, ["none", *list_rollout_corrections()],
           "rollout correction")
    if correction.bypass and correction.method != "none":
        p.add("algorithm.rollout_correction.method", correction.method, "with bypass=true the rollout's log-probs "
              "are the old policy, so there is no gap left to correct", "set method=none, or bypass=false")

    from megarl.rewards import BACKENDS, load_reward_function, registered_rewards

    one_of("reward.backend", cfg.reward.backend, BACKENDS, "reward backend")
    specs = {f"reward.functions.{source}": spec for source, spec in cfg.reward.functions.items()}
    if cfg.reward.default is not None:
        specs["reward.default"] = cfg.reward.default
    for key, spec in specs.items():
        if spec in registered_rewards():
            continue
        if ":" not in spec:
            one_of(key, spec, registered_rewards(), "reward function (or write 'package.module:function')")
            continue
        try:
            load_reward_function(spec)
        except ValueError as exc:
            p.add(key, spec, show(str(exc), limit=240).strip('"'), "fix the module path or the function name")


def _reward_model_config(cfg: RunConfig, p: Problems, policy_hf: dict | None) -> dict | None:
    """The reward model's HF config (None if disabled or unusable: each problem reported)."""
    r = cfg.reward_model
    if not r.enabled:
        return None
    if not r.model_path:
        p.add("reward_model.model_path", r.model_path, "reward_model.enabled=true needs the reward model's checkpoint",
              "give an HF *ForSequenceClassification directory with num_labels=1, or set reward_model.enabled=false")
        return None
    try:
        hf = model_hf_config(r.model_path)
    except ValueError as exc:
        p.line(f"reward_model.model_path={show(r.model_path)}: {exc}")
        return None
    from model_specs import classifier_labels

    labels = classifier_labels(hf)
    if labels != 1:
        p.add("reward_model.model_path", r.model_path, f"config.json says architectures={hf.get('architectures')} "
              f"with {labels} label(s); a reward model here is a *ForSequenceClassification model with num_labels=1",
              "export the reward model as such (e.g. AutoModelForSequenceClassification, num_labels=1)")
        return None
    if policy_hf is not None and hf.get("vocab_size") != policy_hf.get("vocab_size"):
        p.add("reward_model.model_path", r.model_path, f"its vocab_size={hf.get('vocab_size')} differs from the "
              f"policy's {policy_hf.get('vocab_size')}: it scores the policy's token ids, so it needs the same tokenizer",
              "use a reward model trained on the policy's tokenizer")
        return None
    return hf


# What megarl.controller.rl.RLTrainer.advantages passes an advantage estimator (registry.ADVANTAGE_INPUTS
# lists what estimators may declare; remax's greedy baseline and PRIME's process rewards are not
# computed by a run).
RUN_ADVANTAGE_INPUTS = ("index", "values", "gamma", "lam", "norm_by_std")


def _algorithm_checks(cfg: RunConfig, p: Problems) -> None:
    """What the advantage estimator needs (a critic, groups, inputs a run computes), and the KL terms'
    reference."""
    from megarl.algorithms import advantage_spec, list_advantages

    adv = cfg.algorithm.advantage
    # what the estimator declared at registration (an unknown name is a registry problem)
    spec = advantage_spec(adv) if adv in list_advantages() else None
    if spec is not None and spec.needs_critic and not cfg.critic.enabled:
        critic_free = [name for name in list_advantages() if not advantage_spec(name).needs_critic]
        p.add("critic.enabled", False, f"algorithm.advantage={adv!r} needs a value model",
              f"set critic.enabled=true, or pick a critic-free estimator ({', '.join(critic_free)})")
    unsupplied = [name for name in spec.inputs if name not in RUN_ADVANTAGE_INPUTS] if spec is not None else []
    if unsupplied:
        usable = [name for name in list_advantages() if set(advantage_spec(name).inputs) <= set(RUN_ADVANTAGE_INPUTS)]
        p.add("algorithm.advantage", adv, f"needs {unsupplied}, which a megarl run does not compute (it supplies "
              f"{list(RUN_ADVANTAGE_INPUTS)})", f"pick one of {usable}, or call megarl.algorithms.advantage_spec("
              f"{adv!r}) from your own training loop")
    if spec is not None and spec.needs_groups and cfg.rollout.n == 1:  # n < 1 is a range problem
        p.add("rollout.n", cfg.rollout.n, f"algorithm.advantage={adv!r} compares the samples of one prompt, and a "
              "group of 1 has no baseline (every advantage is 0)", "use rollout.n >= 2 (e.g. 8)")
    if cfg.algorithm.dynamic_sampling.enabled and cfg.rollout.n == 1:
        p.add("rollout.n", cfg.rollout.n, "algorithm.dynamic_sampling drops groups whose samples all score the same, "
              "so groups of 1 are always dropped", "use rollout.n >= 2, or disable dynamic sampling")
    if cfg.algorithm.dynamic_sampling.enabled and cfg.rollout.mode != "sync":
        p.add("algorithm.dynamic_sampling.enabled", True, f"dynamic sampling is not implemented with generation ahead "
              f"of training (rollout.mode={cfg.rollout.mode})", "use rollout.mode=sync, or disable dynamic sampling")
    needs_ref = [k for k, on in (("actor.kl_loss.enabled", cfg.actor.kl_loss.enabled),
                                 ("algorithm.kl_penalty.enabled", cfg.algorithm.kl_penalty.enabled)) if on]
    if needs_ref and not cfg.ref.enabled:
        p.add("ref.enabled", False, f"{' and '.join(needs_ref)} need the reference policy",
              "set ref.enabled=true, or turn the KL term off")


def _cross_checks(cfg: RunConfig, p: Problems, hf_config: dict | None, rl: bool) -> None:
    if cfg.model.dtype == "float16":
        p.add("model.dtype", "float16", "the actor would train in fp16, which needs loss scaling that megarl does "
              "not configure (megatron's fp16 optimizer skips every step at its initial scale)",
              "use bfloat16 (same memory, no loss scaling) or float32")
    if rl:
        _algorithm_checks(cfg, p)
    if cfg.actor.shared_prompts:
        for obstacle in cfg.shared_prompt_obstacles:
            p.add("actor.shared_prompts", True, obstacle, "set actor.shared_prompts=false (or null: on where possible)")
    if cfg.actor.routing_replay:
        from model_specs import num_experts

        if hf_config is not None and not num_experts(hf_config):
            p.add("actor.routing_replay", True, f"model {cfg.model.path} is not a Mixture-of-Experts model "
                  "(it has no routers to replay)", "set actor.routing_replay=false")
        if cfg.rollout.multi_turn.enabled:
            p.add("actor.routing_replay", True, "multi-turn trajectories are not recorded with their routes yet",
                  "set actor.routing_replay=false, or rollout.multi_turn.enabled=false")
    if cfg.actor.moe_token_dispatcher == "alltoall" and cfg.cluster.device == "cpu" and hf_config is not None:
        from model_specs import num_experts

        if num_experts(hf_config):
            p.add("actor.moe_token_dispatcher", "alltoall", "megatron-core 0.16's alltoall dispatcher does not run on "
                  "CPU ranks (it hands gloo's all_to_all_single split sizes that gloo refuses: docs/cpu.md)",
                  "use auto or allgather on CPU (cluster.gpus_per_node=0)")
    if hf_config is not None:
        positions = hf_config.get("max_position_embeddings")
        total = cfg.data.max_prompt_length + cfg.max_response_length
        if positions and total > positions and cfg.actor.policy_loss == "sft":  # RunConfig.for_sft
            p.add("sft.max_length", cfg.sft.max_length, f"exceeds the model's max_position_embeddings={positions}",
                  f"use at most {positions}")
        elif positions and total > positions:
            p.add(_response_key(cfg), cfg.max_response_length,
                  f"data.max_prompt_length={cfg.data.max_prompt_length} + {_response_key(cfg).split('.', 1)[1]} = "
                  f"{total} exceeds the "
                  f"model's max_position_embeddings={positions}",
                  f"make the two sum to at most {positions}")
        vocab = hf_config.get("vocab_size")
        for i, tok in enumerate(cfg.rollout.stop_token_ids):
            if vocab and not 0 <= tok < vocab:
                p.add(f"rollout.stop_token_ids[{i}]", tok, f"is not a token id of the model (vocab_size={vocab})",
                      f"use an id in [0, {vocab})")


def _file_checks(cfg: RunConfig, p: Problems) -> None:
    for i, f in enumerate(cfg.data.train_files):
        path = Path(f).expanduser()
        if not path.is_file():
            where = "" if path.is_absolute() else f" (relative to the working directory {Path.cwd()})"
            p.add(f"data.train_files[{i}]", f, f"the file does not exist{where}",
                  "fix the path, or write it with tools/prepare_data.py")
    resume = cfg.trainer.resume
    if resume not in ("auto", "none") and not Path(resume).expanduser().exists():
        p.add("trainer.resume", resume, "is neither auto, none nor an existing checkpoint path",
              "use auto (latest checkpoint in trainer.output_dir), none, or an existing path")


def _sft_checks(cfg: RunConfig, p: Problems) -> None:
    """``megarl sft`` trains the actor alone: models of the RL roles would be built for nothing."""
    for key, on in (("critic.enabled", cfg.critic.enabled), ("ref.enabled", cfg.ref.enabled),
                    ("reward_model.enabled", cfg.reward_model.enabled), ("actor.kl_loss.enabled", cfg.actor.kl_loss.enabled),
                    ("algorithm.kl_penalty.enabled", cfg.algorithm.kl_penalty.enabled)):
        if on:
            p.add(key, True, "megarl sft trains the actor alone on the conversations", f"set {key}=false")


def validate_config(cfg: RunConfig, *, check_files: bool = True, mode: str = "rl") -> None:
    """Raise ConfigError (every problem, one line each) if the run cannot work as configured;
    ``mode="sft"``: as ``megarl sft`` runs it (``RunConfig.for_sft``)."""
    if mode not in ("rl", "sft"):
        raise ValueError(f"mode must be 'rl' or 'sft', got {mode!r}")
    p = Problems()
    for i, module in enumerate(cfg.imports):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
            p.add(f"imports[{i}]", module, f"cannot be imported ({type(exc).__name__}: {exc})",
                  "check the module name and that it is installed or on PYTHONPATH")

    hf_config = None
    try:
        hf_config = model_hf_config(cfg.model.path)
    except ValueError as exc:
        p.line(f"model.path={show(cfg.model.path)}: {exc}")
    if hf_config is not None:
        from model_specs import UnsupportedModelError, family_for

        try:
            family_for(hf_config)
        except UnsupportedModelError as exc:
            p.add("model.path", cfg.model.path, str(exc), "use a model of a supported family")
            hf_config = None
    critic_hf = hf_config
    if cfg.critic.enabled and cfg.critic.model_path:
        try:
            critic_hf = model_hf_config(cfg.critic.model_path)
        except ValueError as exc:
            p.line(f"critic.model_path={show(cfg.critic.model_path)}: {exc}")
            critic_hf = None

    reward_hf = _reward_model_config(cfg, p, hf_config)
    if mode == "sft":
        _sft_checks(cfg, p)
        cfg = cfg.for_sft()

    p.lines.extend(field_problems(cfg))  # each field's own bounds (megarl.config.schema)
    _bound_checks(cfg, p)
    _registry_checks(cfg, p)
    # Sizes are only worth cross-checking once each of them is sane on its own.
    if not any(line.startswith(_SIZE_KEYS) for line in p.lines):
        resource_checks(cfg, p, hf_config, critic_hf, reward_hf)
    _cross_checks(cfg, p, hf_config, rl=mode == "rl")
    not_implemented_checks(cfg, p)
    _multi_turn_checks(cfg, p)
    if check_files:
        _file_checks(cfg, p)
    if p.lines:
        raise ConfigError(p.lines)
