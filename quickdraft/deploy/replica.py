"""One Ray Serve replica: its own engine and quickdraft's own OpenAI app (``server/app.py``),
served through Ray's HTTP proxy as the deployment's ASGI ingress.

Ray routes each HTTP request to a replica, at most ``max_ongoing_requests`` (= ``--max-num-seqs``)
at a time per replica, so the engine's slots, not its queue, take what Ray sends. The app's
lifespan starts the engine loop in a thread of its own (the replica's event loop belongs to Ray)
and stops it when Ray stops the replica, after Ray's graceful wait for the requests in flight.
Ray calls ``check_health`` every few seconds: an engine loop that died makes the replica unhealthy
and Ray replaces it.

This module imports Ray; ``ray_serve.py`` builds the deployment's options from the flags.
"""

from __future__ import annotations

import argparse
import os

from ray import serve


@serve.ingress()
class QuickdraftReplica:
    def __init__(self, args: argparse.Namespace, num_threads: int | None = None):
        """``args``: ``quickdraft serve``'s parsed flags; ``num_threads``: torch's CPU threads
        (the replica's CPUs in Ray), so that replicas on one machine do not oversubscribe it."""
        import torch

        from quickdraft.server.cli import build

        if num_threads:
            torch.set_num_threads(num_threads)
        self.async_engine, self.settings, self._app = build(args, own_thread=True)

    def __serve_build_asgi_app__(self):
        return self._app

    def check_health(self) -> None:
        """Ray's health check: raises once the engine loop has stopped (after the app started)."""
        if self.async_engine.started and not self.async_engine.alive:
            raise RuntimeError(f"the engine loop of replica pid {os.getpid()} has stopped")
