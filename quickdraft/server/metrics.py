"""Prometheus metrics of the server, named like vLLM's (``vllm:`` -> ``quickdraft:``) so that
dashboards carry over.

Terms as in vLLM: a *draft* is one sequence's proposal in one step (K tokens or fewer); a draft
token is *accepted* when the verifier keeps it; ``..._per_pos{position=j}`` counts acceptances of
the j-th draft token (0-based). Counters get the ``_total`` suffix in the text format.

Beside quickdraft's own, three gauges carry vLLM's names (``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, with vLLM's ``model_name`` and
``engine`` labels): they are what an endpoint picker that routes by load reads (llm-d's, the
Gateway API inference extension's model server protocol), and what vLLM dashboards and HPA rules
query. ``vllm:gpu_cache_usage_perc``, the name before vLLM 0.10, is kept for older pickers. KV-cache
usage here is the fraction of KV slots held by running sequences: each holds one slot of
``max_model_len`` positions for its whole life, so at 1 a new request waits.

Every metric lives in this object's own ``CollectorRegistry``, never the process-global one, so
that two servers (or tests) in one process do not share counters. prometheus_client is thread
safe: the engine thread updates token and speculative counters, the event loop counts refusals.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from quickdraft.engine.sequence import RequestOutput, SpecStats

# Why a request did not succeed: refusals by the server, then ends inside the engine.
FAILURE_REASONS = (
    "bad_request",  # 400: malformed JSON, wrong types, out of range, prompt too long
    "unauthorized",  # 401
    "not_found",  # 404: unknown model or route
    "queue_full",  # 429
    "shutting_down",  # 503: arrived while the server drains
    "abort",  # the client went away
    "error",  # a failure inside the request (non-finite logits, a bug): 500
)
SUCCESS_REASONS = ("stop", "length")

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model_name: str, num_speculative_tokens: int = 0):
        self.registry = CollectorRegistry()
        r, lbl, self._model = self.registry, ["model_name"], model_name

        def counter(name, doc, extra=()):
            return Counter(f"quickdraft:{name}", doc, lbl + list(extra), registry=r)

        self.num_drafts = counter("spec_decode_num_drafts", "Draft proposals (one sequence, one step).")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the draft (0-based).", ["position"])
        self.request_success = counter("request_success", "Requests finished normally.", ["finished_reason"])
        self.request_failure = counter("request_failure", "Requests refused or failed.", ["reason"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests (once per prompt).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        # vLLM's pair (in tokens): hits / queries is the prefix cache's hit rate (engine/prefix_cache.py)
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).")
        self.running = Gauge("quickdraft:num_requests_running", "Sequences decoding.", lbl, registry=r)
        self.waiting = Gauge("quickdraft:num_requests_waiting", "Sequences waiting for a KV slot.", lbl, registry=r)
        # vLLM's names for the gauges a load-aware router reads (the module's note)
        vllm = ["model_name", "engine"]
        self.vllm_running = Gauge("vllm:num_requests_running", "Requests decoding (vLLM's name).", vllm, registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a KV slot (vLLM's name).", vllm,
                                  registry=r)
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (the fraction of KV slots held by "
                                   "running sequences). 1 means 100 percent usage.", vllm, registry=r)
        self.vllm_gpu_cache_usage = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 means 100 percent. "
                                          "DEPRECATED in vLLM: vllm:kv_cache_usage_perc is the same.", vllm, registry=r)
        for g in (self.vllm_running, self.vllm_waiting, self.vllm_kv_usage, self.vllm_gpu_cache_usage):
            g.labels(model_name, "0").set(0)
        self.ttft = Histogram("quickdraft:time_to_first_token_seconds", "Arrival to first token.", lbl,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("quickdraft:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", lbl,
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("quickdraft:e2e_request_latency_seconds", "Arrival to finish.", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r)
        # Zero-valued series exist from the start, so a dashboard's rate() has a baseline.
        for reason in SUCCESS_REASONS:
            self.request_success.labels(model_name, reason)
        for reason in FAILURE_REASONS:
            self.request_failure.labels(model_name, reason)
        for j in range(num_speculative_tokens):
            self.accepted_per_pos.labels(model_name, str(j))
        for m in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.prompt_tokens,
                  self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits):
            m.labels(model_name)
        self._last = SpecStats()  # the engine's counters at the previous record_step

    # -- the event loop ---------------------------------------------------------------------
    def failure(self, reason: str) -> None:
        self.request_failure.labels(self._model, reason).inc()

    def admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self._model).inc(num_prompt_tokens)

    # -- the engine thread ------------------------------------------------------------------
    def record_step(self, stats: SpecStats, outputs: list[RequestOutput], running: int, waiting: int) -> None:
        """After one engine step: ``stats`` is the engine's cumulative SpecStats."""
        m, last = self._model, self._last
        self.num_draft_tokens.labels(m).inc(stats.num_draft_tokens - last.num_draft_tokens)
        self.num_accepted_tokens.labels(m).inc(stats.num_accepted_tokens - last.num_accepted_tokens)
        drafts = stats.drafts_per_position
        self.num_drafts.labels(m).inc((drafts[0] if drafts else 0) - (last.drafts_per_position[:1] or [0])[0])
        for j, n in enumerate(stats.accepted_per_position):
            before = last.accepted_per_position[j] if j < len(last.accepted_per_position) else 0
            if n != before:
                self.accepted_per_pos.labels(m, str(j)).inc(n - before)
        self._last = SpecStats()
        self._last.merge(stats)
        for out in outputs:
            # the end of sequence that finished it counts, as in usage.completion_tokens (vLLM's rule)
            self.generation_tokens.labels(m).inc(len(out.new_token_ids) + (out.finished and out.eos_token_id is not None))
            if out.first_token_time is not None and len(out.token_ids) == len(out.new_token_ids) and out.new_token_ids:
                self.ttft.labels(m).observe(out.first_token_time - out.arrival_time)
                self.prefix_cache_queries.labels(m).inc(len(out.prompt_token_ids))  # once: its first output
                self.prefix_cache_hits.labels(m).inc(out.num_cached_tokens)
            if out.finished:
                self.finished(out)
        self.set_queue(running, waiting)

    def finished(self, out: RequestOutput) -> None:
        m = self._model
        if out.finish_reason in SUCCESS_REASONS:
            self.request_success.labels(m, out.finish_reason).inc()
            if out.finish_time is not None:
                self.e2e.labels(m).observe(out.finish_time - out.arrival_time)
                n = len(out.token_ids)
                if n > 1 and out.first_token_time is not None:
                    self.tpot.labels(m).observe((out.finish_time - out.first_token_time) / (n - 1))
        else:
            self.failure("abort" if out.finish_reason == "abort" else "error")

    def set_queue(self, running: int, waiting: int, kv_usage: float | None = None) -> None:
        """The scheduler's state; ``kv_usage``: the fraction of KV slots held (None: unchanged)."""
        m = self._model
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        self.vllm_running.labels(m, "0").set(running)
        self.vllm_waiting.labels(m, "0").set(waiting)
        if kv_usage is not None:
            self.vllm_kv_usage.labels(m, "0").set(kv_usage)
            self.vllm_gpu_cache_usage.labels(m, "0").set(kv_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
