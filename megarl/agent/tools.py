"""Tools for multi-turn agentic rollouts: parse the model's tool calls, run them, give back text.

* ``parse_tool_calls(text, fmt)``: the ``ToolCall``s in one assistant turn, plus one error message
  per malformed call (never an exception, so a bad call becomes feedback for the model).
* ``Tool``: a name, a description, a JSON schema of its arguments and ``__call__(arguments,
  limits) -> ToolResult``; ``tool_schema(tool)`` is the OpenAI-style dict that
  ``tokenizer.apply_chat_template(tools=...)`` takes.
* Built-ins: ``calculator`` (safe arithmetic with ``ast``) and ``python`` (code in a fresh,
  limited interpreter: ``megarl.agent.sandbox``). User tools are ``"module:function"`` strings.
* ``ToolRegistry``: runs calls by name, never raises, keeps every result within
  ``ToolLimits.max_output_chars`` and counts calls and errors per kind.

A failed call is a ``ToolResult`` whose ``error`` is one of ``ERROR_KINDS`` and whose text, shown
to the model, starts with ``"Error:"`` and says what happened.
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from megarl.agent.sandbox import ERROR_KINDS, ToolLimits, ToolResult, run_python, too_long
from megarl.rewards.registry import load_reward_function

_MAX_CONCURRENT_CALLS = 8  # call_all's thread pool width


# ----------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ToolCall:
    """One tool call: the tool's name, its arguments, and the exact text the model wrote for it."""

    name: str
    arguments: dict
    raw: str


def _json_type(value) -> str:
    """The JSON type name of a parsed JSON value, for messages."""
    for python_type, name in (
        (bool, "boolean"),
        (int, "integer"),
        (float, "number"),
        (str, "string"),
        (list, "array"),
        (dict, "object"),
    ):
        if isinstance(value, python_type):
            return name
    return "null" if value is None else type(value).__name__


def _hermes_call(body: str, raw: str) -> tuple[ToolCall | None, str | None]:
    """The call in one ``<tool_call>`` body, or the problem with it."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    if not isinstance(obj, dict):
        return None, f'expected a JSON object with "name" and "arguments", got a JSON {_json_type(obj)}'
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, 'missing "name" (a non-empty string)'
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return None, f'"arguments" of {name!r} is a string that is not valid JSON ({exc.msg})'
    if not isinstance(arguments, dict):
        return None, f'"arguments" of {name!r} must be a JSON object, got a JSON {_json_type(arguments)}'
    return ToolCall(name, arguments, raw), None


def _parse_hermes(text: str) -> tuple[list[ToolCall], list[str]]:
    """Hermes / Qwen2.5 / Qwen3 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = index = 0
    while (start := text.find(open_tag, pos)) != -1:
        index += 1
        body_start = start + len(open_tag)
        end = text.find(close_tag, body_start)
        next_open = text.find(open_tag, body_start)
        if end == -1 or next_open != -1 and next_open < end:
            errors.append(f"tool call {index}: {open_tag} is not closed by {close_tag}")
            if end == -1:
                break
            pos = next_open
            continue
        pos = end + len(close_tag)
        call, error = _hermes_call(text[body_start:end], text[start:pos])
        if call is not None:
            calls.append(call)
        else:
            errors.append(f"tool call {index}: {error}")
    return calls, errors


# Format name -> parser of one assistant turn's text; add formats here.
TOOL_CALL_FORMATS: dict[str, Callable[[str], tuple[list[ToolCall], list[str]]]] = {"hermes": _parse_hermes}


def parse_tool_calls(text: str, fmt: str = "hermes") -> tuple[list[ToolCall], list[str]]:
    """Tool calls in one assistant turn's text, and one error message per malformed call."""
    parser = TOOL_CALL_FORMATS.get(fmt)
    if parser is None:
        raise ValueError(f"unknown tool call format {fmt!r}; known formats: {sorted(TOOL_CALL_FORMATS)}")
    return parser(text)


# ----------------------------------------------------------------------------- tools

_TYPE_CHECKS: dict[str, Callable[[object], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def check_arguments(arguments, schema: dict) -> str | None:
    """The problem with ``arguments`` under an object JSON schema, or None if they fit.

    Checks what a wrong call usually gets wrong: required keys, unknown keys (refused unless
    ``additionalProperties`` is set), each value's ``type`` and ``enum``; nested values are not
    checked.
    """
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got a JSON {_json_type(arguments)}"
    properties = schema.get("properties", {})
    missing = [key for key in schema.get("required", []) if key not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(map(repr, missing))}"
    if schema.get("additionalProperties", False) is False:
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"unknown argument(s) {', '.join(map(repr, unknown))}; the arguments are {sorted(properties)}"
    for key, value in arguments.items():
        spec = properties.get(key, {})
        types = spec.get("type", [])
        types = [types] if isinstance(types, str) else types
        if types and not any(_TYPE_CHECKS.get(t, lambda v: True)(value) for t in types):
            return f"argument {key!r} must be of type {' or '.join(types)}, got {_json_type(value)}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}, got {value!r}"
    return None


class Tool:
    """A tool the model can call. Subclasses set ``name``, ``description`` and ``parameters`` (a
    JSON schema of the arguments object) and implement ``run``; ``__call__`` checks the
    arguments against ``parameters`` first, so ``run`` only sees arguments that fit."""

    name: str
    description: str
    parameters: dict

    def __call__(self, arguments: dict, limits: ToolLimits) -> ToolResult:
        problem = check_arguments(arguments, self.parameters)
        if problem is not None:
            return ToolResult(f"Error: bad arguments for {self.name}: {problem}.", "bad_arguments")
        return self.run(arguments, limits)

    def run(self, arguments: dict, limits: ToolLimits) -> ToolResult:
        raise NotImplementedError


def tool_schema(tool: Tool) -> dict:
    """The OpenAI-style function schema of ``tool``, as ``apply_chat_template(tools=...)`` takes it."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}


# ----------------------------------------------------------------------------- calculator

_MAX_EXPRESSION_CHARS = 1000
_MAX_INT_BITS = 10_000  # about 3000 decimal digits; bounds ** and * so 9**9**9 fails at once
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class _Refused(ValueError):
    """The expression uses something the calculator does not evaluate."""


def _too_big(op: ast.operator, left, right) -> bool:
    if not (isinstance(left, int) and isinstance(right, int)):
        return False  # float overflow raises OverflowError by itself
    if isinstance(op, ast.Pow):
        return right > 0 and abs(left) > 1 and left.bit_length() * right > _MAX_INT_BITS
    if isinstance(op, ast.Mult):
        return left.bit_length() + right.bit_length() > _MAX_INT_BITS
    return False


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if _too_big(node.op, left, right):
            raise OverflowError(f"the result would have more than {_MAX_INT_BITS} bits")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        return value
    raise _Refused(f"{ast.unparse(node)[:60]!r} is not allowed: only numbers, + - * / // % **, unary - and parentheses")


def calculate(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely: numbers, ``+ - * / // % **``, unary ``-``/``+`` and
    parentheses; no names, calls or attributes. ``_Refused``/SyntaxError for other syntax,
    ArithmeticError/ValueError for what cannot be computed (e.g. a result that would be huge)."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise _Refused(f"the expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    return _evaluate(ast.parse(expression.strip(), mode="eval").body)


class CalculatorTool(Tool):
    """Built-in ``calculator``: evaluates an arithmetic expression (see ``calculate``)."""

    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. (3 + 4) * 2 ** 10."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "the arithmetic expression"}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    def run(self, arguments: dict, limits: ToolLimits) -> ToolResult:
        try:
            value = calculate(arguments["expression"])
        except SyntaxError as exc:
            return ToolResult(f"Error: not a valid expression: {exc.msg}.", "bad_arguments")
        except _Refused as exc:
            return ToolResult(f"Error: not a valid expression: {exc}.", "bad_arguments")
        except RecursionError:
            return ToolResult("Error: not a valid expression: it is nested too deeply.", "bad_arguments")
        except (ArithmeticError, ValueError) as exc:
            return ToolResult(f"Error: {type(exc).__name__}: {exc}.", "raised")
        return ToolResult(str(value) if isinstance(value, int) else repr(value))


class PythonTool(Tool):
    """Built-in ``python``: runs the code in a fresh sandboxed interpreter (``sandbox.run_python``)
    and returns what it printed."""

    name = "python"
    description = (
        "Run a Python 3 program and return what it prints to stdout. Each call starts a fresh interpreter "
        "with no network, so print the values you need; nothing is kept between calls."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the Python program to run"}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def run(self, arguments: dict, limits: ToolLimits) -> ToolResult:
        return run_python(arguments["code"], limits)


# ----------------------------------------------------------------------------- user tools

_JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array", "dict": "object"}


def _signature_schema(fn: Callable, label: str) -> dict:
    """An arguments schema from ``fn``'s signature: str/int/float/bool/list/dict annotations give the
    type, parameters without defaults are required, ``**kwargs`` allows other keys."""
    try:
        signature = inspect.signature(fn, eval_str=True)
    except NameError:  # an annotation names something not importable here; types are then unknown
        signature = inspect.signature(fn)
    properties: dict[str, dict] = {}
    required: list[str] = []
    extra = False
    for param in signature.parameters.values():
        if param.kind is param.VAR_KEYWORD:
            extra = True
        elif param.kind in (param.POSITIONAL_ONLY, param.VAR_POSITIONAL):
            raise ValueError(
                f"tool {label}: parameter {param.name!r} cannot be passed by keyword; tools are called with keywords"
            )
        else:
            annotation = param.annotation
            json_type = _JSON_TYPES.get(annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""))
            properties[param.name] = {"type": json_type} if json_type else {}
            if param.default is param.empty:
                required.append(param.name)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": extra}


class FunctionTool(Tool):
    """A user's Python function as a tool, called with the arguments as keywords.

    Schema: the function's ``schema`` attribute (a JSON schema of the arguments object) if it has
    one, else derived from its signature; description: the docstring's first line. A ``str``
    result is shown as is, another JSON-serialisable one (dict, list, number) as JSON.

    The function runs in this process, in a daemon thread joined with the wall-time limit: user
    tools are trusted code the user wrote, often stateful (a retriever, an environment handle)
    and cheap, so they get no interpreter start-up or pickling per call. A call past the limit
    gives a ``timeout`` result and its thread is abandoned: it keeps running in the background,
    since Python cannot stop a thread. Untrusted code belongs in the ``python`` tool's sandbox.
    """

    def __init__(self, fn: Callable, label: str | None = None):
        label = label or getattr(fn, "__qualname__", repr(fn))
        schema = getattr(fn, "schema", None)
        if schema is not None and not isinstance(schema, dict):
            raise ValueError(f"tool {label}: its 'schema' attribute must be a JSON schema dict, got {type(schema).__name__}")
        self.fn = fn
        self.name = getattr(fn, "__name__", None) or label.rpartition(":")[2]
        self.description = (inspect.getdoc(fn) or "").strip().split("\n")[0]
        self.parameters = schema if schema is not None else _signature_schema(fn, label)

    def run(self, arguments: dict, limits: ToolLimits) -> ToolResult:
        outcome: dict = {}

        def target() -> None:
            try:
                outcome["value"] = self.fn(**arguments)
            except BaseException as exc:  # noqa: BLE001 - a tool's failure is a result for the model
                outcome["error"] = exc

        thread = threading.Thread(target=target, daemon=True, name=f"megarl-tool-{self.name}")
        thread.start()
        thread.join(limits.timeout_s)
        if thread.is_alive():
            return ToolResult(f"Error: the tool timed out after {limits.timeout_s} s.", "timeout")
        if "error" in outcome:
            exc = outcome["error"]
            return ToolResult(f"Error: the tool raised {type(exc).__name__}: {exc}", "raised")
        value = outcome["value"]
        if isinstance(value, str):
            return ToolResult(value)
        try:
            return ToolResult(json.dumps(value))
        except (TypeError, ValueError):
            return ToolResult(f"Error: the tool returned a {type(value).__name__}, which is neither text nor JSON.", "non_text")


# ----------------------------------------------------------------------------- registry

BUILTIN_TOOLS: dict[str, type[Tool]] = {"calculator": CalculatorTool, "python": PythonTool}


def _zero_counts() -> dict[str, int]:
    return {"calls": 0, **{kind: 0 for kind in ERROR_KINDS}}


class ToolRegistry:
    """The tools of a rollout, by name. ``call`` never raises: an unknown tool, bad arguments, an
    exception, a timeout or too much output all become a ``ToolResult`` with an ``error`` kind,
    whose text is cut to ``limits.max_output_chars``. ``counts`` holds ``"calls"`` and a count per
    error kind since the last ``take_counts()``."""

    def __init__(self, tools: list[Tool], limits: ToolLimits = ToolLimits()):  # noqa: B008 - frozen, immutable
        self.limits = limits
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"tools: two tools are named {tool.name!r}; tool names must be unique")
            self.tools[tool.name] = tool
        self.counts = _zero_counts()
        self._lock = threading.Lock()

    @classmethod
    def from_names(cls, names: list[str], limits: ToolLimits = ToolLimits()) -> ToolRegistry:  # noqa: B008
        """Tools by name: the built-ins ``"calculator"`` and ``"python"``, or user functions as
        ``"package.module:function"`` / ``"path/to/file.py:function"``. A name that is neither, or
        a function that cannot be imported, is a ValueError here, before any rollout."""
        tools: list[Tool] = []
        for name in names:
            if name in BUILTIN_TOOLS:
                tools.append(BUILTIN_TOOLS[name]())
            elif isinstance(name, str) and ":" in name:
                try:
                    fn = load_reward_function(name)
                except ValueError as exc:
                    raise ValueError(f"tools: {name!r} could not be loaded: {exc}") from exc
                tools.append(FunctionTool(fn, label=name))
            else:
                raise ValueError(
                    f"tools: {name!r} is not a built-in ({', '.join(BUILTIN_TOOLS)}) nor 'module:function'; "
                    "name a built-in or a function as 'package.module:function'"
                )
        return cls(tools, limits)

    def schemas(self) -> list[dict]:
        """The tools' schemas, for ``apply_chat_template(tools=...)``."""
        return [tool_schema(tool) for tool in self.tools.values()]

    def call(self, call: ToolCall) -> ToolResult:
        """Run one call; never raises."""
        tool = self.tools.get(call.name)
        if tool is None:
            result = ToolResult(
                f"Error: there is no tool named {call.name!r}; the tools are {sorted(self.tools)}.", "unknown_tool"
            )
        else:
            try:
                result = tool(call.arguments, self.limits)
            except Exception as exc:  # noqa: BLE001 - a tool's failure is a result for the model
                result = ToolResult(f"Error: the tool raised {type(exc).__name__}: {exc}", "raised")
        max_chars = self.limits.max_output_chars
        if len(result.text) > max_chars:
            if result.error is None:
                result = too_long(result.text, f"{len(result.text)} characters", max_chars)
            else:
                result = ToolResult(result.text[:max_chars], result.error)
        with self._lock:
            self.counts["calls"] += 1
            if result.error is not None:
                self.counts[result.error] = self.counts.get(result.error, 0) + 1
        return result

    def call_all(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Run several calls concurrently (a thread pool); results in the order of ``calls``."""
        if len(calls) <= 1:
            return [self.call(call) for call in calls]
        with ThreadPoolExecutor(max_workers=min(len(calls), _MAX_CONCURRENT_CALLS), thread_name_prefix="megarl-tools") as pool:
            return list(pool.map(self.call, calls))

    def take_counts(self) -> dict[str, int]:
        """The counts since the last call (``"calls"`` and one per error kind), reset to zero."""
        with self._lock:
            counts, self.counts = self.counts, _zero_counts()
        return counts
