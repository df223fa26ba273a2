"""The typed configuration of one RL run: one dataclass per section, defaults for a tiny CPU run.

``RunConfig()`` with ``data.train_files`` set is a valid GRPO run of the ``tiny-qwen2`` preset
on one CPU rank. Every field is a plain value (int, float, bool, str, a list, a mapping, or a
nested section), so the whole tree round-trips through YAML. Names a registry decides
(advantage estimator, policy loss, loss aggregation mode, KL estimator, reward function) are
strings here and are checked against their registries by ``megarl.config.validate``.

Roles and resources: the cluster is ``nodes x ranks_per_node`` ranks (GPUs, or gloo processes
on CPU), cut into named resource pools (``cluster.pools``; none = one pool ``"global"`` with
every rank). The actor runs on ``actor.pool``; the reference and critic default to the actor's
pool and layout; the rollout engines share the actor's pool (``placement: colocated``, the
hybrid engine) or run on their own (``placement: separate`` with ``rollout.pool``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

DEFAULT_POOL = "global"


@dataclass
class ModelConfig:
    """The policy model."""

    # A local HF model directory (with config.json), or a preset name from
    # model_specs/presets.py (tiny test models, and real shapes for planning and dry runs).
    path: str = "tiny-qwen2"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Tokenizer directory; None = the tokenizer saved with model.path (for a preset model the
    # trainer builds its local test tokenizer).
    tokenizer: str | None = None


@dataclass
class LayoutConfig:
    """A Megatron layout (``parallel.layout.MegatronLayout``); DP is what the pool leaves over."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline chunks per stage (interleaved 1F1B); null = off
    cp: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False

    def __str__(self) -> str:
        """Short form for messages and logs, e.g. ``tp=2 pp=2 vpp=2 cp=1 sp``."""
        extras = ([f"vpp={self.vpp}"] if self.vpp else []) + (["sp"] if self.sequence_parallel else []) + (
            ["dist-opt"] if self.use_distributed_optimizer else [])
        return " ".join([f"tp={self.tp} pp={self.pp} cp={self.cp}", *extras])

    def to_megatron(self):
        """The ``parallel.layout.MegatronLayout`` of this section (imports torch)."""
        from parallel.layout import MegatronLayout

        return MegatronLayout(**dataclasses.asdict(self))


@dataclass
class OptimSettings:
    """Adam with gradient clipping and a learning-rate schedule, for one trainable model."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0  # max global grad norm; 0 = no clipping
    lr_warmup_steps: int = 0  # optimizer steps of linear warm-up from 0
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warm-up, towards min_lr
    min_lr: float = 0.0

    def to_optim_config(self):
        """The ``megarl.training.OptimConfig`` of this section (imports torch)."""
        from megarl.training import OptimConfig

        return OptimConfig(
            lr=self.lr, weight_decay=self.weight_decay, adam_beta1=self.betas[0], adam_beta2=self.betas[1],
            adam_eps=self.eps, clip_grad=self.clip_grad,
        )


@dataclass
class KLLossConfig:
    """KL to the reference as a loss term (GRPO): ``loss += coef * agg(kl_t)``."""

    enabled: bool = False
    coef: float = 0.001
    estimator: str = "k3"  # megarl.algorithms.kl.KL_ESTIMATORS
    clamp: float | None = 10.0  # bound on |log ratio| before estimating; null = none


@dataclass
class ActorConfig:
    """The trained policy: where it runs, how it is split and optimised, and its loss."""

    pool: str = DEFAULT_POOL
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    optim: OptimSettings = field(default_factory=OptimSettings)
    # Samples per micro-batch; ignored when max_tokens_per_micro_batch is set (token-budget
    # micro-batches, balanced over data-parallel ranks).
    micro_batch_size: int = 1
    max_tokens_per_micro_batch: int | None = None
    # Pack each micro-batch's sequences into one row (thd, no padding between them) for every
    # Megatron model of the run (actor, reference, critic); false = right-padded rows.
    sequence_packing: bool = False
    # Compute each prompt once for all its rollout.n samples, for every Megatron model of the run:
    # one row per prompt holding the prompt and each sample's response as a branch that attends
    # to the prompt and itself (exact: parallel/modules/shared_prefix.py). Fewer tokens through the model
    # (the prompt x (n-1) per prompt) and fewer attention scores than a row per sample. null (the
    # default) = on whenever rollout.n > 1 and nothing rules it out: sequence_packing and context
    # parallelism (any role's) are other row layouts; true there is an error.
    shared_prompts: bool | None = None
    # Prompts per optimizer step (each with rollout.n samples); null = data.batch_size (one
    # optimizer step per epoch over the batch).
    mini_batch_size: int | None = None
    ppo_epochs: int = 1
    policy_loss: str = "ppo"  # megarl.algorithms registry
    loss_agg_mode: str = "token-mean"  # megarl.algorithms.aggregation.LOSS_AGG_MODES
    clip_ratio_low: float = 0.2
    clip_ratio_high: float | None = None  # null = clip_ratio_low; > low is DAPO's clip-higher
    clip_ratio_c: float | None = None  # dual-clip bound (> 1, typically 3); ppo only; null = off
    entropy_coef: float = 0.0
    kl_loss: KLLossConfig = field(default_factory=KLLossConfig)


@dataclass
class CriticConfig:
    """The value model (PPO with GAE); same shape as the actor's training settings."""

    enabled: bool = False
    model_path: str | None = None  # null = initialised from model.path
    pool: str | None = None  # null = actor.pool
    layout: LayoutConfig | None = None  # null = actor.layout
    optim: OptimSettings = field(default_factory=lambda: OptimSettings(lr=1e-5))
    micro_batch_size: int = 1
    max_tokens_per_micro_batch: int | None = None
    mini_batch_size: int | None = None
    ppo_epochs: int = 1
    value_clip: float | None = 0.5  # PPO value clipping range; null = unclipped
    loss_agg_mode: str = "token-mean"


@dataclass
class RefConfig:
    """The frozen reference policy (needed by a KL loss or a KL reward penalty)."""

    enabled: bool = False
    pool: str | None = None  # null = actor.pool
    layout: LayoutConfig | None = None  # null = actor.layout
    micro_batch_size: int = 1  # forward-only micro-batches


@dataclass
class RewardModelConfig:
    """A learned reward model: an HF ``*ForSequenceClassification`` checkpoint with one label
    (``score.weight``), run frozen by Megatron workers; a sample's score is its output at the last
    response token. When enabled it replaces the reward functions."""

    enabled: bool = False
    model_path: str | None = None  # required when enabled; same tokenizer (vocabulary) as the policy
    pool: str | None = None  # null = actor.pool
    layout: LayoutConfig | None = None  # null = actor.layout
    micro_batch_size: int = 1  # forward-only micro-batches


@dataclass
class RolloutConfig:
    """Generation: the engine, its tensor parallelism and placement, and sampling parameters."""

    engine: Literal["sglang"] = "sglang"
    placement: Literal["colocated", "separate"] = "colocated"
    pool: str | None = None  # the rollout's own pool when placement is separate
    tp: int = 1
    n: int = 4  # samples per prompt (the group size of group-based estimators)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 32
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # true: every response is max_new_tokens long (benchmarks)
    mem_fraction_static: float = 0.5  # SGLang's static memory fraction (weights + KV cache)


@dataclass
class KLPenaltyConfig:
    """KL to the reference as a per-token reward penalty (PPO-RLHF): ``r_t -= beta * kl_t``."""

    enabled: bool = False
    estimator: str = "k1"
    coef: float = 0.001  # beta (the initial beta with the adaptive controller)
    controller: Literal["fixed", "adaptive"] = "fixed"
    target: float = 0.1  # adaptive: target KL per token
    horizon: int = 10000  # adaptive: samples over which beta moves by at most 20%


@dataclass
class DynamicSamplingConfig:
    """DAPO: drop prompts whose samples all score the same; regenerate until the batch is full."""

    enabled: bool = False
    max_rounds: int = 10  # generation rounds per step before giving up filling the batch


@dataclass
class OverlongPenaltyConfig:
    """DAPO's soft overlong punishment, falling from 0 to -penalty_factor over the buffer."""

    enabled: bool = False
    buffer_len: int | None = None  # null = 20% of rollout.max_new_tokens (DAPO: 4096 of 20480)
    penalty_factor: float = 1.0


@dataclass
class AlgorithmConfig:
    """How rewards become advantages."""

    advantage: str = "grpo"  # megarl.algorithms registry
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True  # GRPO's std division (Dr.GRPO turns it off)
    kl_penalty: KLPenaltyConfig = field(default_factory=KLPenaltyConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong_penalty: OverlongPenaltyConfig = field(default_factory=OverlongPenaltyConfig)


@dataclass
class DataConfig:
    """Prompt files and how rows become prompts (``megarl.data.PromptDataset``)."""

    train_files: list[str] = field(default_factory=list)  # .parquet / .jsonl
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    ground_truth_key: str | None = "reward_model.ground_truth"
    data_source_key: str = "data_source"
    default_data_source: str | None = None
    extra_info_key: str | None = "extra_info"
    batch_size: int = 4  # prompts per RL step
    max_prompt_length: int = 64  # longer prompts are dropped
    shuffle: bool = True
    seed: int = 0
    chat_template: str | None = None  # replaces the tokenizer's own
    prompt_template: str | None = None  # str.format template with {prompt}, instead of a chat template


@dataclass
class RewardConfig:
    """Which function scores each data source (``megarl.rewards``)."""

    # data source -> a registered reward name or "package.module:function" / "file.py:function";
    # data sources not listed use the reward registered for them, else `default`.
    functions: dict[str, str] = field(default_factory=dict)
    default: str | None = None
    timeout_s: float = 10.0
    backend: str = "auto"  # megarl.rewards.BACKENDS
    num_workers: int = 2


@dataclass
class TrainerConfig:
    """The run: length, checkpoints, resume, logging."""

    total_steps: int = 20
    save_every: int = 0  # RL steps between checkpoints; 0 = only at the end
    keep_last: int = 2  # checkpoints kept
    resume: str = "auto"  # auto (latest in output_dir, if any) | none | a checkpoint path
    output_dir: str = "runs/quickstart"
    seed: int = 1234
    loggers: list[Literal["console", "tensorboard"]] = field(default_factory=lambda: ["console", "tensorboard"])
    log_every: int = 1
    # Every N steps, write that step's samples (token ids, text, score) to rollouts/step_<k>.jsonl; 0 = never.
    save_rollouts_every: int = 0


@dataclass
class ClusterConfig:
    """Ranks: ``nodes x gpus_per_node`` GPUs, or ``nodes x cpu_ranks_per_node`` gloo processes."""

    nodes: int = 1
    gpus_per_node: int = 0  # > 0: a GPU cluster, one rank per GPU; 0: CPU ranks
    cpu_ranks_per_node: int = 1  # ranks per node when gpus_per_node is 0
    # Resource pools: name -> ranks (a pool larger than a node spans whole nodes). Empty = one
    # pool "global" with every rank.
    pools: dict[str, int] = field(default_factory=dict)

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
class RunConfig:
    """One RL run, top to bottom. ``megarl.config.load_config`` builds and validates one."""

    # Modules imported before validation (they may register advantages, policy losses, rewards).
    imports: list[str] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
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

    def layout_for(self, role: str) -> LayoutConfig:
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
    def megatron_roles(self) -> list[str]:
        """The Megatron models a run builds, in setup order."""
        return (["actor"] + (["ref"] if self.needs_reference else []) + (["critic"] if self.critic.enabled else [])
                + (["reward_model"] if self.reward_model.enabled else []))

    def world_size_for(self, role: str) -> int:
        """Ranks in the role's pool (KeyError if the pool is not declared)."""
        return self.cluster.pool_sizes()[self.pool_for(role)]

    def effective_overlong_buffer(self) -> int:
        buf = self.algorithm.overlong_penalty.buffer_len
        return max(1, self.rollout.max_new_tokens // 5) if buf is None else buf
