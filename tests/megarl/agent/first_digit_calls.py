"""A tool-call format for runs of tiny random models (imported by a run config's ``imports``): a
reply that holds a digit calls the calculator on that digit plus one, so that every trajectory of
an untrained policy has tool calls to run and tool outputs to mask."""

from megarl.agent import TOOL_CALL_FORMATS, ToolCall


def first_digit_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    digit = next((ch for ch in text if ch.isdigit()), None)
    return ([ToolCall("calculator", {"expression": f"{digit}+1"}, digit)] if digit else []), []


TOOL_CALL_FORMATS["first_digit"] = first_digit_calls
