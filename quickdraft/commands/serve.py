"""``quickdraft serve [MODEL]``: the OpenAI-compatible server here (server/cli.py builds it), or
its replicas on Ray Serve with ``--ray`` (deploy/ray_serve.py). The flags are server/cli.py's, so
that a replica parses them without this module."""

from __future__ import annotations

import logging
import sys

from quickdraft.arguments import DEFAULT_MODEL
from quickdraft.server.cli import HELP, DrainingServer, add_serve_args, build, ray_only_flags, run_on_main_thread


def register(sub) -> None:
    s = sub.add_parser("serve", help=HELP)
    add_serve_args(s)
    s.set_defaults(func=serve)


def serve(args) -> int:
    from quickdraft.models.pass_cost import describe

    if args.ray:
        from quickdraft.deploy.ray_serve import serve_on_ray

        return serve_on_ray(args)
    if ray_only_flags(args):
        from quickdraft.errors import ConfigError

        raise ConfigError(f"{', '.join(ray_only_flags(args))} place Ray Serve replicas: add --ray", "ray")
    if getattr(args, "model_positional", None) is None and args.model == DEFAULT_MODEL:  # vLLM would refuse
        print(f"quickdraft serve: no model named, serving the built-in {DEFAULT_MODEL} "
              "(name one: quickdraft serve MODEL)", file=sys.stderr)
    async_engine, settings, app = build(args, own_thread=False)
    engine, spec, names = async_engine.engine, async_engine.engine.config.speculative, settings.served_model_names
    import uvicorn

    uv = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                        access_log=args.access_log, timeout_graceful_shutdown=args.shutdown_timeout)
    server = DrainingServer(uv, settings)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    log = logging.getLogger("quickdraft.server")
    log.info("serving %s as %s on http://%s:%d (speculative: %s, K=%d%s, off from batch %s; %d slots, queue %d; "
             "prefix caching %s)", args.model, names, args.host, args.port, spec.method, settings.num_speculative_tokens,
             " adaptive" if spec.adaptive else "", spec.disable_by_batch_size, args.max_num_seqs, args.max_queue,
             "on" if args.enable_prefix_caching else "off")
    for name, cost in (("target", engine.runner.target_cost), ("draft", engine.proposer.cost)):
        if cost is not None:
            log.info("%s pass, calibrated: %s", name, describe(cost.to_dict()))
    return run_on_main_thread(server, async_engine)
