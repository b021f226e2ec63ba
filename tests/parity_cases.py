"""The requests of the serving parity test (``test_serve_parity.py``): every
sampling option a client can send on ``/v1/chat/completions`` and
``/v1/completions``, valid and malformed, each as one :class:`Case`.

A case says what must be the same on a server without speculation and on
one with ``adaptive_tree``: always the status and, for a refusal, the error
message; with ``same_text`` also every choice's text, finish reason and
token counts (greedy requests: a seeded sampled request gets trees, whose
rows draw from its generator in the verifier's own order, so its text is a
draw from the same law, not the same draw).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Answers that copy their prompt, so that the retrieval drafter drafts (and trees are verified) from the first steps.
CODE = [{"role": "user", "content": "Add a docstring to this function and show the whole function:\n```python\n"
         "def squares(numbers):\n    result = []\n    for number in numbers:\n        result.append(number * number)\n"
         "    return result\n```"}]
FACTS = [{"role": "user", "content": "List three facts about the Moon, one per line."}]
COLORS = [{"role": "user", "content": "List three colors, comma separated."}]
REPEAT = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog. "
           "The quick brown fox jumps over the lazy dog."}]
FOX = {"choice": ["the quick brown fox", "the lazy dog"]}
EXTRACT = [{"role": "user", "content": "Alice is 31 and lives in Paris. Give her name and age as JSON."}]
PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
          "def fibonacci_memo(n, memo={}):\n")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
GREEDY = {"temperature": 0, "max_tokens": 32}
SAMPLED = {"temperature": 0.8, "max_tokens": 32}
# Token ids of the demo model's tokenizer (SmolLM2): "Here", " the", " a", "```", "\n", "<|im_end|>".
HERE, THE, A, FENCE, NEWLINE, IM_END = 4590, 260, 253, 3725, 198, 2


@dataclass(frozen=True)
class Case:
    name: str
    endpoint: str  # "chat" or "completions"
    body: dict  # without "model"
    same_text: bool = False
    # The plugin's own request option with a bad value: the server without speculation ignores
    # it (vLLM ignores keys of ``vllm_xargs`` it does not know), the tree server refuses it with
    # HTTP 400 and a message that matches this.
    plugin_refusal: str | None = None
    # Sent after the others, alone: vLLM gives every request of a step in which any request asks
    # for ``logprob_token_ids`` that layout (no top logprobs), so such a request would change its
    # neighbours' answers by when it runs.
    alone: bool = field(init=False)
    stream: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stream", bool(self.body.get("stream")))
        object.__setattr__(self, "alone", "logprob_token_ids" in self.body)


def chat(name: str, same_text: bool, messages=CODE, **options) -> Case:
    return Case("chat-" + name, "chat", {"messages": messages, **options}, same_text)


def completion(name: str, same_text: bool, prompt=PROMPT, **options) -> Case:
    return Case("completions-" + name, "completions", {"prompt": prompt, **options}, same_text)


def bad(name: str, **options) -> Case:
    """A malformed chat request: both servers must refuse it the same way."""
    return chat("bad-" + name, False, **{**GREEDY, **options})


VALID = [
    chat("greedy", True, **GREEDY),
    chat("temperature", False, **SAMPLED),
    chat("top_p", False, **SAMPLED, top_p=0.9),
    chat("top_k", False, **SAMPLED, top_k=20),
    chat("min_p-sampled", False, **SAMPLED, min_p=0.1),
    # Hot enough that a seeded draw without min_p parts from one with it (the check that it applies).
    chat("min_p-seeded", False, temperature=1.5, max_tokens=32, min_p=0.5, seed=7),
    chat("seeded-hot", False, temperature=1.5, max_tokens=32, seed=7),
    chat("min_p-greedy", True, **GREEDY, min_p=0.2),
    chat("seed", False, **SAMPLED, seed=11),
    chat("n", False, **SAMPLED, n=2),
    chat("logprobs", True, **GREEDY, logprobs=True, top_logprobs=3),
    chat("prompt_logprobs", True, **GREEDY, prompt_logprobs=2),
    chat("echo", True, **GREEDY, echo=True),
    chat("stop", True, **GREEDY, stop=["\n\n", "return"]),
    chat("stop_token_ids", True, **GREEDY, stop_token_ids=[NEWLINE]),
    chat("include_stop_str_in_output", True, **GREEDY, stop=["return"], include_stop_str_in_output=True),
    chat("max_tokens", True, temperature=0, max_tokens=5),
    chat("max_completion_tokens", True, temperature=0, max_completion_tokens=7),
    chat("facts", True, messages=FACTS, temperature=0, max_tokens=48),
    chat("min_tokens", True, messages=FACTS, temperature=0, max_tokens=48, min_tokens=40),
    chat("ignore_eos", True, messages=FACTS, temperature=0, max_tokens=40, ignore_eos=True),
    # A grammar that has ended, decoded past by ignore_eos (once stopped the engine in xgrammar).
    chat("ignore_eos-regex", True, messages=COLORS, temperature=0, max_tokens=8, ignore_eos=True,
         structured_outputs={"regex": "[a-z]{3,6} [0-9]{2}"}),
    chat("ignore_eos-json_object", True, messages=COLORS, temperature=0, max_tokens=24, ignore_eos=True,
         response_format={"type": "json_object"}),
    # min_tokens beyond what the grammar's strings take: the stop token is all the grammar allows.
    chat("choice-min_tokens", True, messages=REPEAT, temperature=0, max_tokens=16, min_tokens=12,
         structured_outputs=FOX),
    chat("choice-min_tokens-sampled", False, messages=REPEAT, temperature=0.8, n=3, min_tokens=12,
         structured_outputs=FOX),
    chat("speculation-off", True, **GREEDY, vllm_xargs={"speculation": "off"}),
    chat("speculation-on", True, **GREEDY, vllm_xargs={"speculation": "on"}),
    # On FACTS, whose answer repeats its words soon enough for these penalties to change it.
    chat("presence_penalty", True, messages=FACTS, temperature=0, max_tokens=48, presence_penalty=1.5),
    chat("frequency_penalty", True, messages=FACTS, temperature=0, max_tokens=48, frequency_penalty=1.0),
    chat("repetition_penalty", True, **GREEDY, repetition_penalty=1.3),
    chat("logit_bias", True, **GREEDY, logit_bias={str(FENCE): -100, str(HERE): 3}),
    chat("logit_bias-sampled", False, **SAMPLED, logit_bias={str(A): -100}),
    chat("min_p-and-logit_bias", False, **SAMPLED, seed=5, min_p=0.05, logit_bias={str(THE): -100}),
    chat("bad_words", True, **GREEDY, bad_words=["def", " squares"]),
    chat("allowed_token_ids", True, temperature=0, max_tokens=8, allowed_token_ids=[HERE, THE, A, NEWLINE, IM_END]),
    chat("structured-json", True, messages=EXTRACT, **GREEDY, structured_outputs={"json": SCHEMA}),
    chat("structured-regex", True, messages=EXTRACT, **GREEDY, structured_outputs={"regex": "[A-Z][a-z]+ is [0-9]+"}),
    chat("structured-choice", True, messages=EXTRACT, **GREEDY, structured_outputs={"choice": ["Paris", "London"]}),
    chat("structured-grammar", True, messages=EXTRACT, **GREEDY,
         structured_outputs={"grammar": 'root ::= "Alice is " [0-9] [0-9]'}),
    chat("response_format-json_object", True, messages=EXTRACT, **GREEDY, response_format={"type": "json_object"}),
    chat("response_format-json_schema", True, messages=EXTRACT, **GREEDY,
         response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}),
    chat("stream", True, **GREEDY, stream=True),
    chat("stream-usage", True, **GREEDY, stream=True, stream_options={"include_usage": True}),
    chat("stream-sampled", False, **SAMPLED, stream=True, n=2),
    chat("skip_special_tokens", True, **GREEDY, skip_special_tokens=False),
    chat("spaces_between_special_tokens", True, **GREEDY, spaces_between_special_tokens=False),
    chat("truncate_prompt_tokens", True, **GREEDY, truncate_prompt_tokens=12),
    chat("repetition_detection", True, **GREEDY,
         repetition_detection={"max_pattern_size": 4, "min_pattern_size": 1, "min_count": 3}),
    chat("logprob_token_ids", True, **GREEDY, logprobs=True, logprob_token_ids=[HERE, THE]),
    chat("return_token_ids", True, **GREEDY, return_token_ids=True),
    chat("beam_search", True, temperature=0, max_tokens=12, n=2, use_beam_search=True, length_penalty=0.8),
    chat("thinking_token_budget", True, **GREEDY, thinking_token_budget=8),
    chat("watermarking", True, **GREEDY, watermarking=True),
    chat("priority", True, **GREEDY, priority=1),
    chat("cache_salt", True, **GREEDY, cache_salt="parity"),
    chat("continue_final_message", True, temperature=0, max_tokens=16, add_generation_prompt=False,
         continue_final_message=True, messages=[*CODE, {"role": "assistant", "content": "```python\ndef squares("}]),
    completion("greedy", True, **GREEDY),
    completion("echo", True, **GREEDY, echo=True),
    completion("logprobs", True, **GREEDY, logprobs=3),
    completion("echo-logprobs", True, temperature=0, max_tokens=8, echo=True, logprobs=1),
    completion("prompt_logprobs", True, **GREEDY, prompt_logprobs=1),
    completion("stop", True, **GREEDY, stop=["\n\n"]),
    completion("logit_bias", True, **GREEDY, logit_bias={str(NEWLINE): -100}),
    completion("min_p-seeded", False, temperature=1.5, max_tokens=32, min_p=0.5, seed=3),
    completion("penalties", True, **GREEDY, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
    completion("structured-regex", True, **GREEDY, structured_outputs={"regex": "    if n < 2:\n        return n"}),
    completion("n", False, **SAMPLED, n=3),
    completion("stream-usage", True, **GREEDY, stream=True, stream_options={"include_usage": True}),
    completion("token-prompt", True, prompt=[HERE, THE, A, NEWLINE, FENCE], **GREEDY),
    completion("suffix", True, **GREEDY, suffix="    return memo[n]\n"),
    completion("add_special_tokens", True, **GREEDY, add_special_tokens=True),
    completion("beam_search", True, temperature=0, max_tokens=12, n=2, use_beam_search=True),
]

MALFORMED = [
    bad("temperature", temperature=-1),
    bad("top_p", temperature=0.8, top_p=1.5),
    bad("top_k", temperature=0.8, top_k=-5),
    bad("min_p", temperature=0.8, min_p=1.5),
    bad("n", n=0),
    bad("top_logprobs", logprobs=True, top_logprobs=50),
    bad("top_logprobs-without-logprobs", top_logprobs=3),
    bad("prompt_logprobs", prompt_logprobs=-5),
    bad("seed", seed="abc"),
    bad("stop", stop=5),
    bad("stop_token_ids", stop_token_ids=["x"]),
    bad("max_tokens", max_tokens=-1),
    bad("max_tokens-over-context", max_tokens=100_000),
    bad("max_completion_tokens", max_completion_tokens=0),
    bad("min_tokens", max_tokens=8, min_tokens=20),
    bad("presence_penalty", presence_penalty=5),
    bad("frequency_penalty", frequency_penalty=-5),
    bad("repetition_penalty", repetition_penalty=0),
    bad("logit_bias-token", logit_bias={"99999999": 1}),
    bad("logit_bias-value", logit_bias={str(THE): "much"}),
    bad("bad_words", bad_words=5),
    bad("allowed_token_ids", allowed_token_ids=[99_999_999]),
    bad("structured-json", messages=EXTRACT, structured_outputs={"json": {"type": "nonsense"}}),
    bad("structured-regex", messages=EXTRACT, structured_outputs={"regex": "(unclosed"}),
    bad("structured-two-kinds", messages=EXTRACT, structured_outputs={"regex": "a+", "choice": ["a"]}),
    bad("response_format", messages=EXTRACT, response_format={"type": "bogus"}),
    bad("stream_options-without-stream", stream_options={"include_usage": True}),
    bad("truncate_prompt_tokens", truncate_prompt_tokens=-5),
    bad("skip_special_tokens", skip_special_tokens="sometimes"),
    bad("ignore_eos", ignore_eos="x"),
    bad("messages", messages="not a list"),
    Case("chat-bad-speculation", "chat", {"messages": CODE, **GREEDY, "vllm_xargs": {"speculation": "sometimes"}},
         plugin_refusal=r"vllm_xargs\['speculation'\].*'on', 'off', got 'sometimes'"),
    Case("completions-bad-logprobs", "completions", {"prompt": PROMPT, **GREEDY, "logprobs": 50}),
    Case("completions-bad-prompt", "completions", {"prompt": 5, **GREEDY}),
    Case("completions-bad-echo-stream", "completions", {"prompt": PROMPT, **GREEDY, "echo": 3}),
]

CASES = VALID + MALFORMED
