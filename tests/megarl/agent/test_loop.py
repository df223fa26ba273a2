"""The agent loop with a scripted policy (its replies forced, tool calls included): trajectories,
loss masks and tool outputs are exactly what the chat template renders for the same conversation,
limits end trajectories as they say, and the prefix check catches a re-tokenised conversation."""

import json

import pytest

from megarl.agent import AgentLoop, AgentSettings, ToolLimits, ToolRegistry, trajectory_metrics
from megarl.data.chat import turn_suffix_ids
from model_specs.tokenizer import char_tokenizer

TOOLS = ToolRegistry.from_names(["calculator", "python"], ToolLimits(timeout_s=2.0, memory_mb=256))
QUESTION = [{"role": "user", "content": "What is 6*7+1?"}]


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer("chatml")


def scripted(tokenizer, replies: dict[int, list[str]], finish_reasons: dict | None = None):
    """A policy on one engine whose reply to trajectory i's turn k is ``replies[i][k - 1]`` (each
    token's log-prob -0.5); records the inputs it was given."""
    seen = []

    def generate(inputs, params):
        outputs = []
        for engine_inputs, engine_params in zip(inputs, params):
            outs = []
            for ids, p in zip(engine_inputs, engine_params):
                i, turn = p["trajectory"], sum(1 for s in seen if s[0] == p["trajectory"]) + 1
                seen.append((i, list(ids)))
                reply = tokenizer.encode(replies[i][turn - 1], add_special_tokens=False)[: p["max_new_tokens"]]
                reason = (finish_reasons or {}).get((i, turn), "stop")
                outs.append({"output_ids": reply, "output_logprobs": [-0.5] * len(reply), "finish_reason": reason})
            outputs.append(outs)
        return outputs

    return generate, seen


class Tagged(AgentLoop):
    """Tells the scripted policy which trajectory each request belongs to."""

    def _turn_params(self, t, sampling_params):
        return dict(super()._turn_params(t, sampling_params), trajectory=t.prompt_ids[-1] - 1000)


def prompt(tokenizer, i: int) -> list[int]:
    ids = tokenizer.apply_chat_template(QUESTION, tools=TOOLS.schemas(), add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(ids, add_special_tokens=False) + [1000 + i]  # a tag token the policy reads back


def run(tokenizer, replies, finish_reasons=None, loop_cls=Tagged, **settings):
    loop = loop_cls(tokenizer, TOOLS, AgentSettings(**{"max_turns": 4, "max_total_tokens": 2000, **settings}))
    generate, seen = scripted(tokenizer, replies, finish_reasons)
    prompts = [prompt(tokenizer, i) for i in range(len(replies))]
    trajectories = loop.run(generate, prompts, [0] * len(prompts), 1, {"max_new_tokens": 500, "temperature": 1.0})
    return trajectories, seen


def test_three_turns_equal_the_templates_rendering_with_exact_masks(tokenizer):
    replies = {0: [call("calculator", expression="6*7") + "<|im_end|>",
                   call("python", code="print(42 + 1)") + "<|im_end|>",
                   "The answer is 43.<|im_end|>"]}
    TOOLS.take_counts()
    [t], seen = run(tokenizer, replies)
    assert (t.turns, t.finish) == (3, "stop")
    assert [(c["name"], c["output"], c["error"]) for c in t.tool_calls] == [("calculator", "42", None),
                                                                              ("python", "43\n", None)]
    # The oracle: the template's own rendering of the whole conversation.
    conversation = QUESTION + [{"role": "assistant", "content": replies[0][0][: -len("<|im_end|>")]},
                               {"role": "tool", "content": "42"},
                               {"role": "assistant", "content": replies[0][1][: -len("<|im_end|>")]},
                               {"role": "tool", "content": "43\n"},
                               {"role": "assistant", "content": "The answer is 43."}]
    text = tokenizer.apply_chat_template(conversation, tools=TOOLS.schemas(), tokenize=False)
    prompt_text = tokenizer.decode(t.prompt_ids[:-1], skip_special_tokens=False)
    response_text = tokenizer.decode(t.response_ids, skip_special_tokens=False)
    assert prompt_text + response_text == text.rstrip("\n")  # the last reply's "\n" is never sampled
    policy = "".join(tokenizer.decode([tok], skip_special_tokens=False)
                     for tok, m in zip(t.response_ids, t.loss_mask) if m)
    assert policy == "".join(replies[0])
    assert t.logprobs == [-0.5 if m else 0.0 for m in t.loss_mask]
    assert len(t.loss_mask) == len(t.logprobs) == len(t.response_ids)
    # each turn's input extended the previous one; turns 2 and 3 started with the tool outputs
    assert [len(ids) for _, ids in seen] == sorted(len(ids) for _, ids in seen)
    assert all(later[: len(earlier)] == earlier for (_, earlier), (_, later) in zip(seen, seen[1:]))
    counts = TOOLS.take_counts()
    assert counts["calls"] == 2 and sum(v for k, v in counts.items() if k != "calls") == 0
    metrics = trajectory_metrics([t], counts)
    assert metrics["multi_turn/turns_mean"] == 3 and metrics["multi_turn/finish/stop"] == 1


def test_tool_errors_reach_the_model_and_limits_end_trajectories(tokenizer):
    forever = [call("calculator", expression="1+1") + "<|im_end|>"] * 4
    replies = {0: [call("nope") + "<|im_end|>", "<tool_call>\n{bad json\n</tool_call><|im_end|>", "done<|im_end|>"],
               1: forever, 2: forever, 3: ["thinking and thinking"]}
    trajectories, _ = run(tokenizer, replies, finish_reasons={(3, 1): "length"}, max_turns=3)
    errors, looping, _, cut = trajectories
    assert (errors.finish, errors.turns) == ("stop", 3)
    assert [c["error"] for c in errors.tool_calls] == ["unknown_tool", "unparsable"]
    shown = tokenizer.decode(errors.response_ids, skip_special_tokens=False)
    assert shown.count("Error:") == 2 and "nope" in shown
    assert (looping.finish, looping.turns, len(looping.tool_calls)) == ("max_turns", 3, 2)
    assert (cut.finish, cut.turns, cut.tool_calls) == ("length", 1, [])
    # a token budget that leaves no room for the tool output after the first call
    [short], _ = run(tokenizer, {0: forever}, max_total_tokens=len(forever[0]) + 5)
    assert (short.finish, short.turns) == ("max_tokens", 1)
    assert short.loss_mask == [1] * len(short.response_ids)


class Retokenising(Tagged):
    """Builds each turn's input by decoding the conversation to text and encoding it again, as a
    loop that re-applies the chat template to messages does."""

    def continuation(self, t, messages, sampled_text):
        suffix = turn_suffix_ids(self.tokenizer, messages, sampled_text=sampled_text, finished=True,
                                 tools=self.schemas)
        text = self.tokenizer.decode(t.ids + suffix, skip_special_tokens=False)
        return self.tokenizer.encode(text, add_special_tokens=False)


def test_prefix_check_catches_a_retokenised_conversation(tokenizer):
    # The policy writes "<|im_end|>" character by character: its text re-encodes as ONE special
    # token, so the re-tokenised conversation no longer holds the ids the policy sampled.
    spelled = [tokenizer.convert_tokens_to_ids(ch) for ch in "<|im_end|>"]
    reply = tokenizer.decode(tokenizer.encode(call("calculator", expression="2+2"), add_special_tokens=False)
                             + spelled, skip_special_tokens=False)

    def by_characters(tok):
        class CharTokenizer:  # the policy's sampled ids: the reply one character at a time
            def encode(self, text, add_special_tokens=False):
                return [tok.convert_tokens_to_ids(ch) for ch in text]

        return CharTokenizer()

    loop = Retokenising(tokenizer, TOOLS, AgentSettings(max_turns=3, max_total_tokens=2000))
    generate, _ = scripted(by_characters(tokenizer), {0: [reply, "ok<|im_end|>"]})
    [t] = loop.run(generate, [prompt(tokenizer, 0)], [0], 1, {"max_new_tokens": 500})
    assert (t.finish, t.turns) == ("mismatch", 1)
    # the same policy under the token-in/token-out continuation carries on
    generate, _ = scripted(by_characters(tokenizer), {0: [reply, "ok"]})
    [t] = Tagged(tokenizer, TOOLS, AgentSettings(max_turns=3, max_total_tokens=2000)).run(
        generate, [prompt(tokenizer, 0)], [0], 1, {"max_new_tokens": 500})
    assert (t.finish, t.turns) == ("stop", 2)
