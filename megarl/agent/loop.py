"""Multi-turn rollouts with tool calls, token-in / token-out.

A trajectory starts from a prompt's token ids. Each turn the policy samples a reply on the
engine the trajectory is bound to (engine affinity: its earlier turns sit in that engine's prefix
cache); the sampled ids and their log-probs are kept as they are, never re-tokenised. If the reply
calls tools, they run (``megarl.agent.tools``: errors become messages to the model, never
exceptions), and their outputs are tokenised once, as the chat template puts them after an
assistant turn (``megarl.data.chat.turn_suffix_ids``), and appended with loss mask 0. The next
turn's input must extend the previous one exactly (``check_extends``): a continuation that
re-renders the conversation and so changes tokens the policy already produced ends the
trajectory and is counted, instead of training on tokens the policy never sampled.

A trajectory ends when a reply calls no tool ("stop"), is cut by ``rollout.max_new_tokens``
("length"), after ``max_turns`` replies ("max_turns"), when the next input would pass
``max_total_tokens`` after the prompt ("max_tokens"), or on a prefix mismatch ("mismatch").
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from megarl.agent.tools import ToolRegistry, parse_tool_calls
from megarl.data.chat import PrefixMismatchError, check_extends, turn_suffix_ids

logger = logging.getLogger(__name__)

# generate(per_engine_inputs, per_engine_params) -> per engine, one output dict per input
# (``output_ids``, ``output_logprobs``, ``finish_reason``), as ``RolloutWorker.generate`` returns.
Generate = Callable[[list[list[list[int]]], list[list[dict]]], list[list[dict]]]


@dataclass(frozen=True)
class AgentSettings:
    max_turns: int = 4
    max_total_tokens: int = 256  # tokens after the prompt: every turn and tool output
    tool_format: str = "hermes"
    chat_template: str | None = None  # the template the prompts were rendered with (None: the tokenizer's)


@dataclass
class Trajectory:
    """One multi-turn sample: ``ids`` = prompt + everything after it; ``loss_mask`` and
    ``logprobs`` are aligned with the tokens after the prompt (1 / the engine's log-prob on
    sampled tokens, 0 on tool outputs and template tokens)."""

    prompt_ids: list[int]
    engine: int
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: list[dict] = field(default_factory=list)  # {"turn", "name", "arguments", "error", "output"}
    finish: str = ""

    def __post_init__(self):
        self.ids = self.ids or list(self.prompt_ids)

    @property
    def response_ids(self) -> list[int]:
        return self.ids[len(self.prompt_ids):]


class AgentLoop:
    """Runs trajectories over the engines, all of a turn's requests at once (one batch per engine)."""

    def __init__(self, tokenizer, tools: ToolRegistry, settings: AgentSettings):
        self.tokenizer, self.tools, self.settings = tokenizer, tools, settings
        self.schemas = tools.schemas()

    def run(self, generate: Generate, prompts: list[list[int]], engines: list[int], num_engines: int,
            sampling_params: dict) -> list[Trajectory]:
        """Trajectories of ``prompts`` (``engines[i]``: the engine of prompt i), in order."""
        trajectories = [Trajectory(list(p), e) for p, e in zip(prompts, engines)]
        active = list(trajectories)
        for turn in range(1, self.settings.max_turns + 1):
            requests: list[list[Trajectory]] = [[] for _ in range(num_engines)]
            for t in active:
                requests[t.engine].append(t)
            params = [[self._turn_params(t, sampling_params) for t in group] for group in requests]
            outputs = generate([[t.ids for t in group] for group in requests], params)
            replies = [(t, out) for group, outs in zip(requests, outputs) for t, out in zip(group, outs)]
            calling = []
            for t, out in replies:
                t.turns = turn
                sampled = list(out["output_ids"])
                t.ids += sampled
                t.loss_mask += [1] * len(sampled)
                t.logprobs += [float(x) for x in out["output_logprobs"][: len(sampled)]]
                text = self.tokenizer.decode(sampled, skip_special_tokens=False)
                calls, errors = parse_tool_calls(text, self.settings.tool_format)
                finished = out["finish_reason"] != "length"
                if not finished:
                    t.finish = "length"
                elif not calls and not errors:
                    t.finish = "stop"
                elif turn == self.settings.max_turns:
                    t.finish = "max_turns"
                else:
                    calling.append((t, text, calls, errors))
            self._answer_calls(calling, turn)
            active = [t for t in active if not t.finish]
            if not active:
                break
        for t in active:
            t.finish = t.finish or "max_turns"
        return trajectories

    def _turn_params(self, t: Trajectory, sampling_params: dict) -> dict:
        room = self.settings.max_total_tokens - len(t.response_ids)
        return dict(sampling_params, max_new_tokens=max(1, min(sampling_params["max_new_tokens"], room)))

    def _answer_calls(self, calling: list[tuple], turn: int) -> None:
        """Run every calling trajectory's tools (concurrently) and append their outputs."""
        if not calling:
            return
        with ThreadPoolExecutor(max_workers=min(16, len(calling))) as pool:
            results = list(pool.map(lambda c: self.tools.call_all(c[2]), calling))
        for (t, text, calls, errors), outcomes in zip(calling, results):
            messages = [{"role": "tool", "name": call.name, "content": result.text}
                        for call, result in zip(calls, outcomes)]
            messages += [{"role": "tool", "content": f"Error: {error}"} for error in errors]
            t.tool_calls += [{"turn": turn, "name": call.name, "arguments": call.arguments, "error": result.error,
                              "output": result.text} for call, result in zip(calls, outcomes)]
            t.tool_calls += [{"turn": turn, "name": None, "arguments": None, "error": "unparsable", "output": error}
                             for error in errors]
            try:
                following = self.continuation(t, messages, text)
                check_extends(t.ids, following, self.tokenizer, what=f"turn {turn + 1}'s input")
            except PrefixMismatchError as exc:
                logger.warning("trajectory ended: %s", exc)
                t.finish = "mismatch"
                continue
            added = following[len(t.ids):]
            if len(t.response_ids) + len(added) >= self.settings.max_total_tokens:
                t.finish = "max_tokens"  # no room left for another reply
                continue
            t.ids = following
            t.loss_mask += [0] * len(added)
            t.logprobs += [0.0] * len(added)

    def continuation(self, t: Trajectory, messages: list[dict], sampled_text: str) -> list[int]:
        """The next turn's input after ``t``'s last reply and the ``messages`` answering it: its
        ids so far, then the tool messages as the template renders them after an assistant turn
        (tokenised once) and the next generation prompt. A subclass may build it otherwise (an
        environment with its own renderer); it must extend ``t.ids``."""
        return t.ids + turn_suffix_ids(self.tokenizer, messages, sampled_text=sampled_text, finished=True,
                                       chat_template=self.settings.chat_template, tools=self.schemas)


def trajectory_metrics(trajectories: list[Trajectory], tool_counts: dict[str, int]) -> dict[str, float]:
    """``multi_turn/*``: turns per trajectory, tool calls and errors per kind, how trajectories ended."""
    n = max(len(trajectories), 1)
    metrics = {"multi_turn/turns_mean": sum(t.turns for t in trajectories) / n,
               "multi_turn/tool_calls_per_trajectory": sum(len(t.tool_calls) for t in trajectories) / n}
    for kind, count in tool_counts.items():
        metrics[f"multi_turn/tools/{kind}"] = float(count)
    for finish in ("stop", "length", "max_turns", "max_tokens", "mismatch"):
        metrics[f"multi_turn/finish/{finish}"] = sum(t.finish == finish for t in trajectories) / n
    return metrics
