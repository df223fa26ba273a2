"""One refusal list: valid settings a run does not implement yet are config problems, so `megarl
check-config`, `megarl plan` and `megarl train` refuse them alike, before anything starts (they
were the trainer's own ``not_yet_supported`` list, which check-config and plan did not run)."""

from __future__ import annotations

import pytest

from megarl.cli import main
from megarl.config import CONFIGS_DIR, load_config

QUICKSTART = str(CONFIGS_DIR / "quickstart_grpo.yaml")
LLAMA_70B = str(CONFIGS_DIR / "llama3_70b_grpo_32x8.yaml")
SPLIT = ["cluster.cpu_ranks_per_node=4", "cluster.pools={train: 2, rollout: 2}", "actor.pool=train",
         "rollout.placement=separate", "rollout.pool=rollout"]

# case -> (config, valid overrides, the overrides it refuses, the refusal's line)
REFUSED = {
    "two layouts on one pool": (
        QUICKSTART, ["ref.enabled=true"], ["ref.layout.pp=2"],
        'ref.layout="tp=1 pp=2 cp=1": differs from the actor\'s layout (tp=1 pp=1 cp=1) on the same pool \'global\', '
        "but roles sharing a pool share its processes and so one layout; give the ref a pool of its own (ref.pool) or "
        "the actor's layout (ref.layout=null)"),
    "two layouts on a pool without the actor": (
        QUICKSTART, ["cluster.pools={a: 1, b: 1}", "actor.pool=a", "algorithm.advantage=gae", "critic.enabled=true",
                     "critic.pool=b", "ref.enabled=true", "ref.pool=b"], ["critic.layout.use_distributed_optimizer=true"],
        'critic.layout="tp=1 pp=1 cp=1 dist-opt": differs from the ref\'s layout (tp=1 pp=1 cp=1) on the same pool '
        "'b', but roles sharing a pool share its processes and so one layout; give the critic a pool of its own "
        "(critic.pool) or the ref's layout (critic.layout=null)"),
    "an engine spanning nodes": (
        LLAMA_70B, ["cluster.pools={train: 128, rollout: 128}", "actor.pool=train", "rollout.placement=separate",
                    "rollout.pool=rollout", "rollout.mem_fraction_static=0.85"], ["rollout.tp=16"],
        "rollout.tp=16: an engine spanning nodes (8 ranks each) on a separate pool is not implemented yet; use "
        "rollout.tp <= 8"),
    "a colocated engine straddling nodes": (
        LLAMA_70B, [], ["rollout.tp=16"],
        "rollout.tp=16: colocated engines of 16 GPUs do not divide a node's 8 GPUs (cluster.gpus_per_node): an "
        "engine would straddle two nodes; use a rollout.tp that divides 8 (1, 2, 4, 8)"),
    "a Megatron role on the engines' pool": (
        QUICKSTART, [*SPLIT, "ref.enabled=true"], ["ref.pool=rollout"],
        'rollout.pool="rollout": is also the ref\'s pool, but engines on a separate pool need its ranks to themselves '
        "(sharing them is not implemented yet); give them a pool no Megatron role uses"),
    "dynamic sampling ahead of training": (
        QUICKSTART, [*SPLIT, "rollout.mode=one_step_off"], ["algorithm.dynamic_sampling.enabled=true"],
        "algorithm.dynamic_sampling.enabled=true: dynamic sampling is not implemented with generation ahead of "
        "training (rollout.mode=one_step_off); use rollout.mode=sync, or disable dynamic sampling"),
    "dynamic sampling of groups of one": (
        QUICKSTART, ["rollout.n=1", "algorithm.advantage=reinforce_plus_plus"], ["algorithm.dynamic_sampling.enabled=true"],
        "rollout.n=1: algorithm.dynamic_sampling drops groups whose samples all score the same, so groups of 1 are "
        "always dropped; use rollout.n >= 2, or disable dynamic sampling"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
@pytest.mark.parametrize("command", ["check-config", "plan", "train"])
def test_refused_alike_by_check_config_plan_and_train(case, command, data_file, capsys):
    config, valid, refused, line = REFUSED[case]
    code = main([command, config, f"data.train_files=[{data_file}]", *valid, *refused])
    err = capsys.readouterr().err
    prefix = {"check-config": "megarl", "plan": "megarl plan", "train": "megarl train"}[command]
    assert code == 2 and err == f"{prefix}: config error: {line}\n", err  # this refusal, and only it


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_settings_around_each_refusal_are_valid(case, data_file):
    config, valid, _, _ = REFUSED[case]
    load_config(config, [f"data.train_files=[{data_file}]", *valid])


def test_megatron_pools(data_file):
    base = [f"data.train_files=[{data_file}]"]
    cfg = load_config(QUICKSTART, [*base, "ref.enabled=true"])
    assert cfg.megatron_pools() == {"global": ["actor", "ref"]}
    cfg = load_config(QUICKSTART, [*base, "cluster.cpu_ranks_per_node=3", "cluster.pools={b: 1, a: 2}",
                                   "actor.pool=a", "algorithm.advantage=gae", "critic.enabled=true", "critic.pool=b",
                                   "ref.enabled=true", "actor.micro_batch_size=1", "ref.micro_batch_size=1"])
    assert list(cfg.megatron_pools().items()) == [("a", ["actor", "ref"]), ("b", ["critic"])]  # the actor's first
