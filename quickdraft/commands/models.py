"""``quickdraft models``: the built-in models, whether they are installed, and their packages."""

from __future__ import annotations


def register(sub) -> None:
    m = sub.add_parser("models", help="list the built-in models")
    m.set_defaults(func=models)


def models(args) -> int:
    from quickdraft.models.registry import list_models

    rows = list_models()
    print(f"{'name':32} {'installed':10} {'size':>10}  packages")
    for r in rows:
        size = f"{r.size / 2**20:.0f} MiB" if r.size else "-"
        pkgs = r.packages[0] if len(r.packages) == 1 else f"{r.packages[0]} .. {r.packages[-1]} ({len(r.packages)})"
        print(f"{r.name:32} {'yes' if r.installed else 'no':10} {size:>10}  {pkgs}")
    return 0
