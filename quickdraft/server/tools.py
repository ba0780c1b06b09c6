"""Tools on chat completions: rendering them into the prompt, enforcing ``tool_choice`` with a
grammar, and parsing the model's tool calls back into OpenAI's ``tool_calls``.

The format is the one Qwen2.5's chat template teaches (Hermes' format): each call is
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. A template that renders
``tools`` itself (Qwen2.5's) is given them; one that does not (SmolLM2's) gets the same
instructions as a system message of ours, and past assistant tool calls as that text.

``tool_choice``: "none" drops the tools; "auto" (the default with tools) lets the model choose;
"required" or a named function is enforced with a grammar (quickdraft/structured.py): one or more
calls (one, for a named function) whose JSON is the function's name and its parameters' schema.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from quickdraft.server.protocol import APIError
from quickdraft.structured import JSON_OPTIONS, StructuredSpec

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def check_tools(tools: list[dict] | None, tool_choice: str | dict | None) -> None:
    """400s for tools that are not OpenAI function tools, and for a tool_choice that names no tool."""
    names = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, 'each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}',
                           param=f"tools.{i}")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools.{i}.function.parameters must be a JSON schema object", param=f"tools.{i}.function.parameters")
        names.append(fn["name"])
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        if not names:
            raise APIError(400, 'tool_choice "required" needs tools', param="tool_choice")
        return
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                           f"({', '.join(names) or 'none given'})", param="tool_choice")
        return
    raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                   param="tool_choice")


def active_tools(tools: list[dict] | None, tool_choice: str | dict | None) -> list[dict]:
    """The tools the prompt shows: none with tool_choice "none"."""
    return [] if tool_choice == "none" else list(tools or [])


def tool_spec(tools: list[dict], tool_choice: str | dict | None, tokenizer) -> StructuredSpec | None:
    """The grammar that enforces tool_choice "required" (one or more calls of any tool) or a named
    function (one call of it); None for "auto" and "none". Where the vocabulary has the tags as
    tokens of their own (Qwen's), the grammar asks for those tokens: the grammar library counts
    them as special, and would let their text be spelled only byte by byte."""
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    chosen = [t["function"] for t in tools if named is None or t["function"]["name"] == named]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_OPTIONS}
    tag = lambda t: t if tokenizer.token_to_id(t) is not None else json.dumps(t)  # noqa: E731
    call = f'{tag(CALL_OPEN)} "\\n" call_json "\\n" {tag(CALL_CLOSE)}'
    more = "" if named else f' ("\\n" {call})*'
    lark = f"start: {call}{more}\ncall_json: %json {json.dumps(schema)}\n"
    return StructuredSpec("lark", lark, "tool_choice")


def render(tokenizer, messages: list[dict], tools: list[dict]) -> str:
    """The prompt text: the model's template given the tools where it renders them, else our
    instructions in the system message and past tool calls as text."""
    template = tokenizer.chat_template or ""
    if not tools or "tools" in template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools or None)
    text = _INSTRUCTIONS.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools))
    messages = [_calls_as_text(m) for m in messages]
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
    else:
        messages = [{"role": "system", "content": text}, *messages]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _calls_as_text(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = "".join(f"\n{CALL_OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                   f"\n{CALL_CLOSE}" for c in calls)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": (message.get("content") or "") + text}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content before the calls or None, OpenAI tool_calls) of a reply; a reply without a
    well-formed call is all content. Small models sometimes leave the tags out: a reply that is
    nothing but a call's JSON object ({"name": ..., "arguments": {...}}) is a call too."""
    bodies = [m.group(1) for m in _CALL.finditer(text)]
    bare = not bodies and text.strip().startswith("{")
    calls = [c for c in map(_call, [text.strip()] if bare else bodies) if c is not None]
    if not calls:
        return text, []
    content = "" if bare else text[: text.find(CALL_OPEN)].strip()
    return content or None, calls


def _call(body: str) -> dict | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
            not isinstance(call.get("arguments", call.get("parameters")), (dict, str)):
        return None
    args = call.get("arguments", call.get("parameters"))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


def template_message(message: dict) -> dict:
    """An assistant message's tool calls as templates expect them: arguments as an object."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        args: Any = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append({**c, "function": fn})
    return {**message, "tool_calls": out}
