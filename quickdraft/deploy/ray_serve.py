"""quickdraft on Ray Serve: ``quickdraft serve --ray ...``, or ``serve run
quickdraft.deploy.ray_serve:app_builder key=value ...`` with the same flags as keys.

Each replica (``replica.py``) builds its own engine and serves quickdraft's own OpenAI app behind
Ray's HTTP proxy; Ray places the replicas on the cluster's nodes, routes requests between them,
restarts a replica that dies and scales the number of replicas on ongoing requests. The flags map
onto Ray's deployment options:

=====================================  =======================================================
``--max-num-seqs``                     ``max_ongoing_requests``: a replica takes at most as many
                                       requests as it has KV slots; the rest wait in Ray's
                                       router, which sends each to a replica with a free slot
``--max-queue``                        ``max_queued_requests``, and past it a 429 with
                                       ``Retry-After`` (``backpressure_config``), as one server
``--num-replicas N``                   a fixed number of replicas
``--min-replicas/--max-replicas``,     ``autoscaling_config`` on ongoing requests (running and
``--target-ongoing-requests``          queued, per replica); the target defaults to half the
                                       slots: speculation pays most at small batches
``--shutdown-timeout``                 ``graceful_shutdown_timeout_s``: how long a replica that
                                       Ray stops waits for its requests in flight
``--replica-cpus``, ``--replica-gpus`` ``ray_actor_options``; torch's threads = the CPUs
``--host``, ``--port``                 Ray's HTTP proxy (on each node with a replica)
=====================================  =======================================================

Nothing here imports Ray until a deployment is built, so ``quickdraft serve`` without ``--ray``
does not need it (``pip install 'quickdraft[ray]'``).
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import threading

from quickdraft.errors import ConfigError

log = logging.getLogger("quickdraft.deploy")

APP_NAME = "quickdraft"
DEPLOYMENT_NAME = "quickdraft"
# A new local cluster (--ray-address local): the object store only carries request and response
# bodies, so it is kept small (Ray's default is 30% of the machine's memory). A cluster joined
# (or one ray.init starts when none runs here) keeps its own setting.
LOCAL_OBJECT_STORE_BYTES = 128 * 2**20


def deployment_options(args: argparse.Namespace) -> dict:
    """Ray Serve's deployment options from ``quickdraft serve``'s flags (see the module's table).
    Raises ConfigError for flags that contradict each other."""
    scaling = (args.min_replicas, args.max_replicas, args.target_ongoing_requests)
    autoscale = any(v is not None for v in scaling)
    if args.num_replicas is not None and autoscale:
        raise ConfigError("--num-replicas fixes the number of replicas; --min-replicas, --max-replicas and "
                          "--target-ongoing-requests autoscale it: give one or the other", "num_replicas")
    if args.max_num_seqs < 1:
        raise ConfigError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}", "max_num_seqs")
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}", "max_queue")
    if not args.replica_cpus > 0:
        raise ConfigError(f"--replica-cpus must be > 0, got {args.replica_cpus}", "replica_cpus")
    gpus = args.replica_gpus
    if gpus is None:
        gpus = 1 if args.device.startswith("cuda") else 0
    if gpus < 0:
        raise ConfigError(f"--replica-gpus must be >= 0, got {gpus}", "replica_gpus")
    opts = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": args.max_num_seqs,
        "max_queued_requests": args.max_queue,
        "backpressure_config": {"status_code": 429, "retry_after_s": 1},
        "ray_actor_options": {"num_cpus": args.replica_cpus, "num_gpus": gpus},
        "health_check_period_s": 5,
    }
    if args.shutdown_timeout is not None:
        opts["graceful_shutdown_timeout_s"] = args.shutdown_timeout
    if autoscale:
        lo = 1 if args.min_replicas is None else args.min_replicas
        hi = args.max_replicas if args.max_replicas is not None else max(lo, 1)
        target = args.target_ongoing_requests
        if target is None:
            target = max(1.0, args.max_num_seqs / 2)
        if lo < 0 or hi < 1 or lo > hi:
            raise ConfigError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got {lo} "
                              f"and {hi}", "min_replicas")
        if not target > 0:
            raise ConfigError(f"--target-ongoing-requests must be > 0, got {target}", "target_ongoing_requests")
        opts["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi, "initial_replicas": max(lo, 1),
                                      "target_ongoing_requests": target}
    else:
        n = 1 if args.num_replicas is None else args.num_replicas
        if n < 1:
            raise ConfigError(f"--num-replicas must be >= 1, got {n}", "num_replicas")
        opts["num_replicas"] = n
    return opts


def build_application(args: argparse.Namespace):
    """The Ray Serve application: one deployment of ``QuickdraftReplica`` with the flags' options."""
    from quickdraft.deploy.replica import QuickdraftReplica

    from ray import serve

    opts = deployment_options(args)
    threads = max(1, math.floor(args.replica_cpus))
    return serve.deployment(QuickdraftReplica).options(**opts).bind(args, threads)


def parse_builder_args(args: dict) -> argparse.Namespace:
    """``serve run ...:app_builder model=X max_num_seqs=4 ...``: the keys are ``quickdraft
    serve``'s flags without their dashes (``server/cli.py``'s ``args_from_dict``)."""
    from quickdraft.server.cli import args_from_dict

    return args_from_dict(args, "the Ray Serve application's args")


def app_builder(args: dict):
    """The ``serve run`` / ``serve deploy`` entry point (an application builder)."""
    return build_application(parse_builder_args(args))


def serve_on_ray(args: argparse.Namespace) -> int:
    """``quickdraft serve --ray``: deploy, say where, log the replicas' states as they change, and on
    SIGTERM or Ctrl+C delete the application (Ray drains each replica, ``--shutdown-timeout``)."""
    import os

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine unasked
    import ray
    from ray import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    app = build_application(args)  # the flags are checked before anything starts
    init = {"address": args.ray_address, "include_dashboard": False, "log_to_driver": args.log_level == "debug"}
    if args.ray_address == "local":
        init["object_store_memory"] = LOCAL_OBJECT_STORE_BYTES
    ray.init(**init)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        log.info("serving %s through Ray Serve on http://%s:%d (%s)", args.model, args.host, args.port,
                 describe_options(deployment_options(args)))
        watch_replicas(stop)
    finally:
        try:
            serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    return 0


def describe_options(opts: dict) -> str:
    scaling = opts.get("autoscaling_config")
    replicas = (f"{scaling['min_replicas']}..{scaling['max_replicas']} replicas, target "
                f"{scaling['target_ongoing_requests']:g} ongoing requests each" if scaling else
                f"{opts['num_replicas']} replica(s)")
    return f"{replicas}, at most {opts['max_ongoing_requests']} requests each"


def watch_replicas(stop: threading.Event, period_s: float = 1.0) -> None:
    """Log the deployment's replica states whenever they change (``replicas: 2 RUNNING``), until
    ``stop`` is set: a replica that died and came back shows here."""
    from ray import serve

    last = None
    while not stop.is_set():
        try:
            app = serve.status().applications.get(APP_NAME)
            dep = app.deployments.get(DEPLOYMENT_NAME) if app else None
            states = dict(sorted((str(getattr(k, "value", k)), v) for k, v in dep.replica_states.items())) if dep else {}
        except Exception as e:  # the controller restarting: say so and look again
            log.warning("replicas: unknown (%s: %s)", type(e).__name__, e)
            states = None
        if states is not None and states != last:
            log.info("replicas: %s", ", ".join(f"{n} {s}" for s, n in states.items() if n) or "none")
            last = states
        stop.wait(period_s)
