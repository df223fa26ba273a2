"""The typed configuration of one RL run: one dataclass per section, defaults for a tiny CPU run.

``RunConfig()`` with ``data.train_files`` set is a valid GRPO run of the ``tiny-qwen2`` preset
on one CPU rank. Every field is a plain value (int, float, bool, str, a list, a mapping, or a
nested section), so the whole tree round-trips through YAML. Names a registry decides
(advantage estimator, policy loss, loss aggregation mode, KL estimator, reward function) are
strings here and are checked against their registries by ``megarl.config.validate``.

The sections are pydantic dataclasses (still ``dataclasses``: ``fields``/``asdict``/``replace``
work), except the Megatron layouts: those are ``parallel.layout.MegatronLayout``, the frozen
dataclass the code itself takes, validated by pydantic like the rest (``Layout``). Pydantic
converts YAML values into them, strictly enough to refuse the classic mistakes (``"1e-6"`` for a
number, ``1`` for a boolean, an unknown key): see ``Int``/``Float``/``Bool``.
Each field's own bounds are declared on the field with ``bounded(...)``, together with the
problem and fix of its one-line error (``megarl.config.errors.problems_of``); checks that involve
several fields live in ``megarl.config.validate``.

Roles and resources: the cluster is ``nodes x ranks_per_node`` ranks (GPUs, or gloo processes
on CPU), cut into named resource pools (``cluster.pools``; none = one pool ``"global"`` with
every rank). The actor runs on ``actor.pool``; the reference and critic default to the actor's
pool and layout; the rollout engines share the actor's pool (``placement: colocated``, the
hybrid engine) or run on their own (``placement: separate`` with ``rollout.pool``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, Strict, StrictBool, model_validator
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

from parallel.layout import MegatronLayout

DEFAULT_POOL = "global"


def _integral_float_as_int(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _one_item_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value  # a single file name for a list of files


# The value types of config fields: no strings for numbers, no 0/1 for booleans; an int is a
# fine float and an integral float (``1e3``) a fine int.
Int = Annotated[int, Strict(), BeforeValidator(_integral_float_as_int)]
Float = Annotated[float, Strict()]
Bool = StrictBool


def bounded(default: Any = ..., *, problem: str | None = None, fix: str, **constraints: Any) -> Any:
    """A field's default with its own bounds (pydantic's ``gt``/``ge``/``lt``/``le``/``min_length``/
    ``pattern``/``default_factory``) and the ``problem; fix`` of the error when a value breaks them
    (``problem`` defaults to the bounds, e.g. "must be >= 1")."""
    extra = {"fix": fix} if problem is None else {"problem": problem, "fix": fix}
    if default is not ...:
        constraints["default"] = default
    return Field(json_schema_extra=extra, **constraints)


def _off_or_positive(value: int) -> int:
    if value != -1 and value < 1:
        raise PydanticCustomError("out_of_range", "must be -1 (off) or >= 1")
    return value


@dataclass(config=ConfigDict(extra="forbid"))
class _Section:
    """Base of the sections: unknown keys are refused; ``section: null`` (or an empty YAML block)
    is the section's default."""

    @model_validator(mode="before")
    @classmethod
    def _null_section_is_its_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.__pydantic_fields__
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and dataclasses.is_dataclass(fields[k].annotation))}


@dataclass
class ModelConfig(_Section):
    """The policy model."""

    # A local HF model directory (with config.json), or a preset name from
    # model_specs/presets.py (tiny test models, and real shapes for planning and dry runs).
    path: str = "tiny-qwen2"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Tokenizer directory; None = the tokenizer saved with model.path (for a preset model the
    # trainer builds its local test tokenizer).
    tokenizer: str | None = None


_LAYOUT_INTS = frozenset(name for name, tp in typing.get_type_hints(MegatronLayout).items() if tp in (int, int | None))


def _integral_floats_as_ints(value: Any) -> Any:
    """A layout mapping with its integer fields' integral floats as ints, as ``Int`` takes them."""
    if not isinstance(value, dict):
        return value
    return {k: _integral_float_as_int(v) if k in _LAYOUT_INTS else v for k, v in value.items()}


# A Megatron layout: ``parallel.layout.MegatronLayout`` itself, the type the code uses (strict
# fields and unknown keys refused: its ``__pydantic_config__`` and field metadata); DP is what the
# pool leaves over. A section of the config like the others, but not a pydantic dataclass.
Layout = Annotated[MegatronLayout, BeforeValidator(_integral_floats_as_ints)]


_Beta = Annotated[Float, Field(ge=0, lt=1)]


@dataclass
class OptimSettings(_Section):
    """Adam with gradient clipping and a learning-rate schedule, for one trainable model: what
    ``megarl.training.build_optimizer`` takes (its ``AdamSettings``) and the schedule the worker
    applies (``megarl.workers.megatron_worker.learning_rate``)."""

    lr: Float = bounded(1e-6, gt=0, problem="the learning rate must be > 0", fix="set a positive value such as 1e-6")
    betas: tuple[_Beta, _Beta] = bounded((0.9, 0.999), problem="Adam betas must be in [0, 1)",
                                          fix="use e.g. [0.9, 0.999]")
    eps: Float = bounded(1e-8, gt=0, fix="use e.g. 1e-8")
    weight_decay: Float = bounded(0.01, ge=0, fix="use 0.0 or e.g. 0.01")
    # max global grad norm
    clip_grad: Float = bounded(1.0, ge=0, problem="must be >= 0 (0 turns clipping off)", fix="use e.g. 1.0")
    lr_warmup_steps: Int = bounded(0, ge=0, fix="use 0 for none")  # optimizer steps of linear warm-up from 0
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warm-up, towards min_lr
    min_lr: Float = 0.0  # in [0, lr] (two fields: validate)


@dataclass
class KLLossConfig(_Section):
    """KL to the reference as a loss term (GRPO): ``loss += coef * agg(kl_t)``."""

    enabled: Bool = False
    coef: Float = bounded(0.001, ge=0, fix="use e.g. 0.001")
    estimator: str = "k3"  # megarl.algorithms.kl.KL_ESTIMATORS
    clamp: Float | None = bounded(10.0, gt=0, fix="use 10.0 or null")  # bound on |log ratio| before estimating; null = none


@dataclass
class ActorConfig(_Section):
    """The trained policy: where it runs, how it is split and optimised, and its loss."""

    pool: str = DEFAULT_POOL
    layout: Layout = field(default_factory=MegatronLayout)
    optim: OptimSettings = field(default_factory=OptimSettings)
    # Samples per micro-batch; ignored when max_tokens_per_micro_batch is set (token-budget
    # micro-batches, balanced over data-parallel ranks).
    micro_batch_size: Int = bounded(1, ge=1, fix="use e.g. 1")
    max_tokens_per_micro_batch: Int | None = None  # >= a full sequence: validate
    # Pack each micro-batch's sequences into one row (thd, no padding between them) for every
    # Megatron model of the run (actor, reference, critic); false = right-padded rows.
    sequence_packing: Bool = False
    # Compute each prompt once for all its rollout.n samples, for every Megatron model of the run:
    # one row per prompt holding the prompt and each sample's response as a branch that attends
    # to the prompt and itself (exact: parallel/modules/shared_prefix.py). Fewer tokens through the model
    # (the prompt x (n-1) per prompt) and fewer attention scores than a row per sample. null (the
    # default) = on whenever rollout.n > 1 and nothing rules it out: sequence_packing and context
    # parallelism (any role's) are other row layouts; true there is an error.
    shared_prompts: Bool | None = None
    # Prompts per optimizer step (each with rollout.n samples); null = data.batch_size (one
    # optimizer step per epoch over the batch).
    mini_batch_size: Int | None = bounded(None, ge=1, fix="use null for the whole batch")  # divides data.batch_size
    ppo_epochs: Int = bounded(1, ge=1, fix="use 1")
    policy_loss: str = "ppo"  # megarl.algorithms registry
    loss_agg_mode: str = "token-mean"  # megarl.algorithms.aggregation.LOSS_AGG_MODES
    clip_ratio_low: Float = bounded(0.2, ge=0, lt=1, fix="use 0.2 (PPO) or 3e-4 (GSPO)")
    # null = clip_ratio_low; > low is DAPO's clip-higher
    clip_ratio_high: Float | None = bounded(None, ge=0, fix="use null (= clip_ratio_low) or e.g. 0.28 (DAPO clip-higher)")
    # dual-clip bound (typically 3); ppo only (validate); null = off
    clip_ratio_c: Float | None = bounded(None, gt=1, problem="the dual-clip bound must be > 1",
                                         fix="use 3.0, or null to turn dual-clip off")
    entropy_coef: Float = bounded(0.0, ge=0, fix="use 0.0 or e.g. 0.001")
    kl_loss: KLLossConfig = field(default_factory=KLLossConfig)
    # Rollout routing replay (MoE models): the engines record the experts they routed every token
    # to in every layer, and the actor's routers use those experts in its log-prob recomputation
    # and its update instead of their own top-k (parallel/modules/routing_replay.py), so that the
    # trainer computes the probabilities of the computation that sampled the tokens.
    routing_replay: Bool = False
    # How megatron trains every Megatron model of the run (actor, critic; the frozen ones run
    # forward only). The MoE token dispatcher: "alltoall" sends each token to the ranks of its
    # experts only, "allgather" gathers every token on every rank of the TP x EP group (the one
    # gloo runs: docs/cpu.md); "auto" = alltoall on GPUs, allgather on CPU.
    moe_token_dispatcher: Literal["auto", "allgather", "alltoall"] = "auto"
    # Activation recompute: none | selective (megatron's core-attention recompute) | full (each
    # layer keeps its input only and is run again in the backward: the least activation memory).
    recompute: Literal["none", "selective", "full"] = "none"
    # Start each gradient bucket's data-parallel reduction during the backward (megatron DDP's
    # overlap_grad_reduce); null = on for GPUs, off on CPU.
    overlap_grad_reduce: Bool | None = None


@dataclass
class CriticConfig(_Section):
    """The value model (PPO with GAE); same shape as the actor's training settings."""

    enabled: Bool = False
    model_path: str | None = None  # null = initialised from model.path
    pool: str | None = None  # null = actor.pool
    layout: Layout | None = None  # null = actor.layout
    optim: OptimSettings = field(default_factory=lambda: OptimSettings(lr=1e-5))
    micro_batch_size: Int = bounded(1, ge=1, fix="use e.g. 1")
    max_tokens_per_micro_batch: Int | None = None
    mini_batch_size: Int | None = bounded(None, ge=1, fix="use null for the whole batch")
    ppo_epochs: Int = bounded(1, ge=1, fix="use 1")
    # PPO value clipping range; null = unclipped
    value_clip: Float | None = bounded(0.5, ge=0, fix="use e.g. 0.5, or null for an unclipped value loss")
    loss_agg_mode: str = "token-mean"


@dataclass
class RefConfig(_Section):
    """The frozen reference policy (needed by a KL loss or a KL reward penalty)."""

    enabled: Bool = False
    pool: str | None = None  # null = actor.pool
    layout: Layout | None = None  # null = actor.layout
    micro_batch_size: Int = bounded(1, ge=1, fix="use e.g. 1")  # forward-only micro-batches


@dataclass
class RewardModelConfig(_Section):
    """A learned reward model: an HF ``*ForSequenceClassification`` checkpoint with one label
    (``score.weight``), run frozen by Megatron workers; a sample's score is its output at the last
    response token. When enabled it replaces the reward functions."""

    enabled: Bool = False
    model_path: str | None = None  # required when enabled; same tokenizer (vocabulary) as the policy
    pool: str | None = None  # null = actor.pool
    layout: Layout | None = None  # null = actor.layout
    micro_batch_size: Int = bounded(1, ge=1, fix="use e.g. 1")  # forward-only micro-batches


@dataclass
class MultiTurnConfig(_Section):
    """Multi-turn rollouts with tool calls (``megarl.agent``): the policy writes a turn, its tool
    calls run, their outputs are appended (tokenised once, loss mask 0), and it writes the next
    turn, until it calls no tool or a limit is reached. ``rollout.max_new_tokens`` bounds each turn."""

    enabled: Bool = False
    max_turns: Int = bounded(4, ge=1, fix="use e.g. 4")  # assistant turns per trajectory
    # all tokens after the prompt (every turn and tool output); the training rows' response length
    max_total_tokens: Int = bounded(256, ge=1, fix="use e.g. 1024")
    tools: list[str] = field(default_factory=lambda: ["python"])  # calculator, python, or module:function
    tool_format: str = "hermes"  # how the model writes calls: megarl.agent.TOOL_CALL_FORMATS
    tool_timeout_s: Float = bounded(10.0, gt=0, fix="use e.g. 10")
    tool_memory_mb: Int = bounded(1024, ge=16, fix="use e.g. 1024")
    tool_max_output_chars: Int = bounded(2000, ge=16, fix="use e.g. 2000")


@dataclass
class RolloutConfig(_Section):
    """Generation: the engine, its tensor parallelism and placement, and sampling parameters."""

    placement: Literal["colocated", "separate"] = "colocated"
    pool: str | None = None  # the rollout's own pool when placement is separate
    tp: Int = bounded(1, ge=1, fix="use 1 or a divisor of the model's heads")
    # SGLang's expert parallelism inside each engine's TP group (MoE models): ep blocks of tp/ep ranks,
    # each holding num_experts/ep whole experts
    ep: Int = bounded(1, ge=1, fix="use 1, or a divisor of rollout.tp and of the model's experts")
    # samples per prompt (the group size of group-based estimators)
    n: Int = bounded(4, ge=1, problem="samples per prompt must be >= 1", fix="use e.g. 8 for GRPO, 1 for PPO")
    temperature: Float = bounded(1.0, ge=0, problem="must be >= 0 (0 = greedy)", fix="use e.g. 1.0")
    top_p: Float = bounded(1.0, gt=0, le=1, fix="use 1.0 to turn it off")
    top_k: Annotated[Int, AfterValidator(_off_or_positive)] = bounded(-1, problem="must be -1 (off) or >= 1", fix="use -1")
    max_new_tokens: Int = bounded(32, ge=1, fix="use e.g. 256")
    stop_token_ids: list[Int] = field(default_factory=list)
    ignore_eos: Bool = False  # true: every response is max_new_tokens long (benchmarks)
    # sync: generate, then train on it; one_step_off: the next step's batch is generated (with the
    # weights before this step's update) while this step trains, so each batch is one version old;
    # streaming: batches are generated as far ahead as max_staleness allows (megarl.rollout.stream).
    # The last two need engines on a pool of their own (rollout.placement=separate).
    mode: Literal["sync", "one_step_off", "streaming"] = "sync"
    # streaming: the most updates a batch's generating weights may lag the weights trained on it
    # (0: the synchronous loop's batches; one_step_off is 1)
    max_staleness: Int = bounded(1, ge=0, fix="use e.g. 1 or 2 (0: no generation ahead of training)")
    # partial rollouts (one_step_off, streaming): > 0 generates a batch in chunks of this many new
    # tokens, the engines taking weights published meanwhile between chunks, so a sample's later
    # tokens may come from newer weights than its first (each token's version is counted); 0: whole batches
    partial_rollout_tokens: Int = bounded(0, ge=0, fix="use 0 (off) or e.g. 64")
    # an engine that dies during generation is restarted, resynced and asked again, this often per step
    max_engine_restarts: Int = bounded(2, ge=0, fix="use e.g. 2 (0: a dead engine stops the run)")
    # SGLang's static memory fraction (weights + KV cache)
    mem_fraction_static: Float = bounded(0.5, gt=0, lt=1, fix="use e.g. 0.5 when colocated, 0.85 on a separate pool")
    # the longest an engine may take to start, and to answer one call (a generation, a weight sync);
    # null = derived from the model's parameters and max_new_tokens (docs/rollout.md)
    startup_timeout_s: Float | None = bounded(None, gt=0, fix="use null (derived from the model) or e.g. 1200")
    call_timeout_s: Float | None = bounded(None, gt=0, fix="use null (derived from the model and max_new_tokens) "
                                                           "or e.g. 1800")
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)

    @property
    def staleness(self) -> int:
        """The most updates a batch's generating weights lag the trained ones, by mode."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)


@dataclass
class KLPenaltyConfig(_Section):
    """KL to the reference as a per-token reward penalty (PPO-RLHF): ``r_t -= beta * kl_t``."""

    enabled: Bool = False
    estimator: str = "k1"
    coef: Float = bounded(0.001, ge=0, fix="use e.g. 0.001")  # beta (the initial beta with the adaptive controller)
    controller: Literal["fixed", "adaptive"] = "fixed"
    # adaptive: target KL per token
    target: Float = bounded(0.1, gt=0, problem="the target KL must be > 0", fix="use e.g. 0.1")
    # adaptive: samples over which beta moves by at most 20%
    horizon: Int = bounded(10000, ge=1, fix="use e.g. 10000")


@dataclass
class RolloutCorrectionConfig(_Section):
    """Importance weights for the gap between the policy that sampled (the engine's log-probs) and
    the one the update starts from (the actor's recomputed log-probs): ``megarl.algorithms.
    rollout_correction``. The gap's metrics (``actor/mismatch/*``) are logged whatever the method."""

    method: str = "none"  # none, or a registered correction: tis, seq_tis, mis, seq_mis, icepop
    low: Float = bounded(0.5, gt=0, lt=1, fix="use e.g. 0.5")  # icepop's lower bound; the metrics' too
    high: Float = bounded(2.0, gt=1, fix="use e.g. 2.0")  # the truncation / mask bound
    # true: the rollout's log-probs are the old policy (no recomputation by the actor; PPO's
    # ratio then includes the train/rollout mismatch itself); a method has nothing to correct then
    bypass: Bool = False


@dataclass
class DynamicSamplingConfig(_Section):
    """DAPO: drop prompts whose samples all score the same; regenerate until the batch is full."""

    enabled: Bool = False
    # generation rounds per step before giving up filling the batch
    max_rounds: Int = bounded(10, ge=1, fix="use e.g. 10")


@dataclass
class OverlongPenaltyConfig(_Section):
    """DAPO's soft overlong punishment, falling from 0 to -penalty_factor over the buffer."""

    enabled: Bool = False
    # null = 20% of rollout.max_new_tokens (DAPO: 4096 of 20480); in [1, rollout.max_new_tokens] (validate)
    buffer_len: Int | None = None
    penalty_factor: Float = bounded(1.0, ge=0, fix="use 1.0")


@dataclass
class AlgorithmConfig(_Section):
    """How rewards become advantages."""

    advantage: str = "grpo"  # megarl.algorithms registry
    gamma: Float = bounded(1.0, ge=0, le=1, fix="use 1.0 for LLM RL")
    lam: Float = bounded(1.0, ge=0, le=1, fix="use 0.95 (PPO) or 1.0")
    norm_adv_by_std: Bool = True  # GRPO's std division (Dr.GRPO turns it off)
    kl_penalty: KLPenaltyConfig = field(default_factory=KLPenaltyConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong_penalty: OverlongPenaltyConfig = field(default_factory=OverlongPenaltyConfig)


_PromptFiles = Annotated[list[Annotated[str, Field(pattern=r"\.(parquet|jsonl)$")]], BeforeValidator(_one_item_list)]


def _prompt_files() -> Any:
    return bounded(default_factory=list, problem="prompt files must be .parquet or .jsonl",
                   fix="convert it with tools/prepare_data.py")


@dataclass
class DataConfig(_Section):
    """Prompt files and how rows become prompts (``megarl.data.PromptDataset``)."""

    train_files: _PromptFiles = _prompt_files()  # at least one for a run: validate
    prompt_key: str = bounded("prompt", min_length=1, problem="must not be empty", fix="use \"prompt\"")
    ground_truth_key: str | None = "reward_model.ground_truth"
    data_source_key: str = "data_source"
    default_data_source: str | None = None
    extra_info_key: str | None = "extra_info"
    batch_size: Int = bounded(4, ge=1, problem="prompts per step must be >= 1", fix="use e.g. 8")  # prompts per RL step
    max_prompt_length: Int = bounded(64, ge=1, fix="use e.g. 512")  # longer prompts are dropped
    shuffle: Bool = True
    seed: Int = 0
    chat_template: str | None = None  # replaces the tokenizer's own
    # str.format template with {prompt}, instead of a chat template
    prompt_template: str | None = bounded(None, pattern=r"\{prompt\}", problem="must contain the {prompt} placeholder",
                                          fix="write e.g. \"Q: {prompt}\\nA:\"")


@dataclass
class SFTConfig(_Section):
    """Supervised fine-tuning on chat conversations (``megarl sft``): rows of ``data.train_files``
    hold a list of messages, rendered with the chat template; the loss is on assistant tokens."""

    messages_key: str = bounded("messages", min_length=1, problem="must not be empty", fix="use \"messages\"")
    tools_key: str | None = None  # a row field with tool schemas the template shows (Qwen/Hermes); null = none
    # longer conversations are dropped (counted and logged)
    max_length: Int = bounded(1024, ge=2, fix="use e.g. 2048")


@dataclass
class RewardConfig(_Section):
    """Which function scores each data source (``megarl.rewards``)."""

    # data source -> a registered reward name or "package.module:function" / "file.py:function";
    # data sources not listed use the reward registered for them, else `default`.
    functions: dict[str, str] = field(default_factory=dict)
    default: str | None = None
    timeout_s: Float = bounded(10.0, gt=0, problem="must be > 0 seconds", fix="use e.g. 10")
    backend: str = "auto"  # megarl.rewards.BACKENDS
    num_workers: Int = bounded(2, ge=1, fix="use e.g. 2")


@dataclass
class TrainerConfig(_Section):
    """The run: length, checkpoints, resume, logging."""

    total_steps: Int = bounded(20, ge=1, fix="use e.g. 100")
    # RL steps between checkpoints; 0 = only at the end
    save_every: Int = bounded(0, ge=0, problem="must be >= 0 (0 = only at the end)", fix="use e.g. 50")
    keep_last: Int = bounded(2, ge=1, fix="use e.g. 2")  # checkpoints kept
    # every checkpoint file's checksum is recorded at save and checked before a resume (reads the
    # checkpoint once more each time); false: sizes only
    checkpoint_checksums: Bool = True
    # the longest a phase (a model setup, forward, update or sync call on every rank) may take before
    # the run stops naming the ranks that did not finish (a hang) instead of waiting forever
    phase_timeout_s: Float = bounded(3600.0, gt=0, fix="use e.g. 3600 (raise it for very long steps)")
    # auto (latest in output_dir, if any) | none | a checkpoint path
    resume: str = bounded("auto", min_length=1, problem="must not be empty", fix="use auto, none or a checkpoint path")
    output_dir: str = bounded("runs/quickstart", min_length=1, problem="must not be empty", fix="use e.g. runs/my_run")
    seed: Int = bounded(1234, ge=0, fix="use e.g. 1234")
    loggers: list[Literal["console", "tensorboard"]] = field(default_factory=lambda: ["console", "tensorboard"])
    log_every: Int = bounded(1, ge=1, fix="use 1")
    # Every N steps, write that step's samples (token ids, text, score) to rollouts/step_<k>.jsonl; 0 = never.
    save_rollouts_every: Int = bounded(0, ge=0, problem="must be >= 0 (0 = never)", fix="use 0, or e.g. 10")


@dataclass
class ClusterConfig(_Section):
    """Ranks: ``nodes x gpus_per_node`` GPUs, or ``nodes x cpu_ranks_per_node`` gloo processes."""

    nodes: Int = bounded(1, ge=1, fix="use 1")
    # > 0: a GPU cluster, one rank per GPU; 0: CPU ranks
    gpus_per_node: Int = bounded(0, ge=0, problem="must be >= 0 (0 = CPU ranks)", fix="use 8 on a GPU node or 0 on CPU")
    cpu_ranks_per_node: Int = 1  # ranks per node when gpus_per_node is 0 (>= 1 then: validate)
    # Resource pools: name -> ranks (a pool larger than a node spans whole nodes). Empty = one
    # pool "global" with every rank.
    pools: dict[str, Int] = field(default_factory=dict)
    # Memory of one GPU in GiB, the budget `megarl plan` checks each rank against: 80 for an H100
    # (configs/cluster/h100.yaml), 141 for an H200 (configs/cluster/h200.yaml).
    gpu_memory_gib: Float = bounded(80.0, gt=0, problem="the memory of a GPU must be > 0 GiB",
                                    fix="use 80 (H100) or 141 (H200)")

    @property
    def device(self) -> str:
        return "gpu" if self.gpus_per_node > 0 else "cpu"

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node if self.gpus_per_node > 0 else self.cpu_ranks_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def pool_sizes(self) -> dict[str, int]:
        """Pool name -> ranks, with the implicit ``"global"`` pool when none are declared."""
        return dict(self.pools) if self.pools else {DEFAULT_POOL: self.world_size}


MEGATRON_ROLES = ("actor", "critic", "ref", "reward_model")  # the roles Megatron models play
TRAINED_ROLES = ("actor", "critic")  # with an optimizer; the others are forward-only
VALUE_ROLES = ("critic", "reward_model")  # a scalar (value) head instead of the LM head
ROLES = MEGATRON_ROLES + ("rollout",)


@dataclass
class RunConfig(_Section):
    """One RL run, top to bottom. ``megarl.config.load_config`` builds and validates one."""

    # Modules imported before validation (they may register advantages, policy losses, rewards),
    # and in every Megatron worker (a policy loss runs there).
    imports: Annotated[list[str], BeforeValidator(_one_item_list)] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def pool_for(self, role: str) -> str:
        """The resource pool a role (one of ``ROLES``) runs on."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles: {list(ROLES)}")
        if role == "actor":
            return self.actor.pool
        if role == "rollout":
            return self.rollout.pool if self.rollout.placement == "separate" and self.rollout.pool else self.actor.pool
        own = getattr(self, role).pool
        return self.actor.pool if own is None else own

    def layout_for(self, role: str) -> MegatronLayout:
        """The Megatron layout of a trained or forward-only role ("actor", "critic", "ref", "reward_model")."""
        if role not in MEGATRON_ROLES:
            raise ValueError(f"role {role!r} has no Megatron layout; roles with one: actor, critic, ref, reward_model")
        own = getattr(self, role).layout
        return self.actor.layout if own is None else own

    @property
    def needs_reference(self) -> bool:
        """A reference model runs: asked for, or needed by a KL loss term or KL reward penalty."""
        return self.ref.enabled or self.actor.kl_loss.enabled or self.algorithm.kl_penalty.enabled

    @property
    def shared_prompt_rows(self) -> bool:
        """Whether the Megatron models get shared-prompt rows: ``actor.shared_prompts``, or when
        it is null, ``rollout.n > 1`` and nothing stands in their way."""
        if self.actor.shared_prompts is not None:
            return self.actor.shared_prompts
        return self.rollout.n > 1 and not self.shared_prompt_obstacles

    @property
    def shared_prompt_obstacles(self) -> list[str]:
        """Why shared-prompt rows cannot be used (empty: they can): sequence packing, or context
        parallelism in any Megatron role."""
        obstacles = ["shared-prompt rows and sequence_packing are two different row layouts"
                     ] if self.actor.sequence_packing else []
        return obstacles + [f"shared-prompt rows need context parallelism 1, but the {role}'s layout has "
                            f"cp={self.layout_for(role).cp} (its attention builds its own causal mask)"
                            for role in self.megatron_roles if self.layout_for(role).cp > 1]

    @property
    def moe_token_dispatcher(self) -> str:
        """megatron's MoE token dispatcher: ``actor.moe_token_dispatcher``, "auto" resolved by
        device (alltoall on GPUs, allgather on CPU)."""
        choice = self.actor.moe_token_dispatcher
        if choice != "auto":
            return choice
        return "alltoall" if self.cluster.device == "gpu" else "allgather"

    @property
    def overlap_grad_reduce(self) -> bool:
        """``actor.overlap_grad_reduce``, null resolved by device (on for GPUs, off on CPU)."""
        own = self.actor.overlap_grad_reduce
        return self.cluster.device == "gpu" if own is None else own

    @property
    def megatron_roles(self) -> list[str]:
        """The Megatron models a run builds, in setup order."""
        return (["actor"] + (["ref"] if self.needs_reference else []) + (["critic"] if self.critic.enabled else [])
                + (["reward_model"] if self.reward_model.enabled else []))

    def megatron_pools(self) -> dict[str, list[str]]:
        """Resource pool -> the Megatron roles its ranks run (one torch.distributed group per pool,
        roles in setup order); the actor's pool first."""
        pools: dict[str, list[str]] = {}
        for role in self.megatron_roles:
            pools.setdefault(self.pool_for(role), []).append(role)
        return pools

    def world_size_for(self, role: str) -> int:
        """Ranks in the role's pool (KeyError if the pool is not declared)."""
        return self.cluster.pool_sizes()[self.pool_for(role)]

    @property
    def max_response_length(self) -> int:
        """The most tokens after a prompt: ``rollout.max_new_tokens``, or with multi-turn rollouts
        ``rollout.multi_turn.max_total_tokens`` (every turn and tool output)."""
        multi = self.rollout.multi_turn
        return multi.max_total_tokens if multi.enabled else self.rollout.max_new_tokens

    def for_sft(self) -> "RunConfig":
        """This config as ``megarl sft`` trains it: one row per conversation (``rollout.n=1``, no
        shared-prompt rows), a conversation's first token as its "prompt" and the rest as its
        "response" (``sft.max_length`` tokens in all), and the ``sft`` loss (the masked negative
        log-likelihood). The other RL settings are not read."""
        actor = dataclasses.replace(self.actor, shared_prompts=False, policy_loss="sft", ppo_epochs=1,
                                    mini_batch_size=None)
        rollout = dataclasses.replace(self.rollout, n=1, max_new_tokens=self.sft.max_length - 1,
                                      multi_turn=dataclasses.replace(self.rollout.multi_turn, enabled=False))
        data = dataclasses.replace(self.data, max_prompt_length=1)
        return dataclasses.replace(self, actor=actor, rollout=rollout, data=data)

    def effective_overlong_buffer(self) -> int:
        buf = self.algorithm.overlong_penalty.buffer_len
        return max(1, self.rollout.max_new_tokens // 5) if buf is None else buf
