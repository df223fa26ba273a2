"""Each kind of broken config fails before anything runs, with one line naming the key, the bad
value and the fix; several problems give one self-contained line each."""

from __future__ import annotations

import json

import pytest

from megarl.config import CONFIGS_DIR, ConfigError, DataConfig, RunConfig, load_config, validate_config
from tests.megarl.config.conftest import SMALL_BATCH

QUICKSTART = CONFIGS_DIR / "quickstart_grpo.yaml"



def _one(lines: list[str]) -> str:
    assert len(lines) == 1, lines
    return lines[0]


def test_quickstart_is_valid(data_file):
    config = load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH])
    assert config.world_size_for("actor") == 2 and config.layout_for("ref") == config.actor.layout
    assert issubclass(ConfigError, ValueError)


def test_dataclass_defaults_are_a_valid_tiny_run(data_file):
    validate_config(RunConfig(data=DataConfig(train_files=[data_file])))


@pytest.mark.parametrize("override, start, hint", [
    ("actor.optim.lrr=1e-5", "actor.optim.lrr: unknown key", "did you mean actor.optim.lr?"),
    ("actor.temperature=0.7", "actor.temperature: unknown key", "did you mean rollout.temperature?"),
    ("algorithm.advantag=gae", "algorithm.advantag: unknown key", "did you mean algorithm.advantage?"),
    ("acter.ppo_epochs=2", "acter: unknown key", "did you mean actor?"),
    ("rollout.frobnicate=1", "rollout.frobnicate: unknown key", "valid keys under rollout: placement, pool"),
])
def test_unknown_keys_suggest_the_closest(problems, override, start, hint):
    line = _one(problems(override))
    assert line.startswith(start) and hint in line


@pytest.mark.parametrize("override, expected", [
    ("rollout.n=eight", 'rollout.n="eight": expected an integer, got a string'),
    ("rollout.n='8'", 'rollout.n="8": expected an integer, got a string; write the number without quotes'),
    ("rollout.temperature=hot", 'rollout.temperature="hot": expected a number, got a string'),
    ("data.batch_size=[8]", "data.batch_size=[8]: expected an integer, got a list"),
    ("rollout.stop_token_ids=[1, x]", 'rollout.stop_token_ids[1]="x": expected an integer'),
    ("model.dtype=bf16", 'model.dtype="bf16": must be one of ["float32", "bfloat16", "float16"]'),
    ("rollout.placement=split", 'rollout.placement="split": must be one of ["colocated", "separate"]'),
    ("actor.layout=4", "actor.layout=4: expected a mapping (a section), got an integer"),
    ("cluster.pools={a: many}", 'cluster.pools.a="many": expected an integer'),
])
def test_wrong_types(problems, override, expected):
    assert _one(problems(override)).startswith(expected)


@pytest.mark.parametrize("override, key", [
    ("actor.optim.lr=0", "actor.optim.lr=0.0"),
    ("actor.optim.lr=-1e-6", "actor.optim.lr=-1e-06"),
    ("rollout.n=0", "rollout.n=0"),
    ("rollout.temperature=-0.5", "rollout.temperature=-0.5"),
    ("rollout.top_p=0", "rollout.top_p=0.0"),
    ("rollout.top_k=0", "rollout.top_k=0"),
    ("actor.clip_ratio_low=1.0", "actor.clip_ratio_low=1.0"),
    ("actor.clip_ratio_high=-0.1", "actor.clip_ratio_high=-0.1"),
    ("actor.clip_ratio_c=0.5", "actor.clip_ratio_c=0.5"),
    ("actor.optim.betas=[0.9, 1.0]", "actor.optim.betas[1]=1.0"),
    ("data.batch_size=0", "data.batch_size=0"),
    ("actor.micro_batch_size=0", "actor.micro_batch_size=0"),
    ("trainer.total_steps=0", "trainer.total_steps=0"),
    ("algorithm.gamma=1.5", "algorithm.gamma=1.5"),
    ("reward.timeout_s=0", "reward.timeout_s=0.0"),
])
def test_out_of_range_values(problems, override, key):
    line = _one(problems(override))
    assert line.startswith(key + ": ")
    assert "; " in line  # problem; fix


def test_dual_clip_only_with_the_ppo_loss(problems):
    line = _one(problems("actor.policy_loss=gspo", "actor.clip_ratio_c=3.0"))
    assert line.startswith("actor.clip_ratio_c=3.0: dual-clip only applies to actor.policy_loss='ppo'")


@pytest.mark.parametrize("override, start, valid", [
    ("algorithm.advantage=grpoo", 'algorithm.advantage="grpoo": unknown advantage estimator; did you mean \'grpo\'?',
     "gae, grpo, prime, reinforce_plus_plus"),
    ("actor.policy_loss=ppo2", 'actor.policy_loss="ppo2": unknown policy loss', "gspo, ppo, sft, vanilla"),
    ("actor.loss_agg_mode=mean", 'actor.loss_agg_mode="mean": unknown loss aggregation mode',
     "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm"),
    ("actor.kl_loss.estimator=k4", 'actor.kl_loss.estimator="k4": unknown KL estimator', "k1, k2, k3"),
    ("algorithm.kl_penalty.estimator=low_var", 'algorithm.kl_penalty.estimator="low_var": unknown KL estimator',
     "k1, k2, k3"),
    ("reward.functions={synthetic_arith: arithmetc}", 'reward.functions.synthetic_arith="arithmetc": unknown reward',
     "arithmetic, exact_match, gsm8k"),
    ("reward.backend=threads", 'reward.backend="threads": unknown reward backend', "auto, process, thread, inline"),
])
def test_unknown_registry_names_list_the_valid_ones(problems, override, start, valid):
    line = _one(problems(override))
    assert line.startswith(start) and valid in line


def test_user_reward_function_is_imported_at_check_time(problems, data_file):
    line = _one(problems("reward.default=json:no_such_function"))
    assert line.startswith('reward.default="json:no_such_function": ') and "has no attribute 'no_such_function'" in line
    load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, "reward.default=json:loads"])  # importable: fine


def test_imports_register_before_names_are_checked(problems):
    line = _one(problems("imports=[no_such_module_xyz]"))
    assert line.startswith('imports[0]="no_such_module_xyz": cannot be imported (ModuleNotFoundError')


def test_world_size_not_a_multiple_of_the_model_parallel_size(problems):
    line = _one(problems("model.path=tiny-llama", "actor.layout.tp=2", "cluster.cpu_ranks_per_node=3"))
    assert line.startswith("actor.layout: world_size=3 is not divisible by tp*pp*cp=2*1*1=2")
    assert "cluster.cpu_ranks_per_node=3" in line


def test_megatron_tp_must_divide_the_heads_but_sglang_may_replicate_kv(problems, data_file):
    # tiny-qwen2 has 4 query heads and ONE KV head: Megatron cannot split it over tp=2 ...
    line = _one(problems("actor.layout.tp=2"))
    assert line.startswith("actor.layout.tp=2 must divide num_attention_heads=4 and num_key_value_heads=1")
    # ... while SGLang's GPU engines replicate the KV head, so rollout tp=2 (or 4 on 4 ranks) is fine
    # there; its CPU engine pads the KV heads to tp instead (checked against the real engine: a
    # [96, 64] qkv_proj per rank at tp=2, not the replicated [64, 64]), which the weight sync does not write.
    gpu = ["cluster.gpus_per_node=4"]
    load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, *gpu, "rollout.tp=2"])
    load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, *gpu, "rollout.tp=4"])
    line = _one(problems("rollout.tp=2"))
    assert line.startswith("rollout.tp=2: SGLang needs num_attention_heads=4 divisible by tp and "
                           "num_key_value_heads=1 divisible by tp on CPU"), line
    assert "pick tp from [1]" in line


def test_rollout_expert_parallelism_against_the_model_and_the_cpu_engine(problems, data_file):
    moe = ["model.path=tiny-qwen3-moe"]  # 4 experts of intermediate size 32
    line = _one(problems(*moe, "rollout.ep=2"))  # ep must divide tp (1 here)
    assert line.startswith("rollout.ep=2: does not fit tp=1, num_experts=4, moe_intermediate_size=32") and \
        "pick ep from [1]" in line, line
    assert _one(problems("rollout.ep=2")).startswith("rollout.ep=2: expert parallelism needs an MoE model")
    # SGLang's CPU engine pads the experts to 32 * tp = 64 rows (a layout the sync does not write);
    # on GPUs tp=2, ep=2 is fine
    line = _one(problems(*moe, "rollout.tp=2", "rollout.ep=2"))
    assert line.startswith("rollout.ep=2: moe_intermediate_size=32 is not a multiple of 32 * tp=2"), line
    load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, *moe, "cluster.gpus_per_node=2",
                             "rollout.tp=2", "rollout.ep=2"])
    line = _one(problems("model.path=tiny-qwen3-moe", "model.path=tiny-mixtral"))  # tied: SGLang's Mixtral is not
    assert "tie_word_embeddings=True, and SGLang's MixtralForCausalLM has no tied embeddings" in line, line


def test_routing_replay_needs_an_moe_model_and_single_turn_rollouts(problems, data_file):
    line = _one(problems("actor.routing_replay=true"))  # the quickstart's tiny-qwen2 is dense
    assert line.startswith("actor.routing_replay=true: model tiny-qwen2 is not a Mixture-of-Experts model"), line
    assert "set actor.routing_replay=false" in line, line
    line = _one(problems("model.path=tiny-qwen3-moe", "actor.routing_replay=true", "rollout.multi_turn.enabled=true",
                      "rollout.multi_turn.max_total_tokens=64"))
    assert line.startswith("actor.routing_replay=true: multi-turn trajectories are not recorded"), line
    load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, "model.path=tiny-qwen3-moe",
                             "actor.routing_replay=true"])


def test_rollout_tp_against_heads_and_its_pool(problems):
    lines = problems("rollout.tp=3", "cluster.cpu_ranks_per_node=6", "data.batch_size=6")
    line = _one(lines)
    assert line.startswith("rollout.tp=3: SGLang needs num_attention_heads=4 divisible by tp")
    assert "pick tp from [1]" in line  # on CPU; [1, 2, 4] on GPUs (KV heads replicated)
    line = _one(problems("rollout.tp=4", "cluster.gpus_per_node=2"))  # 4 fits the heads (GPU), not the 2 ranks
    assert line.startswith("rollout.tp=4: the rollout pool 'global' has 2 ranks")


def test_layers_divisible_by_pp_times_vpp(problems):
    line = _one(problems("model.path=tiny-llama", "actor.layout={tp: 1, pp: 2, vpp: 4}"))
    assert line.startswith("actor.layout: num_hidden_layers=4 is not divisible by pp*vpp=8")


def test_vpp_needs_a_multiple_of_pp_micro_batches(problems, data_file):
    base = ["model.path=tiny-llama", "actor.layout={tp: 2, pp: 2, vpp: 2, sequence_parallel: true}",
            "cluster.cpu_ranks_per_node=4"]
    # dp = 4 / (2*2) = 1: 8 prompts x 4 samples = 32 samples per rank; 32 per micro-batch = 1 micro-batch.
    line = _one(problems(*base, "actor.micro_batch_size=32"))
    assert line.startswith("actor.layout.vpp=2: megatron's interleaved schedule needs the number of micro-batches")
    assert "but it is 1" in line and "set actor.micro_batch_size to one of [1, 2, 4, 8, 16]" in line
    # 2 micro-batches
    load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, *base, "actor.micro_batch_size=16"])
    # The same rule for the forward-only reference, with its own micro-batch size.
    line = _one(problems(*base, "actor.micro_batch_size=16", "ref.micro_batch_size=32"))
    assert line.startswith("actor.layout.vpp=2:") and "ref.micro_batch_size 32" in line
    # A token budget makes the count data-dependent: refused with vpp.
    line = _one(problems(*base, "actor.max_tokens_per_micro_batch=128"))
    assert line.startswith("actor.layout.vpp=2: with actor.max_tokens_per_micro_batch")


def test_batch_must_split_over_data_parallel_ranks_and_micro_batches(problems):
    line = _one(problems("cluster.cpu_ranks_per_node=3"))
    assert line.startswith("data.batch_size=8: 8 prompts x rollout.n=4 = 32 samples per optimizer step do not "
                           "split evenly over the actor's data-parallel size 3")
    line = _one(problems("actor.micro_batch_size=3"))
    assert line.startswith("actor.micro_batch_size=3: does not divide the 16 samples")
    line = _one(problems("actor.mini_batch_size=3"))
    assert line.startswith("actor.mini_batch_size=3: must divide data.batch_size=8")


def test_gae_needs_a_critic(problems, data_file):
    line = _one(problems("algorithm.advantage=gae", "rollout.n=1", "actor.kl_loss.enabled=false"))
    assert line.startswith("critic.enabled=false: algorithm.advantage='gae' needs a value model; set critic.enabled=true")
    load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, "algorithm.advantage=gae", "critic.enabled=true"])


def test_kl_terms_need_the_reference(problems):
    line = _one(problems("ref.enabled=false"))  # grpo's KL loss is on
    assert line.startswith("ref.enabled=false: actor.kl_loss.enabled need the reference policy")
    line = _one(problems("ref.enabled=false", "actor.kl_loss.enabled=false", "algorithm.kl_penalty.enabled=true"))
    assert "algorithm.kl_penalty.enabled" in line


def test_group_estimators_need_several_samples(problems):
    line = _one(problems("rollout.n=1"))
    assert line.startswith("rollout.n=1: algorithm.advantage='grpo' compares the samples of one prompt")


def test_shared_prompts_need_padded_rows_and_no_context_parallelism(problems, data_file):
    line = _one(problems("actor.shared_prompts=true", "actor.sequence_packing=true"))
    assert line.startswith("actor.shared_prompts=true: shared-prompt rows and sequence_packing are two different")
    line = _one(problems("actor.shared_prompts=true", "ref.layout={tp: 1, pp: 1, cp: 2}", "ref.pool=b", "actor.pool=a",
                         "cluster.cpu_ranks_per_node=4", "cluster.pools={a: 2, b: 2}"))  # (a layout of its own: a pool too)
    assert line.startswith("actor.shared_prompts=true: shared-prompt rows need context parallelism 1, but the ref's "
                           "layout has cp=2")
    load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, "actor.shared_prompts=true"])


def test_sequence_must_fit_the_model_positions(problems):
    line = _one(problems("rollout.max_new_tokens=250"))
    assert line.startswith("rollout.max_new_tokens=250: data.max_prompt_length=32 + max_new_tokens = 282 exceeds")


def test_pools(problems, data_file):
    line = _one(problems("rollout.placement=separate"))
    assert line.startswith("rollout.pool=null: rollout.placement=separate needs a pool of its own")
    line = _one(problems("ref.pool=other"))
    assert line.startswith('ref.pool="other": is not a resource pool (pools: global)')
    line = _one(problems("cluster.pools={train: 2, rollout: 2}", "actor.pool=train"))
    assert line.startswith("cluster.pools={") and "hold 4 ranks but the cluster has 2" in line
    split = ["cluster.cpu_ranks_per_node=4", "cluster.pools={train: 2, rollout: 2}", "actor.pool=train",
             "rollout.placement=separate", "rollout.pool=rollout"]
    load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, *split])


def test_model_path_preset_or_directory(problems, tmp_path, data_file):
    line = _one(problems("model.path=tiny-qwen2-untie"))
    assert line.startswith('model.path="tiny-qwen2-untie": is neither a local model directory nor a model preset; '
                           "did you mean 'tiny-qwen2-untied'?")
    model_dir = tmp_path / "my_model"
    model_dir.mkdir()
    line = _one(problems(f"model.path={model_dir}"))
    assert line.startswith(f'model.path="{model_dir}": the directory has no config.json')
    # A local directory's config.json is what the layout is checked against.
    from model_specs.presets import hf_config_dict

    (model_dir / "config.json").write_text(json.dumps(hf_config_dict("tiny-llama", num_key_value_heads=4)))
    load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, f"model.path={model_dir}", "actor.layout.tp=4",
                             "cluster.cpu_ranks_per_node=4"])
    (model_dir / "config.json").write_text(json.dumps(dict(hf_config_dict("tiny-llama"), model_type="gpt2")))
    line = _one(problems(f"model.path={model_dir}"))
    assert line.startswith(f'model.path="{model_dir}": model_type=\'gpt2\'') and "not supported" in line


def test_missing_files(problems, data_file):
    lines = problems("data.train_files=[/no/such/train.parquet, /no/such/more.jsonl]",
                     "trainer.resume=/no/such/checkpoint")
    assert [line.split(":")[0] for line in lines] == [
        'data.train_files[0]="/no/such/train.parquet"', 'data.train_files[1]="/no/such/more.jsonl"',
        'trainer.resume="/no/such/checkpoint"']
    assert "the file does not exist" in lines[0]
    # check_files=False is for machines without the data: the same config then passes.
    load_config(QUICKSTART, ["data.train_files=[/no/such/train.parquet]"], check_files=False)
    # ... but a wrong file kind or no file at all is still an error.
    line = _one(problems("data.train_files=[/no/such/train.csv]", check_files=False))
    assert line.startswith('data.train_files[0]="/no/such/train.csv": prompt files must be .parquet or .jsonl')
    line = _one(problems("data.train_files=[]", check_files=False))
    assert line.startswith("data.train_files=[]: no training prompt files")


def test_several_problems_give_one_self_contained_line_each(problems):
    lines = problems("actor.optim.lr=0", "algorithm.advantage=nope", "rollout.temperature=-1",
                     "data.train_files=[/missing.parquet]")
    keys = [line.split("=")[0] for line in lines]
    assert sorted(keys) == sorted(["actor.optim.lr", "algorithm.advantage", "rollout.temperature", "data.train_files[0]"])
    assert all(": " in line and "; " in line for line in lines)
    # Structural problems (unknown keys, types) are all reported together, before value checks.
    lines = problems("actor.optim.lrr=1", "rollout.n=x", "actor.optim.lr=0")
    assert [line.split(":")[0].split("=")[0] for line in lines] == ["actor.optim.lrr", "rollout.n"]


def test_reward_model_must_be_a_one_label_classifier_with_the_policys_vocabulary(problems, data_file, tmp_path):
    from model_specs.presets import save_tiny_hf_model

    line = _one(problems("reward_model.enabled=true"))
    assert line.startswith("reward_model.model_path=null: reward_model.enabled=true needs the reward model's")
    causal = save_tiny_hf_model("tiny-qwen2", tmp_path / "causal")
    line = _one(problems("reward_model.enabled=true", f"reward_model.model_path={causal}"))
    assert "architectures=['Qwen2ForCausalLM'] with None label(s)" in line and "num_labels=1" in line
    other_vocab = save_tiny_hf_model("tiny-qwen2", tmp_path / "rm-vocab", reward_model=True, vocab_size=300)
    line = _one(problems("reward_model.enabled=true", f"reward_model.model_path={other_vocab}"))
    assert "vocab_size=300 differs from the policy's 256" in line
    good = save_tiny_hf_model("tiny-qwen2", tmp_path / "rm", reward_model=True)
    config = load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, "reward_model.enabled=true",
                                      f"reward_model.model_path={good}"])
    assert config.pool_for("reward_model") == "global" and config.layout_for("reward_model") == config.actor.layout


@pytest.fixture
def user_estimators():
    """Register test estimators; unregistered again afterwards."""
    from megarl.algorithms import registry

    saved = dict(registry._ADVANTAGES)
    yield registry.register_advantage
    registry._ADVANTAGES.clear()
    registry._ADVANTAGES.update(saved)


def test_a_user_estimator_that_needs_a_critic_is_refused_without_one(problems, data_file, user_estimators):
    @user_estimators("my_value_baseline", inputs=("values",), needs_critic=True)
    def my_value_baseline(*, token_rewards, response_mask, values):
        return token_rewards - values, token_rewards

    line = _one(problems("algorithm.advantage=my_value_baseline", "actor.kl_loss.enabled=false"))
    assert line.startswith("critic.enabled=false: algorithm.advantage='my_value_baseline' needs a value model; "
                           "set critic.enabled=true, or pick a critic-free estimator (")
    assert "my_value_baseline" not in line.split("critic-free estimator")[1] and "grpo" in line
    load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, "algorithm.advantage=my_value_baseline",
                             "critic.enabled=true"])


def test_a_user_estimator_that_needs_groups_is_refused_with_one_sample(problems, data_file, user_estimators):
    @user_estimators("my_group_baseline", inputs=("index",), needs_groups=True)
    def my_group_baseline(*, token_rewards, response_mask, index):
        return token_rewards, token_rewards

    @user_estimators("my_plain", inputs=("gamma",))
    def my_plain(*, token_rewards, response_mask, gamma):
        return token_rewards, token_rewards

    line = _one(problems("algorithm.advantage=my_group_baseline", "rollout.n=1"))
    assert line.startswith("rollout.n=1: algorithm.advantage='my_group_baseline' compares the samples of one prompt")
    assert line.endswith("; use rollout.n >= 2 (e.g. 8)")
    # declaring no needs: a single sample per prompt is fine
    load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, "algorithm.advantage=my_plain",
                             "rollout.n=1"])


@pytest.mark.parametrize("estimator, missing", [("remax", "['baseline_rewards']"),
                                                ("prime", "['process_rewards']")])
def test_estimators_needing_inputs_a_run_does_not_compute_are_refused(problems, estimator, missing):
    line = _one(problems(f"algorithm.advantage={estimator}"))
    assert line.startswith(f"algorithm.advantage=\"{estimator}\": needs {missing}, which a megarl run does not compute")
    usable = line.split("pick one of [")[1].split("]")[0]
    assert "'grpo'" in usable and "'gae'" in usable and "remax" not in usable and "prime" not in usable


def test_fp16_training_is_refused_with_the_fix(problems):
    line = _one(problems("model.dtype=float16"))
    assert line.startswith('model.dtype="float16": the actor would train in fp16') and "use bfloat16" in line


def test_rollout_correction_names_and_bypass(problems):
    line = _one(problems("algorithm.rollout_correction.method=tiss"))
    assert line.startswith('algorithm.rollout_correction.method="tiss": unknown rollout correction; '
                           "did you mean 'tis'? valid: none, icepop, mis")
    line = _one(problems("algorithm.rollout_correction.method=tis", "algorithm.rollout_correction.bypass=true"))
    assert line.startswith('algorithm.rollout_correction.method="tis": with bypass=true the rollout\'s log-probs')
    line = _one(problems("algorithm.rollout_correction.high=0.5"))
    assert line.startswith("algorithm.rollout_correction.high=0.5")


def test_multi_turn_tools_and_budget_are_checked(problems):
    lines = problems("rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[python, nosuchtool]",
                     "rollout.multi_turn.tool_format=xml", "rollout.multi_turn.max_total_tokens=2")
    assert len(lines) == 3, lines
    assert any(line.startswith("rollout.multi_turn.tools=") and "nosuchtool" in line for line in lines), lines
    assert any(line.startswith('rollout.multi_turn.tool_format="xml": is not a known tool-call format')
               and "hermes" in line for line in lines), lines
    assert any(line.startswith("rollout.multi_turn.max_total_tokens=2: is below one turn's rollout.max_new_tokens")
               for line in lines), lines
    # the response length the rows are sized for is the multi-turn budget
    line = _one(problems("rollout.multi_turn.enabled=true", "rollout.multi_turn.max_total_tokens=300"))
    assert line.startswith("rollout.multi_turn.max_total_tokens=300: data.max_prompt_length=32 + "
                           "multi_turn.max_total_tokens = 332 exceeds the model's max_position_embeddings"), line


def test_sft_mode_trains_the_actor_alone_within_the_model_positions(data_file):
    sft = CONFIGS_DIR / "sft_chat_arith.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(sft, [f"data.train_files=[{data_file}]", "critic.enabled=true", "sft.max_length=1000"], mode="sft")
    assert info.value.problems == [
        "critic.enabled=true: megarl sft trains the actor alone on the conversations; set critic.enabled=false",
        "sft.max_length=1000: exceeds the model's max_position_embeddings=256; use at most 256"]
    config = load_config(sft, [f"data.train_files=[{data_file}]"], mode="sft")
    assert (config.actor.policy_loss, config.rollout.n, config.shared_prompt_rows) == ("sft", 1, False)
    assert config.data.max_prompt_length + config.max_response_length == config.sft.max_length


def test_one_step_off_needs_engines_on_their_own_pool(problems):
    line = _one(problems("rollout.mode=one_step_off"))
    assert line.startswith('rollout.mode="one_step_off": generation overlaps training only on engines with ranks of '
                           "their own"), line
    assert "rollout.placement=separate" in line


def test_streaming_needs_engines_on_their_own_pool_and_only_it_reads_max_staleness(problems):
    line = _one(problems("rollout.mode=streaming", "rollout.max_staleness=2"))
    assert line.startswith('rollout.mode="streaming": generation overlaps training only on engines with ranks of '
                           "their own"), line
    line = _one(problems("rollout.max_staleness=2"))
    assert line == ("rollout.max_staleness=2: only rollout.mode=streaming reads it (the mode is 'sync', whose "
                    "staleness is 0); set rollout.mode=streaming, or leave rollout.max_staleness out"), line
    assert problems("rollout.max_staleness=-1")[0] == ("rollout.max_staleness=-1: must be >= 0; use e.g. 1 or 2 "
                                                       "(0: no generation ahead of training)")


def test_partial_rollouts_need_generation_ahead_of_training(problems):
    line = _one(problems("rollout.partial_rollout_tokens=4"))
    assert line == ("rollout.partial_rollout_tokens=4: partial rollouts continue a batch across a weight update, "
                    "which happens only with generation ahead of training; set rollout.mode=one_step_off or "
                    "streaming, or rollout.partial_rollout_tokens=0"), line
