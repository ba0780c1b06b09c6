"""The shape of ``results.json``, as a JSON Schema (draft 2020-12 subset), and a checker.

``validate`` uses the ``jsonschema`` package when it is installed and otherwise a small checker
of the keywords used here (type, required, properties, items, enum, minimum), so the schema is
tested either way.
"""

from __future__ import annotations

from quickdraft.config import METHODS

NUM = {"type": "number"}
NUM_OR_NULL = {"type": ["number", "null"]}
INT = {"type": "integer", "minimum": 0}
STR = {"type": "string"}
INTS = {"type": "array", "items": {"type": "integer"}}
NUMS = {"type": "array", "items": NUM}


def _obj(required: dict, optional: dict | None = None) -> dict:
    return {"type": "object", "required": sorted(required), "properties": {**required, **(optional or {})}}


VARIANT = _obj({"name": STR, "method": {"enum": list(METHODS)}, "k": INT,
                "lookup_max": {"type": ["integer", "null"]}, "lookup_min": {"type": ["integer", "null"]},
                "draft": {"type": ["string", "null"]}, "adaptive": {"type": "boolean"}},
               {"branches": INT, "cross_tokenizer": {"type": "boolean"}})

RUN = _obj({
    "request": STR, "variant": STR, "seed": {"type": ["integer", "null"]}, "repeat": INT, "token_ids": INTS,
    "text": STR, "num_tokens": INT, "finish_reason": {"type": ["string", "null"]}, "tokens_per_second": NUM,
    "seconds": NUM, "ttft_s": NUM, "total_seconds": NUM, "num_target_passes": INT, "num_draft_tokens": INT,
    "num_accepted_tokens": INT, "num_emitted_tokens": INT, "drafts_per_position": INTS,
    "accepted_per_position": INTS, "peak_rss_mib": NUM,
}, {"identical_to_none": {"type": "boolean"}})

# Derived figures are null where they are undefined (a median of nothing, a ratio over zero).
SPEEDUP = _obj({"n": INT, "median": NUM_OR_NULL, "geomean": NUM_OR_NULL, "p10": NUM_OR_NULL, "p90": NUM_OR_NULL})

SUMMARY_ROW = _obj({
    "variant": STR, "method": STR, "k": INT, "dataset": STR, "category": STR, "n_requests": INT, "n_runs": INT,
    "tokens_per_second_median": NUM_OR_NULL, "tokens_per_second_p90": NUM_OR_NULL, "speedup": SPEEDUP,
    "ttft_median_s": NUM_OR_NULL,
    "peak_rss_mib": NUM, "model_mib": NUM_OR_NULL, "num_target_passes": INT, "num_draft_tokens": INT,
    "num_accepted_tokens": INT, "mean_accepted_length": NUM, "acceptance_rate": NUM,
    "acceptance_by_position": NUMS,
    "lossless": _obj({"kind": {"enum": ["greedy", "tv"]}, "n": INT}),
})

REQUEST = _obj({"id": STR, "dataset": STR, "category": STR, "prompt_id": STR, "turn": INT, "prompt_text": STR,
                "prompt_token_ids": INTS, "num_prompt_tokens": INT})

DIVERGENCE = _obj({"request": STR, "variant": STR, "position": INT, "margin": NUM,
                   "rounding_level": {"type": "boolean"}, "top1_token": INT, "top2_token": INT})

FLOOR = _obj({"bandwidth_gb_per_s": NUM, "weight_bytes_per_token": INT, "floor_tokens_per_second": NUM,
              "none_tokens_per_second": NUM_OR_NULL, "fraction_of_floor": NUM_OR_NULL, "threads": INT})

# One per peer asked for: ok, missing (not installed), error (it raised, or could not load the
# model), crashed (killed by a signal: ``signal``), timed_out (killed after ``timeout_s``). A peer
# that died keeps the requests it finished; ``system`` says which build ran (llama.cpp's system info).
PEER_STATUS = _obj({"peer": STR, "status": {"enum": ["ok", "missing", "error", "crashed", "timed_out"]},
                    "requests_finished": INT, "requests_total": INT},
                   {"exit_code": {"type": ["integer", "null"]}, "signal": {"type": ["integer", "null"]},
                    "error": {"type": ["string", "null"]}, "system": {"type": "object"},
                    "stderr_tail": {"type": "array", "items": STR}, "seconds": NUM, "timeout_s": NUM})

PEERS = _obj({"methods": {"type": "array"}, "runs": {"type": "array"}, "summary": {"type": "array"}},
             {"status": {"type": "array", "items": PEER_STATUS}})

SCHEMA = _obj({
    "schema_version": {"enum": [1]},
    "command": STR, "argv": {"type": "array", "items": STR},
    "config": _obj({"model": STR, "variants": {"type": "array", "items": VARIANT}, "datasets": {"type": "array"},
                    "max_tokens": INT, "temperature": NUM}),
    "machine": _obj({"platform": STR, "cpu": STR, "cpu_count": INT, "torch_threads": INT}),
    "versions": _obj({"quickdraft": STR, "torch": STR, "python": STR}),
    "models": _obj({"target": _obj({"name": STR, "source": STR, "weight_bytes": INT})}),
    "floor": FLOOR,
    "batch_invariance": _obj({"promised": {"type": "boolean"}, "path": STR, "why": STR}),
    "requests": {"type": "array", "items": REQUEST},
    "runs": {"type": "array", "items": RUN},
    "summary": {"type": "array", "items": SUMMARY_ROW},
    "divergences": {"type": "array", "items": DIVERGENCE},
    "tv_tests": {"type": "array"},
    "notes": {"type": "array", "items": STR},
    "duration_s": NUM, "started_at": STR,
}, {"peers": PEERS, "phases": {"type": "object"}, "model_mib": {"type": "object"}})

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def errors(value, schema: dict, path: str = "$") -> list[str]:
    """Every violation of ``schema`` in ``value``, as 'path: message' lines (the small checker)."""
    out = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, k) for k in kinds):
            return [f"{path}: expected {' or '.join(kinds)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        out.append(f"{path}: {value} < {schema['minimum']}")
    if isinstance(value, dict):
        out += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        for k, sub in schema.get("properties", {}).items():
            if k in value:
                out += errors(value[k], sub, f"{path}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += errors(item, schema["items"], f"{path}[{i}]")
    return out


def validate(result: dict) -> None:
    """Raise ValueError naming every violation (jsonschema's first one, when it is installed)."""
    try:
        import jsonschema
    except ImportError:
        problems = errors(result, SCHEMA)
        if problems:
            raise ValueError("results.json does not match the schema:\n" + "\n".join(problems[:20]))
        return
    try:
        jsonschema.validate(result, SCHEMA)
    except jsonschema.ValidationError as e:
        raise ValueError(f"results.json does not match the schema: {e.message} at {list(e.absolute_path)}") from None
