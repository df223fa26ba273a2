"""Tool calls for agentic rollouts: parsing, the calculator, the python sandbox (real subprocesses)
and user tools; every failure is a result with an error kind, never an exception."""

import json
import os
import sys
import textwrap
import time

import psutil
import pytest

from megarl.agent import (
    ERROR_KINDS,
    ToolCall,
    ToolLimits,
    ToolRegistry,
    ToolResult,
    calculate,
    parse_tool_calls,
    run_python,
    tool_schema,
)

FAST = ToolLimits(timeout_s=1.0, memory_mb=256, cpu_s=5.0, max_output_chars=500)


def _block(obj) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


# ----------------------------------------------------------------------------- parsing


def test_parse_one_call_keeps_raw_text():
    raw = _block({"name": "calculator", "arguments": {"expression": "1+2"}})
    calls, errors = parse_tool_calls(f"Let me compute.\n{raw}\n")
    assert errors == []
    assert calls == [ToolCall("calculator", {"expression": "1+2"}, raw)]


def test_parse_two_calls_and_arguments_as_json_string():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
        '<tool_call>  {"name": "b", "arguments": "{\\"y\\": [2]}"}  </tool_call>'
    )
    calls, errors = parse_tool_calls(text)
    assert errors == []
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {"y": [2]})]
    assert all(c.raw in text and c.raw.startswith("<tool_call>") and c.raw.endswith("</tool_call>") for c in calls)


def test_parse_without_calls():
    assert parse_tool_calls("The answer is 42. </tool_call> stray") == ([], [])


@pytest.mark.parametrize(
    "body, problem",
    [
        ('{"name": "a", "arguments": {"x": 1}', "invalid JSON"),
        ('{"arguments": {"x": 1}}', 'missing "name"'),
        ('{"name": "a", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "a", "arguments": "not json"}', "not valid JSON"),
        ('["a"]', "expected a JSON object"),
    ],
)
def test_parse_malformed_call_is_an_error_not_an_exception(body, problem):
    good = _block({"name": "ok", "arguments": {}})
    calls, errors = parse_tool_calls(f"<tool_call>{body}</tool_call>{good}")
    assert [c.name for c in calls] == ["ok"]
    assert len(errors) == 1 and errors[0].startswith("tool call 1:") and problem in errors[0]


def test_parse_unclosed_call():
    good = _block({"name": "ok", "arguments": {}})
    calls, errors = parse_tool_calls(f"<tool_call>{{'broken'\n{good}\n<tool_call>{{")
    assert [c.name for c in calls] == ["ok"]
    assert len(errors) == 2 and all("not closed" in e for e in errors)


def test_parse_unknown_format():
    with pytest.raises(ValueError, match="'xml'.*hermes"):
        parse_tool_calls("", fmt="xml")


# ----------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression", ["1 + 2 * 3", "(4 - 10) / 4", "7 // -2", "-7 % 3", "2 ** 100", "2 ** -2", "1.5e3 * -(2 + 0.25)"]
)
def test_calculator_matches_python(expression):
    expected = eval(expression)  # the reference: Python's own arithmetic
    assert calculate(expression) == expected
    result = ToolRegistry.from_names(["calculator"]).call(ToolCall("calculator", {"expression": expression}, ""))
    assert result == ToolResult(str(expected) if isinstance(expected, int) else repr(expected))


@pytest.mark.parametrize(
    "expression, kind",
    [
        ("__import__('os').system('true')", "bad_arguments"),
        ("x + 1", "bad_arguments"),
        ("abs(-1)", "bad_arguments"),
        ("(1).real", "bad_arguments"),
        ("1 +", "bad_arguments"),
        ("9**9**9", "raised"),
        ("10**100000", "raised"),
        ("1 / 0", "raised"),
        ("(-8) ** 0.5", "raised"),
    ],
)
def test_calculator_refuses(expression, kind):
    start = time.monotonic()
    result = ToolRegistry.from_names(["calculator"]).call(ToolCall("calculator", {"expression": expression}, ""))
    assert result.error == kind and result.text.startswith("Error:")
    assert time.monotonic() - start < 1.0


# ----------------------------------------------------------------------------- python sandbox


def _python(registry: ToolRegistry, code: str) -> ToolResult:
    return registry.call(ToolCall("python", {"code": code}, ""))


def test_python_prints_result():
    assert run_python("import math\nprint(math.factorial(10))", FAST) == ToolResult("3628800\n")


@pytest.mark.parametrize(
    "code, limits, kind, says",
    [
        ("while True: pass", FAST, "timeout", "timed out after 1.0 s"),
        ("import time\nprint('started')\ntime.sleep(1000)", FAST, "timeout", "started"),
        ("while True: pass", ToolLimits(timeout_s=10.0, cpu_s=1.0), "timeout", "CPU time"),
        ("x = bytearray(2 * 1024**3)", FAST, "memory", "out of memory"),
        ("raise SystemExit(3)", FAST, "crashed", "status 3"),
        ("import os\nos.abort()", FAST, "crashed", "SIGABRT"),
        ("def f():\n    return {}['key']\nprint('before')\nf()", FAST, "crashed", "KeyError: 'key'"),
        ("import socket\nsocket.socket()", FAST, "crashed", "socket.__new__ is not allowed"),
        ("import subprocess\nsubprocess.run(['true'])", FAST, "crashed", "subprocess.Popen is not allowed"),
    ],
)
def test_python_failures(code, limits, kind, says):
    start = time.monotonic()
    result = _python(ToolRegistry.from_names(["python"], limits), code)
    assert time.monotonic() - start < min(limits.timeout_s, limits.cpu_s) + 2.0
    assert result.error == kind and result.text.startswith("Error:") and says in result.text
    if "before" in code:  # a crash shows the traceback's tail and what was printed
        assert 'File "main.py", line 2, in f' in result.text and "before" in result.text


def test_python_huge_output_is_cut():
    result = _python(ToolRegistry.from_names(["python"], FAST), "print('x' * 10**7)")
    assert result.error == "output_too_long" and result.text.startswith("Error: the output was too long")
    assert len(result.text) <= FAST.max_output_chars and result.text.endswith("x" * 100)


def test_python_temp_dir_is_removed():
    cwd = run_python("import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())", FAST).text.strip()
    assert "megarl-python-tool-" in cwd and not os.path.exists(cwd)
    timed_out = run_python("import os, time\nprint(os.getcwd())\ntime.sleep(100)", FAST)
    cwd = timed_out.text.splitlines()[-1]
    assert timed_out.error == "timeout" and "megarl-python-tool-" in cwd and not os.path.exists(cwd)


def test_registry_survives_failures_counts_them_and_leaves_no_process():
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    registry = ToolRegistry.from_names(["python", "calculator"], FAST)
    codes = ["while True: pass", "x = ' ' * 2**31", "1/0", "print('y' * 10**6)", "print(6 * 7)"]
    calls = [ToolCall("python", {"code": code}, "") for code in codes]
    calls += [ToolCall("calculator", {"expression": "2+"}, ""), ToolCall("search", {}, ""), ToolCall("python", {}, "")]
    results = registry.call_all(calls)
    kinds = ["timeout", "memory", "crashed", "output_too_long", None, "bad_arguments", "unknown_tool", "bad_arguments"]
    assert [r.error for r in results] == kinds
    assert results[4].text == "42\n"
    assert _python(registry, "print('still here')") == ToolResult("still here\n")
    counts = registry.take_counts()
    assert set(counts) == {"calls", *ERROR_KINDS}
    assert counts["calls"] == 9 and counts["bad_arguments"] == 2 and counts["raised"] == 0
    assert all(counts[kind] == 1 for kind in ("timeout", "memory", "crashed", "output_too_long", "unknown_tool"))
    assert registry.take_counts() == dict.fromkeys(counts, 0)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children_before


# ----------------------------------------------------------------------------- user tools

USER_TOOLS = '''
import time


def greet(name: str, times: int = 1) -> str:
    """Greet someone.

    Details the model does not need."""
    return " ".join([f"hello {name}"] * times)


def lookup(key: str, scale: float = 1.0, exact: bool = True):
    """Look a key up."""
    return {"key": key, "values": [scale, exact]}


def fails(x: int):
    raise KeyError(f"no {x}")


def hangs(seconds: float):
    time.sleep(seconds)
    return "done"


def opaque():
    return object()


def chatty():
    return "z" * 10_000


def search(query, limit=5):
    return f"{query}:{limit}"


search.schema = {
    "type": "object",
    "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "enum": [5, 10]}},
    "required": ["query"],
}


def positional(a, /):
    return a
'''


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    (tmp_path / "megarl_test_user_tools.py").write_text(textwrap.dedent(USER_TOOLS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "megarl_test_user_tools", raising=False)
    names = ["greet", "lookup", "fails", "hangs", "opaque", "chatty", "search"]
    return ToolRegistry.from_names([f"megarl_test_user_tools:{n}" for n in names], FAST)


def test_user_tool_schemas(user_tools):
    schemas = {s["function"]["name"]: s for s in user_tools.schemas()}
    assert schemas["greet"] == {
        "type": "function",
        "function": {
            "name": "greet",
            "description": "Greet someone.",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "times": {"type": "integer"}},
                "required": ["name"],
                "additionalProperties": False,
            },
        },
    }
    lookup = schemas["lookup"]["function"]["parameters"]["properties"]
    assert lookup == {"key": {"type": "string"}, "scale": {"type": "number"}, "exact": {"type": "boolean"}}
    assert schemas["search"]["function"]["parameters"]["properties"]["limit"]["enum"] == [5, 10]
    assert schemas["fails"]["function"]["description"] == ""
    assert tool_schema(user_tools.tools["hangs"]) == schemas["hangs"]


def test_user_tool_results(user_tools):
    def call(tool, **arguments):
        return user_tools.call(ToolCall(tool, arguments, ""))

    assert call("greet", name="Ada", times=2) == ToolResult("hello Ada hello Ada")
    assert json.loads(call("lookup", key="k", scale=2).text) == {"key": "k", "values": [2, True]}
    assert call("search", query="q", limit=10) == ToolResult("q:10")
    raised = call("fails", x=3)
    assert raised.error == "raised" and raised.text == "Error: the tool raised KeyError: 'no 3'"
    start = time.monotonic()
    hung = call("hangs", seconds=3)
    assert hung == ToolResult("Error: the tool timed out after 1.0 s.", "timeout")
    assert time.monotonic() - start < 2.0
    assert call("opaque").error == "non_text"
    chatty = call("chatty")
    assert chatty.error == "output_too_long" and len(chatty.text) <= FAST.max_output_chars and "10000 characters" in chatty.text


@pytest.mark.parametrize(
    "name, arguments, says",
    [
        ("greet", {}, "missing required argument(s) 'name'"),
        ("greet", {"name": "a", "loud": True}, "unknown argument(s) 'loud'"),
        ("greet", {"name": 1}, "'name' must be of type string, got integer"),
        ("greet", {"name": "a", "times": 1.5}, "'times' must be of type integer, got number"),
        ("lookup", {"key": "k", "exact": 1}, "'exact' must be of type boolean, got integer"),
        ("search", {"query": "q", "limit": 7}, "must be one of [5, 10]"),
        ("fails", {"x": True}, "'x' must be of type integer, got boolean"),
    ],
)
def test_user_tool_bad_arguments_are_refused_before_the_call(user_tools, name, arguments, says):
    result = user_tools.call(ToolCall(name, arguments, ""))
    assert result.error == "bad_arguments" and result.text.startswith(f"Error: bad arguments for {name}:") and says in result.text


def test_call_all_runs_concurrently_in_order(user_tools):
    calls = [ToolCall("hangs", {"seconds": 0.5}, ""), ToolCall("greet", {"name": "b"}, "")] * 3
    start = time.monotonic()
    results = user_tools.call_all(calls)
    assert time.monotonic() - start < 1.4
    assert [r.text for r in results] == ["done", "hello b"] * 3


@pytest.mark.parametrize(
    "names, says",
    [
        (["foo"], "'foo' is not a built-in (calculator, python) nor 'module:function'"),
        (["megarl_no_such_module_xyz:f"], "'megarl_no_such_module_xyz:f' could not be loaded"),
        (["megarl_test_user_tools:missing"], "has no attribute 'missing'"),
        (["megarl_test_user_tools:positional"], "cannot be passed by keyword"),
        (["calculator", "calculator"], "two tools are named 'calculator'"),
    ],
)
def test_bad_tool_names_fail_early(user_tools, names, says):
    with pytest.raises(ValueError) as info:
        ToolRegistry.from_names(names)
    assert says in str(info.value)


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ToolLimits(timeout_s=0)
