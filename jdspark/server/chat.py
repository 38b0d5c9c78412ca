"""DeepSeek-V4 chat encoding (messages -> prompt text) and parsing (completion text -> reasoning,
content, tool calls), written from DeepSeek's `encoding/encoding_dsv4.py` (the V4 preview release).

Layout of a prompt (spec dsv4.md §8; the reference wins where they differ):

    BOS [effort prompt] system [\\n\\n## Tools ...] <｜User｜>user <｜Assistant｜></think>answer EOS
        <｜User｜>user2 <｜Assistant｜><think>           (thinking mode; chat mode ends in </think>)

- An assistant turn is `{reasoning}</think>{content}{tool calls}EOS` in thinking mode when it comes
  after the last user turn (or when thinking is not dropped); turns before the last user turn lose
  their reasoning (nothing before `content`), and chat mode never writes reasoning. The generation
  header after a user turn is `<｜Assistant｜>` + `<think>` (thinking, at or after the last user turn,
  or always when thinking is kept) or `</think>`.
- Tools make the reference keep every turn's reasoning (`drop_thinking` off). OpenAI sends `tools`
  beside the messages; the reference renders them on a system (or developer) message, so we attach
  them to the first system message, inserting an empty one first when there is none.
- There is no `tool` role: consecutive user and tool messages become one user turn, texts and
  `<tool_result>...</tool_result>` blocks joined by blank lines, the results ordered like the calls
  of the preceding assistant turn (by `tool_call_id`).
- `reasoning_effort`: the preview encoder knows `"high"` and `"max"`; only `"max"` (thinking mode)
  prepends its instruction paragraph. The 0731 revision's per-effort prompts are not implemented.
- Tool calls are `\\n\\n<｜DSML｜tool_calls>\\n` + invokes joined by `\\n` + `\\n</｜DSML｜tool_calls>`;
  each invoke `<｜DSML｜invoke name="f">\\n` + parameters joined by `\\n` + `\\n</｜DSML｜invoke>`, and
  a parameter carries `string="true"` (raw text) or `string="false"` (JSON).

The special tokens are plain strings here; a tokenizer that has them as added tokens maps them to
their ids, one that lacks them encodes their characters. Parsing is lenient where the reference
asserts: a completion cut by max_tokens may lack `</think>` (all reasoning) or close a tool-call
block badly (then the block stays in `content`).
"""

from __future__ import annotations

import json
import re

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"\n\n<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"

EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside \
{think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


Piece = tuple[str, bool]  # (text, trusted): the template's own text, or text a client sent


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tools_pieces(functions: list[dict]) -> list[Piece]:
    head, tail = TOOLS_PROMPT.format(dsml=DSML, think=THINK, end_think=END_THINK, schemas="\0").split("\0")
    return [(head, True), ("\n".join(_json(f) for f in functions), False), (tail, True)]


def render_tools(functions: list[dict]) -> str:
    """The tools section for OpenAI function specs (`tools[i].function`), one JSON line each."""
    return "".join(text for text, _ in _tools_pieces(functions))


def _tool_calls_pieces(calls: list[dict]) -> list[Piece]:
    out: list[Piece] = [(f"{TOOL_CALLS_START}\n", True)]
    for n, call in enumerate(calls):
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except (TypeError, ValueError):
            args = None
        if not isinstance(args, dict):  # the reference wraps what is not a JSON object
            args = {"arguments": fn["arguments"]}
        out += [("\n" if n else "", True), (f'<{DSML}invoke name="', True), (fn["name"], False), ('">\n', True)]
        for i, (k, v) in enumerate(args.items()):
            out += [("\n" if i else "", True), (f'<{DSML}parameter name="', True), (k, False),
                    (f'" string="{"true" if isinstance(v, str) else "false"}">', True),
                    (v if isinstance(v, str) else _json(v), False), (f"</{DSML}parameter>", True)]
        out.append((f"\n</{DSML}invoke>", True))
    return out + [(f"\n{TOOL_CALLS_END}", True)]


def render_tool_calls(calls: list[dict]) -> str:
    """OpenAI tool calls ({"function": {"name", "arguments": JSON text}}) as a DSML block."""
    return "".join(text for text, _ in _tool_calls_pieces(calls))


def _merge_user_turns(messages: list[dict]) -> list[dict]:
    """Consecutive user and tool messages -> one user turn of text and `<tool_result>` blocks joined
    by blank lines (as the reference's merge_tool_messages); tool results in the order of the
    preceding assistant turn's calls (matched by tool_call_id). A merged turn's content is a list
    of pieces."""
    merged: list[dict] = []
    order: dict[str, int] = {}  # tool_call_id -> position in the last assistant turn's calls
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            order = {c.get("id"): i for i, c in enumerate(m["tool_calls"]) if c.get("id")}
        if m["role"] in ("user", "tool"):
            block = (m["role"], order.get(m.get("tool_call_id"), 0), m.get("content") or "")
            if merged and merged[-1].get("blocks") is not None:
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        else:
            merged.append(dict(m))
    for m in merged:
        if m.get("blocks") is not None:
            results = iter(sorted((b for b in m["blocks"] if b[0] == "tool"), key=lambda b: b[1]))  # stable
            blocks = [next(results) if b[0] == "tool" else b for b in m.pop("blocks")]
            pieces: list[Piece] = []
            for i, (kind, _, text) in enumerate(blocks):
                pieces += [("\n\n" if i else "", True)]
                pieces += [("<tool_result>", True), (text, False), ("</tool_result>", True)] if kind == "tool" \
                    else [(text, False)]
            m["content"] = pieces
    return merged


def _prepare(messages: list[dict], thinking: bool, tools: list[dict] | None) -> tuple[list[dict], bool, int]:
    """Merged turns with the tools attached to the first system message; whether history reasoning
    is dropped; the index of the last user turn."""
    msgs = _merge_user_turns(messages)
    if tools:
        at = next((i for i, m in enumerate(msgs) if m["role"] in ("system", "developer")), None)
        if at is None:
            msgs.insert(0, {"role": "system", "content": ""})
            at = 0
        msgs[at] = {**msgs[at], "tools": tools}
    drop = not tools  # tools keep every turn's reasoning
    last_user = max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)
    if thinking and drop:  # developer turns before the last user turn are dropped
        msgs = [m for i, m in enumerate(msgs) if m["role"] != "developer" or i >= last_user]
        last_user = max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)
    return msgs, drop, last_user


def _content(m: dict) -> list[Piece]:
    content = m.get("content") or ""
    return content if isinstance(content, list) else [(content, False)]


def prompt_pieces(messages: list[dict], thinking: bool = False, reasoning_effort: str | None = None,
                  tools: list[dict] | None = None) -> list[Piece]:
    """The prompt (BOS first) for OpenAI-style messages ending in a user turn (or a tool result),
    ready for the assistant's answer, as (text, trusted) pieces: the template's text, which holds
    the control tokens, is trusted; every text the client sent (contents, reasoning, tool schemas,
    names and arguments) is not, and is encoded as plain text (`Tokenizer.encode_pieces`).
    `tools`: OpenAI function specs (`tools[i].function`)."""
    if reasoning_effort not in (None, "high", "max"):
        raise ValueError(f"reasoning_effort={reasoning_effort!r}: must be 'high', 'max' or None")
    msgs, drop, last_user = _prepare(messages, thinking, tools)
    out: list[Piece] = [(BOS, True), (EFFORT_MAX if thinking and reasoning_effort == "max" else "", True)]
    for i, m in enumerate(msgs):
        role = m["role"]
        extra = [("\n\n", True), *_tools_pieces(m["tools"])] if m.get("tools") else []
        if role == "system":
            out += [*_content(m), *extra]
        elif role in ("user", "developer"):
            out += [(USER, True), *_content(m), *extra]
        elif role == "assistant":
            if thinking and (not drop or i > last_user):
                out += [(m.get("reasoning_content") or "", False), (END_THINK, True)]
            out += _content(m)
            out += _tool_calls_pieces(m["tool_calls"]) if m.get("tool_calls") else []
            out.append((EOS, True))
        else:
            raise ValueError(f"messages[{i}].role={role!r}: must be system, developer, user, assistant or tool")
        followed_by_answer = i + 1 == len(msgs) or msgs[i + 1]["role"] == "assistant"
        if role in ("user", "developer") and followed_by_answer:
            opens = thinking and (not drop or i >= last_user)
            out.append((ASSISTANT + (THINK if opens else END_THINK), True))
    return [p for p in out if p[0]]


def encode_messages(messages: list[dict], thinking: bool = False, reasoning_effort: str | None = None,
                    tools: list[dict] | None = None) -> str:
    """The prompt text (BOS included) of `prompt_pieces`."""
    return "".join(text for text, _ in prompt_pieces(messages, thinking, reasoning_effort, tools))


_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.DOTALL)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.DOTALL)


def parse_tool_calls(block: str) -> list[dict] | None:
    """OpenAI-style {"name", "arguments"} of a DSML block (text after TOOL_CALLS_START), or None if
    it is not a well-formed block."""
    end = block.find(TOOL_CALLS_END)
    if end < 0 or block[end + len(TOOL_CALLS_END):].strip():
        return None
    body = block[:end]
    calls = []
    for invoke in _INVOKE.finditer(body):
        args = {}
        for name, is_str, value in _PARAM.findall(invoke.group(2)):
            if is_str == "true":
                args[name] = value
            else:
                try:
                    args[name] = json.loads(value)
                except ValueError:
                    args[name] = value
        calls.append({"name": invoke.group(1), "arguments": _json(args)})
    if not calls or _INVOKE.sub("", body).strip():
        return None
    return calls


def _held(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (may still become it)."""
    return max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)


class ChatOutput:
    """Splits assistant text into reasoning (thinking mode: before `</think>`), content and, when the
    request has tools, DSML tool calls. `add` returns the reasoning and content deltas that are safe
    to stream (a tail that may still become `</think>` or a tool-call block is held back); `finish`
    returns the rest and the parsed tool calls. Streamed deltas add up to the non-streamed fields."""

    def __init__(self, thinking: bool, tools: bool):
        self.thinking, self.tools = thinking, tools
        self.text = ""
        self.sent_reasoning = self.sent_content = 0

    def _split(self, final: bool) -> tuple[str, str, str | None]:
        text, reasoning = self.text, ""
        if self.thinking:
            at = text.find(END_THINK)
            if at < 0:
                return (text if final else text[:len(text) - _held(text, END_THINK)]), "", None
            reasoning, text = text[:at], text[at + len(END_THINK):]
        if self.tools:
            at = text.find(TOOL_CALLS_START)
            if at >= 0:
                return reasoning, text[:at], text[at + len(TOOL_CALLS_START):]
            if not final:
                text = text[:len(text) - _held(text, TOOL_CALLS_START)]
        return reasoning, text, None

    def _delta(self, reasoning: str, content: str) -> tuple[str, str]:
        out = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out

    def add(self, delta: str) -> tuple[str, str]:
        self.text += delta
        reasoning, content, _ = self._split(final=False)
        return self._delta(reasoning, content)

    def finish(self) -> tuple[str, str, list[dict]]:
        """The remaining (reasoning, content) deltas and the tool calls."""
        reasoning, content, block = self._split(final=True)
        calls = parse_tool_calls(block) if block is not None else None
        if block is not None and calls is None:  # not a well-formed block: keep it as text
            content += TOOL_CALLS_START + block
        return *self._delta(reasoning, content), calls or []


def parse_completion(text: str, thinking: bool, tools: bool = True) -> dict:
    """A whole completion (without EOS) as {"reasoning_content", "content", "tool_calls"}."""
    out = ChatOutput(thinking, tools)
    out.add(text)
    out.sent_reasoning = out.sent_content = 0
    reasoning, content, calls = out.finish()
    return {"reasoning_content": reasoning, "content": content, "tool_calls": calls}
