"""quickdraft's engine as a Triton Inference Server model: the Python backend, decoupled.

``deploy/triton/quickdraft/1/model.py`` imports ``TritonPythonModel`` from here; the model's
``config.pbtxt`` says which engine to build (its ``parameters`` are ``quickdraft serve``'s flags
without their dashes) and declares the decoupled transaction policy, so that one request may
get many responses: with ``stream`` true, a response per engine step with the text (and token
ids) new since the last, the last one flagged final with its ``finish_reason``; without, one
response. Inputs and outputs are named as in Triton's vLLM backend (``text_input``, ``stream``,
``max_tokens``, ``text_output``), so Triton's generate endpoint takes them as JSON fields:

    POST /v2/models/quickdraft/generate         {"text_input": "def f(x):", "max_tokens": 32}
    POST /v2/models/quickdraft/generate_stream  {"text_input": "...", "stream": true}

The engine runs as it runs behind ``quickdraft serve``: ``AsyncEngine`` in a thread of its own,
continuous batching across Triton's requests, and an asyncio loop in another thread that turns
each request's outputs into responses. A bad parameter (a QuickdraftError) is an error response
with its message; a request Triton cancels is aborted and frees its KV slot at the next step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from quickdraft.errors import ConfigError, QuickdraftError
from quickdraft.sampling import SamplingParams
from quickdraft.server.streaming import IncrementalText

CANCEL_POLL_S = 0.25  # how often a request waiting for its next output asks whether it was cancelled
# optional scalar inputs -> (SamplingParams field, Python type)
SAMPLING_INPUTS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int,
                   "ignore_eos": bool}


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from quickdraft.server.cli import args_from_dict, build_engine

        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "quickdraft's model needs model_transaction_policy { decoupled: true } in config.pbtxt")
        flags = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.engine, _ = build_engine(args_from_dict(flags, "config.pbtxt's parameters"), own_thread=True)
        self.tokenizer = self.engine.engine.tokenizer
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="quickdraft-triton", daemon=True)
        self._loop_thread.start()
        self.engine.start()

    def execute(self, requests: list) -> None:
        """Decoupled: the responses go through each request's sender, from the asyncio loop."""
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._generate(request), self.loop)
        return None

    def finalize(self) -> None:
        self.engine.stop(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=10)

    # -- one request --------------------------------------------------------------------------
    async def _generate(self, request) -> None:
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            prompt, params, stream = self._parse(request)
            group = await self.engine.add([f"triton-{uuid.uuid4().hex}"], [prompt], [params])
        except QuickdraftError as e:
            sender.send(_error(e.message), flags=final)
            return
        text, pending = IncrementalText(params.stop), []
        try:
            while True:
                if request.is_cancelled():
                    self.engine.abort(group.request_ids)
                    sender.send(flags=final)
                    return
                try:
                    _, out = await asyncio.wait_for(group.queue.get(), CANCEL_POLL_S)
                except asyncio.TimeoutError:
                    continue
                if out.finished and out.finish_reason in ("error", "abort"):
                    sender.send(_error(f"the request failed: {out.error or out.finish_reason}"), flags=final)
                    return
                pending += out.new_token_ids
                delta = text.delta(out.text, out.finished)
                if stream and (delta or out.finished):
                    reason = out.finish_reason if out.finished else ""
                    sender.send(_response(delta, pending, reason), flags=final if out.finished else 0)
                    pending = []
                if out.finished:
                    if not stream:
                        sender.send(_response(out.text, out.token_ids, out.finish_reason), flags=final)
                    return
        except Exception as e:  # a bug: answer rather than leave the client waiting
            self.engine.abort(group.request_ids)
            sender.send(_error(f"internal error: {type(e).__name__}: {e}"), flags=final)

    def _parse(self, request) -> tuple[list[int], SamplingParams, bool]:
        raw = _scalar(request, "text_input")
        if raw is None:
            raise ConfigError("the input text_input is missing", "text_input")
        prompt = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        fields = {}
        for name, kind in SAMPLING_INPUTS.items():
            value = _scalar(request, name)
            if value is not None:
                fields[name] = kind(value.item() if isinstance(value, np.generic) else value)
        fields.setdefault("temperature", 0.0)  # Triton's generate endpoint: greedy unless asked
        stream = _scalar(request, "stream")
        return self.tokenizer.encode(prompt), SamplingParams(**fields), bool(stream)


def _scalar(request, name: str):
    """The one value of an optional input, or None."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    return values[0] if values.size else None


def _response(text: str, token_ids: list[int], finish_reason: str | None):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("token_ids", np.array(token_ids, dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([(finish_reason or "").encode()], dtype=np.object_)),
    ])


def _error(message: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))
