import pytest

from megarl.rewards import registry
from megarl.rewards.builtin import arithmetic_reward, gsm8k_reward, math_reward

from . import helpers


@pytest.fixture
def clean_registry():
    saved = dict(registry._REWARDS), dict(registry._DATA_SOURCES), set(registry._TRUSTED)
    yield
    registry._REWARDS.clear(), registry._REWARDS.update(saved[0])
    registry._DATA_SOURCES.clear(), registry._DATA_SOURCES.update(saved[1])
    registry._TRUSTED.clear(), registry._TRUSTED.update(saved[2])


def test_default_data_source_mapping():
    assert registry.reward_for_data_source("openai/gsm8k") == "gsm8k"
    assert registry.reward_for_data_source("math") == "math"
    assert registry.reward_for_data_source("lighteval/MATH") == "math"
    assert registry.reward_for_data_source("synthetic_arith") == "arithmetic"
    assert registry.reward_for_data_source("nope") is None
    assert registry.get_reward("gsm8k") is gsm8k_reward
    assert registry.get_reward("math") is math_reward
    assert registry.get_reward("arithmetic") is arithmetic_reward
    assert registry.is_trusted("gsm8k") and registry.is_trusted("math")


def test_register_decorator(clean_registry):
    @registry.register_reward("always_one", data_sources=("my/data",))
    def always_one(**_):
        return 1.0

    assert registry.get_reward("always_one") is always_one
    assert registry.reward_for_data_source("my/data") == "always_one"
    assert not registry.is_trusted("always_one")
    assert registry.resolve_reward("always_one") is always_one
    with pytest.raises(ValueError, match="already registered"):
        registry.register_reward("always_one")(lambda **_: 0.0)
    with pytest.raises(ValueError, match="'my/data' already maps to reward 'always_one'"):
        registry.register_reward("other", data_sources="my/data")(lambda **_: 0.0)
    registry.register_reward("other", data_sources="my/data", override=True)(lambda **_: 0.0)
    assert registry.reward_for_data_source("my/data") == "other"
    with pytest.raises(ValueError, match="unknown reward 'missing'"):
        registry.get_reward("missing")
    with pytest.raises(ValueError, match="without ':'"):
        registry.register_reward("a:b")


def test_load_by_module_path_and_file():
    fn = registry.load_reward_function(f"{helpers.__name__}:length_score")
    assert fn is helpers.length_score
    by_file = registry.load_reward_function(f"{helpers.__file__}:verl_style")
    assert by_file(data_source="x", solution_str="3", ground_truth=3) == 0.5
    assert registry.resolve_reward(helpers.raise_error) is helpers.raise_error


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("no_colon_here", "must be a registered name"),
        ("megarl_no_such_module_xyz:fn", "module 'megarl_no_such_module_xyz' not found"),
        ("megarl.rewards.no_such_submodule:fn", "not found"),
        (f"{helpers.__name__}:no_such_fn", "has no attribute 'no_such_fn'"),
        (f"{helpers.__name__}:NOT_CALLABLE", "not callable"),
        ("/no/such/file.py:fn", "does not exist"),
        (":fn", "empty part"),
    ],
)
def test_load_errors_name_the_spec(spec, expected):
    with pytest.raises(ValueError) as e:
        registry.load_reward_function(spec)
    assert repr(spec) in str(e.value)
    assert expected in str(e.value)


def test_missing_function_lists_the_public_callables():
    with pytest.raises(ValueError, match="sleep_long"):
        registry.load_reward_function(f"{helpers.__name__}:sleep_lonng")


def test_import_error_inside_the_module_is_reported(tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("raise RuntimeError('broken at import')\n")
    with pytest.raises(ValueError, match="importing .*bad_reward.py.* failed: RuntimeError: broken at import"):
        registry.load_reward_function(f"{bad}:fn")
