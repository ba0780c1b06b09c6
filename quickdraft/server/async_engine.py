"""The Engine in one thread of its own, driven from asyncio.

The Engine is not thread safe, so exactly one thread (the *engine loop*) touches it. Between two
steps the loop takes the commands that request handlers put on a thread-safe queue (add a group
of requests, abort requests, stop), then steps once and hands every output to its request's
``asyncio.Queue`` with ``loop.call_soon_threadsafe``. An idle loop blocks on the command queue, so
it costs nothing while no request runs.

Where the loop runs matters on a CPU. torch's OpenMP pool belongs to the thread that calls it:
the thread that loaded the model already owns one, and a second thread stepping the engine gets
a second pool. libgomp then counts more threads than cores and stops spinning between parallel
regions, and the idle pool's workers compete with the busy one: a step took ~12% longer in a
thread than on the main thread here (Qwen2.5-Coder-1.5B, 48 tokens, 3 runs each). So
``quickdraft serve`` runs the loop on the main thread (``run``) and HTTP in a thread of its own;
``start`` (a thread for the loop) is for embedding the server in a process that is busy otherwise.

A *group* is what one HTTP request asks for: ``n`` choices of one or more prompts, each an engine
request of its own. A group is admitted whole or not at all (a full queue refuses all of it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from dataclasses import dataclass, field

from quickdraft.engine.engine import Engine
from quickdraft.engine.sequence import RequestOutput
from quickdraft.sampling import SamplingParams
from quickdraft.server.metrics import ServerMetrics

log = logging.getLogger("quickdraft.server")


@dataclass
class Group:
    """The engine requests of one HTTP request; ``queue`` receives ``(index, RequestOutput)``."""

    request_ids: list[str]
    prompts: list[list[int]]
    params: list[SamplingParams]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    admitted: asyncio.Future | None = None  # resolved by the engine thread: None or the exception
    finished: set[int] = field(default_factory=set)  # indices done (any reason); event loop only
    last_disconnect_check: float = 0.0  # time.monotonic() of the app's last look at the client

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids)


@dataclass
class _Add:
    group: Group


@dataclass
class _Abort:
    request_ids: list[str]


_STOP = object()
IDLE_WAKE_S = 0.2  # how often an idle engine loop wakes (see _run)


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: ServerMetrics, own_thread: bool = True):
        """``own_thread=False``: the caller runs the loop with ``run`` (see the module's note)."""
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._groups: dict[str, tuple[Group, int]] = {}  # request id -> (group, index); engine thread only
        self._thread: threading.Thread | None = None
        self._external = not own_thread
        self._running_here = False
        self.started = False  # start() or run() was called: the loop ran, or runs
        sched = engine.scheduler
        self.snapshot = {"running": 0, "waiting": 0, "free_slots": sched.num_free_slots, "max_num_seqs": sched.num_slots}

    # -- the event loop's side --------------------------------------------------------------
    def start(self) -> None:
        """Run the engine loop in a thread of its own (the app's startup calls this), unless the
        caller runs it itself (``own_thread=False``)."""
        if self._external:
            return
        self.started = True
        self._thread = threading.Thread(target=self._run, name="quickdraft-engine", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the engine loop on the calling thread until ``stop``; the app then leaves the loop
        to its caller (``quickdraft serve`` calls this on the main thread)."""
        if not self._external:
            raise RuntimeError("this AsyncEngine runs its loop in its own thread (own_thread=True)")
        self._running_here = self.started = True
        try:
            self._run()
        finally:
            self._running_here = False

    def stop(self, timeout: float | None = None) -> None:
        """Abort whatever still runs (a drain has already waited for it), then end the loop."""
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout)
            self._thread = None
        elif self._external:
            self._commands.put(_STOP)

    @property
    def alive(self) -> bool:
        return self._running_here or (self._thread is not None and self._thread.is_alive())

    async def add(self, request_ids: list[str], prompts: list[list[int]], params: list[SamplingParams]) -> Group:
        """Queue a group; raises what ``Engine.add_request`` raised (QuickdraftError: 400, 429)."""
        loop = asyncio.get_running_loop()
        group = Group(request_ids, prompts, params, loop, admitted=loop.create_future())
        self._commands.put(_Add(group))
        try:
            error = await group.admitted
        except asyncio.CancelledError:  # the client left while the group was being admitted
            self.abort(request_ids)
            raise
        if error is not None:
            raise error
        return group

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests; their KV slots are free after the engine's current step."""
        if request_ids:
            self._commands.put(_Abort(list(request_ids)))

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            try:
                # Wait while idle; between steps take everything that is there. The wait wakes up
                # now and then: on the main thread (quickdraft serve) Python runs a signal handler
                # only when this thread runs, and a SIGTERM the kernel hands to another thread does
                # not interrupt a blocked wait, so a drain would wait for the next request.
                cmd = self._commands.get(timeout=IDLE_WAKE_S) if not engine.has_unfinished() else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd is _STOP:
                    self._abort_all("abort", None)
                    self._close()
                    return
                self._apply(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if engine.has_unfinished():
                self._step()
            self._publish()

    def _close(self) -> None:
        try:
            self.engine.close()  # on the engine thread, like every other touch of the engine
        except Exception:  # a full disk must not turn a clean shutdown into a crash
            log.error("closing the engine failed:\n%s", traceback.format_exc())

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Add):
            self._admit(cmd.group)
        elif isinstance(cmd, _Abort):
            outs = [o for o in map(self.engine.abort_request, cmd.request_ids) if o is not None]
            self._publish()
            for out in outs:
                self._deliver(out)

    def _admit(self, group: Group) -> None:
        added: list[str] = []
        error: BaseException | None = None
        try:
            for rid, prompt, params in zip(group.request_ids, group.prompts, group.params):
                self.engine.add_request(prompt, params, rid)
                added.append(rid)
        except Exception as e:  # QuickdraftError (a 4xx), or a bug: either way nothing stays queued
            error = e
            for rid in added:
                self.engine.abort_request(rid)
        else:
            for i, rid in enumerate(added):
                self._groups[rid] = (group, i)
        group.loop.call_soon_threadsafe(_resolve, group.admitted, error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug in the engine: fail what runs rather than hang every client
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._abort_all("error", f"internal error: {type(e).__name__}: {e}")
            return
        sched = self.engine.scheduler
        self.metrics.record_step(self.engine.stats, outputs, len(sched.running), len(sched.waiting))
        self._publish()  # before the outputs go out: a client that saw its end sees its slot free
        for out in outputs:
            self._deliver(out, counted=True)  # record_step counted the finished ones

    def _deliver(self, out: RequestOutput, counted: bool = False) -> None:
        if out.finished and not counted:
            self.metrics.finished(out)
        entry = self._groups.pop(out.request_id, None) if out.finished else self._groups.get(out.request_id)
        if entry is None:
            return
        group, index = entry
        try:
            group.loop.call_soon_threadsafe(group.queue.put_nowait, (index, out))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _abort_all(self, reason: str, error: str | None) -> None:
        sched = self.engine.scheduler
        for seq in list(sched.running) + list(sched.waiting):
            out = self.engine.abort_request(seq.request_id)
            if out is not None:
                out.finish_reason, out.error = reason, error
                self._deliver(out)
        self._publish()

    def _publish(self) -> None:
        sched = self.engine.scheduler
        running, waiting = len(sched.running), len(sched.waiting)
        free = sched.num_free_slots
        self.metrics.set_queue(running, waiting, 1.0 - free / sched.num_slots)  # first: /health then agrees
        self.snapshot = {"running": running, "waiting": waiting, "free_slots": free, "max_num_seqs": sched.num_slots}


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(error)
