"""The one exception of the config package, and how a value is shown in a message."""

from __future__ import annotations

import json
from typing import Any, Iterable


class ConfigError(ValueError):
    """A run configuration that cannot work. ``str(error)`` is one self-contained line per
    problem (dotted key, bad value, fix); ``error.problems`` is the list of those lines."""

    def __init__(self, problems: str | Iterable[str]):
        problems = [problems] if isinstance(problems, str) else list(problems)
        # One line per problem, whatever the wrapped messages looked like.
        self.problems = [" ".join(str(p).split()) for p in problems]
        super().__init__("\n".join(self.problems))


def show(value: Any, limit: int = 80) -> str:
    """A value as it would be written in YAML/JSON (strings quoted, null, true/false), shortened."""
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
