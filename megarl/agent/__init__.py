"""Agentic rollouts: tools the model calls during multi-turn generation.

* ``tools``: ``parse_tool_calls`` (the model's ``<tool_call>`` blocks), ``Tool`` and the
  built-ins ``calculator`` and ``python``, user tools as ``"module:function"``, and
  ``ToolRegistry``, which runs calls by name, never raises and counts errors by kind.
* ``sandbox``: ``run_python``, model-written code in a fresh interpreter with wall-time, CPU,
  memory and output limits, no sockets and no child processes.
* ``loop``: ``AgentLoop``, multi-turn token-in/token-out trajectories over the engines.
"""

from megarl.agent.loop import AgentLoop, AgentSettings, Trajectory, trajectory_metrics
from megarl.agent.sandbox import ERROR_KINDS, ToolLimits, ToolResult, run_python
from megarl.agent.tools import (
    BUILTIN_TOOLS,
    TOOL_CALL_FORMATS,
    CalculatorTool,
    FunctionTool,
    PythonTool,
    Tool,
    ToolCall,
    ToolRegistry,
    calculate,
    check_arguments,
    parse_tool_calls,
    tool_schema,
)

__all__ = [
    "AgentLoop",
    "AgentSettings",
    "Trajectory",
    "trajectory_metrics",
    "BUILTIN_TOOLS",
    "ERROR_KINDS",
    "TOOL_CALL_FORMATS",
    "CalculatorTool",
    "FunctionTool",
    "PythonTool",
    "Tool",
    "ToolCall",
    "ToolLimits",
    "ToolRegistry",
    "ToolResult",
    "calculate",
    "check_arguments",
    "parse_tool_calls",
    "run_python",
    "tool_schema",
]
