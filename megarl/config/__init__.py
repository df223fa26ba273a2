"""Typed configuration of an RL run: schema, YAML presets and overrides, validation, saving.

    from megarl.config import load_config, save_resolved
    config = load_config("configs/quickstart_grpo.yaml", ["rollout.n=8", "actor.optim.lr=1e-5"])
    save_resolved(config, run_dir)        # run_dir/resolved_config.yaml, written atomically

* ``schema``: the pydantic dataclasses (``RunConfig`` and one per section) with tiny-CPU-run
  defaults, and each field's own bounds with the fix of its error.
* ``loader``: ``defaults:`` preset composition (``configs/<group>/<name>.yaml``), dotted
  ``key=value`` overrides, typed conversion by pydantic (unknown keys, wrong types), YAML out.
* ``validate``: field bounds, registry names, model/layout/pool/micro-batch consistency, files.
* ``errors``: ``ConfigError`` and the translation of pydantic's errors into its lines.

Every problem is a ``ConfigError`` (a ValueError) with one line per problem, naming the dotted
key, the bad value and the fix. Importing this package does not import torch (the layouts are
``parallel.layout.MegatronLayout``, which does not either); validation does (through the model
families of ``model_specs`` and the algorithm registry).
"""

from megarl.config.errors import ConfigError
from megarl.config.loader import (
    CONFIGS_DIR,
    RESOLVED_NAME,
    apply_override,
    compose,
    deep_merge,
    from_dict,
    load_config,
    parse_value,
    save_resolved,
    to_dict,
    to_yaml,
)
from megarl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    ClusterConfig,
    CriticConfig,
    DataConfig,
    DynamicSamplingConfig,
    KLLossConfig,
    KLPenaltyConfig,
    ModelConfig,
    OptimSettings,
    OverlongPenaltyConfig,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    RunConfig,
    SFTConfig,
    TrainerConfig,
)


def validate_config(config: RunConfig, *, check_files: bool = True, mode: str = "rl") -> None:
    """Raise ConfigError (one line per problem) if ``config`` cannot work; see ``validate``."""
    from megarl.config.validate import validate_config as _validate

    _validate(config, check_files=check_files, mode=mode)


__all__ = [
    "CONFIGS_DIR", "RESOLVED_NAME", "ActorConfig", "AlgorithmConfig", "ClusterConfig", "ConfigError",
    "CriticConfig", "DataConfig", "DynamicSamplingConfig", "KLLossConfig", "KLPenaltyConfig",
    "ModelConfig", "OptimSettings", "OverlongPenaltyConfig", "RefConfig", "RewardConfig", "RewardModelConfig", "RolloutConfig",
    "RunConfig", "SFTConfig", "TrainerConfig", "apply_override", "compose", "deep_merge", "from_dict", "load_config",
    "parse_value", "save_resolved", "to_dict", "to_yaml", "validate_config",
]
