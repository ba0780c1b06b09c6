"""OpenAI request schemas (completions, chat completions) and the error format.

Requests are validated strictly: a field of the wrong JSON type (``"max_tokens": "5"``,
``"n": 1.5``, ``"stream": 1``) is a 400 naming the field, not a silent coercion, and so is a field
we do not know (OpenAI answers "Unrecognized request argument"). A few OpenAI fields that change
nothing here are accepted and ignored (``user``, ``metadata``, ``store``...); a few we do not implement are accepted only at
their no-op value and otherwise declined with a 400 that says so. ``top_k``, ``ignore_eos`` and
``structured_outputs`` are extensions, as in vLLM.

Structured outputs (``response_format``, vLLM's ``structured_outputs``) and tools (``tools``,
``tool_choice``) become one ``StructuredSpec`` (quickdraft/structured.py, quickdraft/server/tools.py);
whether it compiles is the app's to check, against the model's tokenizer.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quickdraft.errors import QuickdraftError
from quickdraft.structured import StructuredSpec

MAX_N = 64
MAX_STOP = 16


class APIError(QuickdraftError):
    """An error answered in OpenAI's format with this status (and optional extra headers)."""

    def __init__(self, status_code: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message, param)
        self.status_code = status_code
        self.error_type = error_type
        self.code = code
        self.headers = headers or {}


def error_body(status_code: int, message: str, error_type: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param,
                      "code": code if code is not None else status_code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's; accepted, not used


class SpeculativeOptions(_Strict):
    """quickdraft's extension, ``"speculative": {...}`` in the body: this request's own cap on
    draft tokens a step (0 turns speculation off for it; a value above the server's is capped
    there). It composes with the adaptive plan as a cap, never a raise, and changes only speed."""

    num_speculative_tokens: int | None = Field(None, ge=0)


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None  # vLLM's extension: token ids in every choice / chunk
    speculative: SpeculativeOptions | None = None  # quickdraft's extension (SpeculativeOptions)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)  # vLLM's extension
    min_tokens: int | None = Field(None, ge=0)  # vLLM's extension: no end of sequence before this many tokens
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM's extension
    response_format: dict | None = None  # OpenAI's: {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict | None = None  # vLLM's extension: {"json" | "regex" | "choice" | "grammar": ...}
    # accepted and ignored: they change nothing here
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None

    def stop_list(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            raise APIError(400, f"stop takes at most {MAX_STOP} strings, got {len(stop)}", param="stop")
        if any(s == "" for s in stop):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return tuple(stop)

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        self.bias()
        self.stop_list()
        self.structured_spec()

    def structured_spec(self) -> StructuredSpec | None:
        """What the output must match, from ``response_format`` or ``structured_outputs`` (at most
        one of them); None for free text."""
        spec = _response_format(self.response_format)
        extension = _structured_outputs(self.structured_outputs)
        if spec is not None and extension is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        return spec or extension

    def bias(self) -> dict[int, float]:
        """logit_bias with its keys as token ids (OpenAI sends them as strings)."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            if not -100.0 <= value <= 100.0:
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {value} for {key}", param="logit_bias")
            out[token] = value
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def speculation_cap(self) -> int | None:
        """The request's cap on draft tokens a step, or None for the server's."""
        return self.speculative.num_speculative_tokens if self.speculative is not None else None


def _response_format(rf: dict | None) -> StructuredSpec | None:
    """OpenAI's response_format: text, json_object, or json_schema with {"name", "schema", "strict"}."""
    if rf is None:
        return None
    kind = rf.get("type")
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise APIError(400, f"response_format: unrecognized key(s) {', '.join(sorted(extra))}", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec.json_object()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js and "json_schema" not in js:
            raise APIError(400, 'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                           param="response_format.json_schema")
        if not isinstance(js.get("name", ""), str):
            raise APIError(400, "response_format.json_schema.name must be a string", param="response_format.json_schema.name")
        return StructuredSpec.json_schema(js.get("schema", js.get("json_schema")), "response_format.json_schema.schema")
    raise APIError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format.type")


_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs(so: dict | None) -> StructuredSpec | None:
    """vLLM's structured_outputs: exactly one of json (a schema, or its JSON text), regex, choice,
    grammar (EBNF, llama.cpp's GBNF or Lark) or json_object: true."""
    if so is None:
        return None
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    unknown = set(given) - set(_STRUCTURED_KEYS) - {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
    if unknown:
        raise APIError(400, f"structured_outputs: unrecognized key(s) {', '.join(sorted(unknown))}; "
                       f"valid: {', '.join(_STRUCTURED_KEYS)}", param="structured_outputs")
    kinds = [k for k in _STRUCTURED_KEYS if k in given]
    if len(kinds) != 1:
        raise APIError(400, f"structured_outputs takes exactly one of {', '.join(_STRUCTURED_KEYS)}, got "
                       f"{', '.join(kinds) or 'none'}", param="structured_outputs")
    kind, value = kinds[0], given[kinds[0]]
    param = f"structured_outputs.{kind}"
    if kind == "json_object":
        return StructuredSpec.json_object(param)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise APIError(400, f"{param}: not valid JSON: {e}", param=param) from None
        return StructuredSpec.json_schema(value, param)
    if kind == "choice":
        if not isinstance(value, list):
            raise APIError(400, f"{param} must be a list of strings", param=param)
        return StructuredSpec.choice(value, param)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param} must be a non-empty string", param=param)
    return StructuredSpec(kind, value, param)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt's logprobs alone (as vLLM)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, "best_of is not supported by quickdraft (only best_of == n)", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported by quickdraft", param="suffix")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1, or 0 with echo: true (the prompt's logprobs alone)",
                           param="max_tokens")
        p = self.prompt
        if isinstance(p, list) and (not p or any(isinstance(x, list) and not x for x in p)):
            raise APIError(400, "prompt must not be empty", param="prompt")

    @property
    def logprob_count(self) -> int | None:
        """None: no logprobs; N: each token's and the N most likely (SamplingParams.logprobs)."""
        return self.logprobs

    @property
    def prompt_logprob_count(self) -> int | None:
        """With echo, the prompt's tokens get logprobs too (SamplingParams.prompt_logprobs)."""
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as text or token ids, one per batch entry."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (OpenAI's format)

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        return d


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None  # checked by server/tools.py
    tool_choice: str | dict | None = None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree", param="max_completion_tokens")

    @property
    def logprob_count(self) -> int | None:
        """None: no logprobs; N: each token's and the N most likely (SamplingParams.logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    """vLLM's ``POST /tokenize`` (what lm-evaluation-harness's remote tokenizer calls)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None  # true (the default): BOS where the model file asks for it

    def check(self) -> None:
        pass


class DetokenizeRequest(_Strict):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]

    def check(self) -> None:
        pass


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}
_UNION_HINTS = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "stop must be a string or a list of strings",
    "content": "content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


def openapi_body(model: type[_Strict]) -> dict:
    """The route's ``requestBody`` for the OpenAPI document (``/openapi.json``): the model's JSON
    schema with its ``$defs`` inlined (none is recursive), so that clients and schema-driven
    fuzzers see what the route validates (the routes read the raw body themselves)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def parse_request(model: type[_Strict], body: Any) -> _Strict:
    """Validate a decoded JSON body; any problem becomes an APIError 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        message, param = _describe(e)
        raise APIError(400, message, param=param) from None
    req.check()
    return req


def _describe(e: ValidationError) -> tuple[str, str]:
    """(message, param) of the first problem, in words a client can act on."""
    errors = e.errors(include_url=False)
    extra = [".".join(map(str, x["loc"])) for x in errors if x["type"] == "extra_forbidden"]
    if extra:
        return f"unrecognized request argument(s): {', '.join(extra)}", extra[0]
    err = errors[0]
    loc = [str(x) for x in err["loc"]]
    # A union reports one error per member, with the member's type in loc ("str", "list[int]",
    # "TextPart"): keep only field names (snake_case) and list indices.
    field_path = [x for x in loc if x not in _TYPE_TAGS and "[" not in x and "-" not in x and not x[:1].isupper()]
    param = ".".join(field_path)
    last_name = next((x for x in reversed(field_path) if not x.isdigit()), param)
    if len(errors) > 1 and last_name in _UNION_HINTS and all(str(x["loc"][0]) == loc[0] for x in errors):
        return _UNION_HINTS[last_name], param
    if err["type"] == "missing":
        return f"{param} is required", param
    got = err.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    return f"{param}: {err['msg']} (got {shown})", param
