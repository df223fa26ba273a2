"""Composition (defaults presets -> file -> overrides), YAML parsing quirks, round trips, saving."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from megarl.config import (
    CONFIGS_DIR,
    RESOLVED_NAME,
    ConfigError,
    RunConfig,
    compose,
    from_dict,
    load_config,
    save_resolved,
    to_dict,
    to_yaml,
)
from tests.megarl.config.conftest import SMALL_BATCH

QUICKSTART = CONFIGS_DIR / "quickstart_grpo.yaml"



def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_merge_order_defaults_then_file_then_overrides(tmp_path):
    root = tmp_path / "presets"
    _write(root / "a" / "x.yaml", "rollout: {temperature: 0.5, n: 2, top_p: 0.5}\nactor: {optim: {lr: 1.0e-3}}\n")
    _write(root / "b" / "y.yaml", "rollout: {n: 3, top_p: 0.6, max_new_tokens: 7}\n")
    main = _write(tmp_path / "run.yaml", "defaults: [a/x, b/y]\nrollout: {top_p: 0.9, max_new_tokens: 9}\n")
    tree = compose(main, ["rollout.max_new_tokens=11"], search_path=[root])
    config = from_dict(tree)
    r = config.rollout
    assert r.temperature == 0.5  # only the first preset sets it
    assert r.n == 3  # the later preset wins over the earlier one
    assert r.top_p == 0.9  # the file wins over its presets
    assert r.max_new_tokens == 11  # the override wins over the file
    assert r.top_k == RunConfig().rollout.top_k  # untouched keys keep the dataclass default
    assert config.actor.optim.lr == 1e-3 and config.actor.optim.betas == (0.9, 0.999)  # mappings merge key by key
    assert "defaults" not in tree


def test_presets_nest_and_lists_replace(tmp_path):
    root = tmp_path / "presets"
    _write(root / "base" / "one.yaml", "data: {train_files: [a.jsonl, b.jsonl], batch_size: 2}\n")
    _write(root / "base" / "two.yaml", "defaults: [base/one]\ndata: {train_files: [c.jsonl]}\n")
    main = _write(tmp_path / "run.yaml", "defaults: [base/two]\n")
    config = from_dict(compose(main, search_path=[root]))
    assert config.data.train_files == ["c.jsonl"]  # a list replaces, it does not append
    assert config.data.batch_size == 2  # from the nested preset


def test_real_quickstart_composes_its_presets():
    tree = compose(QUICKSTART)
    config = from_dict(tree)
    assert config.algorithm.advantage == "grpo" and config.actor.kl_loss.enabled  # algorithm/grpo
    assert config.rollout.max_new_tokens == 3 and config.actor.micro_batch_size == 8  # the file's own
    assert config.model.path == "tiny-qwen2"  # model/tiny-qwen2
    assert config.cluster.cpu_ranks_per_node == 2  # cluster/local-cpu
    assert config.actor.layout.tp == 1 and config.rollout.tp == 1  # layout/tp1


def test_no_file_and_no_overrides_gives_the_dataclass_defaults():
    assert load_config(None, [], validate=False) == RunConfig()


def test_dapo_preset_builds_on_grpo():
    dapo = from_dict(compose(Path(QUICKSTART).parent / "algorithm" / "dapo.yaml"))
    assert dapo.algorithm.advantage == "grpo" and dapo.actor.policy_loss == "ppo"  # inherited from grpo
    assert dapo.actor.clip_ratio_high == 0.28 and dapo.actor.loss_agg_mode == "token-mean"  # its own
    assert not dapo.actor.kl_loss.enabled and not dapo.ref.enabled  # grpo's KL turned off
    assert dapo.algorithm.dynamic_sampling.enabled and dapo.algorithm.overlong_penalty.enabled


def test_overrides_parse_yaml_values(tmp_path):
    config = from_dict(compose(None, [
        "actor.optim.lr=1e-6", "rollout.n=8", "data.train_files=[a.parquet,b.parquet]",
        "critic.layout={tp: 2, pp: 2}", "rollout.stop_token_ids=[1, 2]", "reward.functions.openai/gsm8k=gsm8k",
        "data.chat_template=", "actor.layout.vpp=null", "actor.optim.betas=[0.8,0.9]",
    ]))
    assert config.actor.optim.lr == 1e-6 and isinstance(config.actor.optim.lr, float)
    assert config.rollout.n == 8
    assert config.data.train_files == ["a.parquet", "b.parquet"]
    assert config.critic.layout.tp == 2 and config.critic.layout.pp == 2 and config.critic.layout.cp == 1
    assert config.rollout.stop_token_ids == [1, 2]
    assert config.reward.functions == {"openai/gsm8k": "gsm8k"}
    assert config.data.chat_template is None and config.actor.layout.vpp is None
    assert config.actor.optim.betas == (0.8, 0.9)


def test_exponent_without_dot_is_a_float_in_files_too(tmp_path):
    path = _write(tmp_path / "run.yaml", "actor: {optim: {lr: 3e-5, eps: 1E-8}}\n")
    config = from_dict(compose(path))
    assert config.actor.optim.lr == 3e-5 and config.actor.optim.eps == 1e-8
    # A quoted number stays a string, and is refused with the fix.
    with pytest.raises(ConfigError, match=r"actor\.optim\.lr=\"1e-6\": expected a number, got a string; "
                                          r"write the number without quotes"):
        from_dict(compose(None, ["actor.optim.lr='1e-6'"]))


def test_ints_are_accepted_for_floats_not_the_reverse():
    config = from_dict(compose(None, ["actor.optim.lr=1", "trainer.total_steps=1e3"]))
    assert config.actor.optim.lr == 1.0 and isinstance(config.actor.optim.lr, float)
    assert config.trainer.total_steps == 1000 and isinstance(config.trainer.total_steps, int)
    with pytest.raises(ConfigError, match=r"^trainer\.total_steps=2\.5: expected an integer, got a number"):
        from_dict(compose(None, ["trainer.total_steps=2.5"]))
    with pytest.raises(ConfigError, match=r"^actor\.kl_loss\.enabled=1: expected true or false"):
        from_dict(compose(None, ["actor.kl_loss.enabled=1"]))


@pytest.mark.parametrize("override, message", [
    ("rollout.n", r"override 'rollout.n' is not key=value"),
    ("rollout..n=3", r"is not a dotted path"),
    ("rollout.n.x=1", r"rollout\.n=4 is a value, not a section"),
    ("defaults=[algorithm/ppo]", r"defaults can only be set in a YAML file"),
    ("rollout.n=[1", r"is not valid YAML"),
])
def test_malformed_overrides(override, message):
    with pytest.raises(ConfigError, match=message):
        compose(None, ["rollout.n=4", override])


def test_missing_preset_suggests_the_closest(tmp_path):
    path = _write(tmp_path / "run.yaml", "defaults: [algorithm/grpoo]\n")
    with pytest.raises(ConfigError) as info:
        compose(path)
    (line,) = info.value.problems
    assert "defaults entry 'algorithm/grpoo' not found" in line
    assert "did you mean 'algorithm/grpo'?" in line and "algorithm/ppo" in line


def test_defaults_cycle_and_bad_files(tmp_path):
    root = tmp_path / "p"
    _write(root / "g" / "a.yaml", "defaults: [g/b]\n")
    _write(root / "g" / "b.yaml", "defaults: [g/a]\n")
    with pytest.raises(ConfigError, match=r"defaults form a cycle \(a\.yaml -> b\.yaml -> a\.yaml\)"):
        compose(root / "g" / "a.yaml", search_path=[root])
    with pytest.raises(ConfigError, match=r"does not exist"):
        compose(tmp_path / "nope.yaml")
    bad = _write(tmp_path / "bad.yaml", "rollout:\n  n: [1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML at line \d+, column \d+"):
        compose(bad)
    with pytest.raises(ConfigError, match=r"defaults=\"algorithm/grpo\" must be a list"):
        compose(_write(tmp_path / "d.yaml", "defaults: algorithm/grpo\n"))


def test_resolved_yaml_round_trips(data_file, tmp_path):
    config = load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH, "actor.optim.lr=2e-6",
                                      "critic.layout={tp: 1}", "reward.functions={synthetic_arith: arithmetic}"])
    text = to_yaml(config)
    assert yaml.safe_load(text) == to_dict(config)
    resolved = _write(tmp_path / "resolved.yaml", text)
    again = load_config(resolved)
    assert again == config
    assert to_yaml(again) == text


def test_save_resolved_writes_atomically(data_file, tmp_path, monkeypatch):
    config = load_config(QUICKSTART, [f"data.train_files=[{data_file}]", *SMALL_BATCH])
    run_dir = tmp_path / "runs" / "r1"
    target = save_resolved(config, run_dir)
    assert target == run_dir / RESOLVED_NAME and load_config(target) == config
    first = target.read_text()

    changed = load_config(target, ["rollout.n=8"])
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        save_resolved(changed, run_dir)
    assert target.read_text() == first  # the old file is intact
    assert sorted(p.name for p in run_dir.iterdir()) == [RESOLVED_NAME]  # no temp file left behind
    monkeypatch.undo()
    save_resolved(changed, run_dir)
    assert load_config(target).rollout.n == 8


def test_sections_are_dataclasses_and_null_sections_take_their_defaults():
    import dataclasses

    config = from_dict(compose(None, ["actor=null", "critic.optim=null", "rollout.n=6"]))
    assert config.actor == RunConfig().actor and config.critic.optim.lr == 1e-5  # the field's own default
    assert dataclasses.asdict(config.cluster) == to_dict(config.cluster)
    assert dataclasses.replace(config.rollout, n=8).n == 8 and config.rollout.n == 6


def test_a_value_breaking_its_fields_bounds_is_reported_by_validation_with_the_rest(data_file):
    from megarl.config import validate_config

    # from_dict only refuses unknown keys and wrong types; the typed value is kept ...
    config = from_dict(compose(QUICKSTART, [f"data.train_files=[{data_file}]", "actor.optim.lr=0",
                                            "actor.optim.betas=[0.9, 1]", "rollout.top_k=0"]))
    assert config.actor.optim.lr == 0.0 and isinstance(config.actor.optim.lr, float) and config.rollout.top_k == 0
    # ... and validation reports it in the words declared next to the field, with the cross-field checks.
    with pytest.raises(ConfigError) as info:
        validate_config(config)
    assert info.value.problems[:3] == [
        "actor.optim.lr=0.0: the learning rate must be > 0; set a positive value such as 1e-6",
        "actor.optim.betas[1]=1.0: Adam betas must be in [0, 1); use e.g. [0.9, 0.999]",
        "rollout.top_k=0: must be -1 (off) or >= 1; use -1",
    ]


def _constrained(tp) -> bool:
    import typing

    if typing.get_origin(tp) is typing.Annotated and any(getattr(m, "metadata", None) for m in typing.get_args(tp)[1:]):
        return True
    return any(_constrained(arg) for arg in typing.get_args(tp))


def test_every_bounded_field_declares_the_fix_of_its_error():
    import dataclasses

    from megarl.config.errors import _plain, section_fields

    unfixed, todo = [], [("", RunConfig)]
    while todo:
        prefix, cls = todo.pop()
        for name, info in section_fields(cls).items():
            inner = _plain(info.annotation)
            if dataclasses.is_dataclass(inner):
                todo.append((f"{prefix}{name}.", inner))
            bounds = [m for m in info.metadata if type(m).__module__ == "annotated_types" or hasattr(m, "pattern")]
            if (bounds or _constrained(info.annotation)) and not (info.json_schema_extra or {}).get("fix"):
                unfixed.append(prefix + name)
    assert not unfixed, f"bounded fields without a fix text (schema.bounded): {unfixed}"
