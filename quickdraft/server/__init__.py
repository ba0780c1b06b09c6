"""``quickdraft serve``: an OpenAI-compatible HTTP server over the engine.

protocol.py (request schemas, errors), app.py (routes, streaming), async_engine.py (the engine in
its own thread), metrics.py (Prometheus), streaming.py (text deltas, SSE), cli.py (the flags). The load clients
(loadgen, soak, turns) live in quickdraft/bench/.
"""
