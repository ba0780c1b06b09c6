"""The package's layers: what a module imports, read from the source (no import circle; proposers
look down to the pass costs in models/, never up to the engine) and from a fresh interpreter (a server replica
loads no other command; the proposer registry loads only the method asked for)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import quickdraft

PACKAGE = Path(quickdraft.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(path: Path, known: dict) -> set[str]:
    """The quickdraft modules ``path`` imports at run time, anywhere in it (a function's lazy
    import included; ``if TYPE_CHECKING:`` blocks left out)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names}
    return {m for m in out if m in known}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(f, known) - {m} for m, f in known.items()}


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    """Not even through a lazy import inside a function: the draft proposers share their loading
    and sampling through proposers/draft/load.py and proposers/draft_sampling.py, below both."""
    circles = _circles(_graph())
    assert not circles, f"import circles: {[sorted(c) for c in circles]}"


def test_proposers_look_down_to_the_pass_costs_not_up_to_the_engine():
    graph = _graph()
    for module, deps in graph.items():
        if module.startswith("quickdraft.proposers."):
            up = sorted(d for d in deps if d.startswith(("quickdraft.engine", "quickdraft.server", "quickdraft.commands",
                                                         "quickdraft.bench", "quickdraft.train")))
            assert not up, f"{module} imports {up}"


def test_nothing_below_the_commands_imports_them():
    graph = _graph()
    for module, deps in graph.items():
        if not module.startswith("quickdraft.commands") and module not in ("quickdraft.__main__", "quickdraft.cli",
                                                                             "quickdraft.demo"):
            assert not any(d.startswith("quickdraft.commands") for d in deps), f"{module} imports a command"


def test_only_the_bench_imports_the_bench():
    """bench/ is a command (bench/cli.py, which commands/cli.py registers by name), not a library:
    what it shares with other commands (data sets, statistics, report tables) lives below them, in
    evaluation/."""
    for module, deps in _graph().items():
        if not module.startswith("quickdraft.bench"):
            up = sorted(d for d in deps if d.startswith("quickdraft.bench"))
            assert not up, f"{module} imports {up}"


# The layers, each with the layers it may import besides itself and "base" (errors, version),
# lowest first: a module's layer is its package under quickdraft/ (PACKAGES), or for a module at
# the root, its entry in ROOT_MODULES. "commands" may import anything; nothing imports it.
ALLOWED = {
    "base": set(),
    "kernels": set(),  # the native layer: nothing of quickdraft
    "models": {"kernels"},
    "sampling": {"kernels"},  # logits -> probabilities, grammars' masks
    "verify": {"sampling", "kernels"},
    "config": set(),
    # models/pass_cost.py, what a pass costs, sits in models so that proposers, which time their
    # own passes, share it; the plan that spends it is the engine's (engine/plan.py)
    "proposers": {"verify", "sampling", "models", "kernels", "config"},
    "engine": {"proposers", "verify", "sampling", "models", "kernels", "config"},
    "api": {"engine", "proposers", "verify", "sampling", "models", "kernels", "config"},
    "arguments": {"models", "config"},  # the flags the commands and the server share
    "server": {"api", "arguments", "engine", "proposers", "verify", "sampling", "models", "kernels", "config"},
    # what the commands and the bench share: prompt sets, statistics, measurements, report tables
    "evaluation": {"sampling", "models", "kernels", "config"},
    "commands": None,  # anything
}
PACKAGES = {"kernels": "kernels", "models": "models", "verify": "verify", "proposers": "proposers", "engine": "engine",
            "server": "server", "deploy": "server", "evaluation": "evaluation", "commands": "commands",
            "bench": "commands", "train": "commands"}
ROOT_MODULES = {
    "quickdraft": "api", "quickdraft.llm": "api", "quickdraft.errors": "base", "quickdraft.version": "base",
    "quickdraft.config": "config", "quickdraft.sampling": "sampling", "quickdraft.structured": "sampling",
    "quickdraft.arguments": "arguments",
    "quickdraft.cli": "commands", "quickdraft.__main__": "commands", "quickdraft.demo": "commands",
}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in PACKAGES):
        return PACKAGES[parts[1]]
    assert module in ROOT_MODULES, f"{module}: a module at the package root; give it a layer in ROOT_MODULES"
    return ROOT_MODULES[module]


def test_every_layer_imports_only_the_layers_below_it():
    """The folder tree is the layering: commands -> server -> api -> engine -> proposers -> verify,
    models -> kernels, with evaluation/ under the commands (ALLOWED says exactly which), checked on
    every import, lazy ones included."""
    assert all(set(v or ()) <= set(ALLOWED) for v in ALLOWED.values())
    wrong = []
    for module, deps in _graph().items():
        layer = _layer(module)
        allowed = ALLOWED[layer]
        if allowed is None:
            continue
        wrong += [f"{module} ({layer}) imports {d} ({_layer(d)})" for d in sorted(deps)
                  if _layer(d) not in allowed | {layer, "base"}]
    assert not wrong, "\n".join(wrong)


def _loaded_after(code: str) -> set[str]:
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('quickdraft'))))"
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       cwd=PACKAGE.parent)
    assert p.returncode == 0, p.stderr
    return set(json.loads(p.stdout.strip().splitlines()[-1]))


def _all_loaded_after(code: str) -> set[str]:
    """Every module a fresh interpreter holds after ``code``, torch's included."""
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=PACKAGE.parent)
    assert p.returncode == 0, p.stderr
    return set(json.loads(p.stdout.strip().splitlines()[-1]))


def test_importing_the_package_or_the_isa_table_loads_no_torch_and_no_engine():
    """``import quickdraft`` names LLM, SamplingParams, ... lazily (PEP 562); the ISA table is
    plain Python that ``quickdraft check`` and the build read without the rest."""
    for code in ("import quickdraft", "import quickdraft.kernels.isa"):
        loaded = _all_loaded_after(code)
        assert "torch" not in loaded, code
        assert not {m for m in loaded if m.startswith(("quickdraft.engine", "quickdraft.llm"))}, code
    loaded = _all_loaded_after("import quickdraft\nquickdraft.LLM, quickdraft.SamplingParams, quickdraft.RequestOutput")
    assert {"torch", "quickdraft.llm", "quickdraft.engine.engine"} <= loaded


def test_a_server_replica_imports_only_the_serve_arguments():
    loaded = _loaded_after("from quickdraft.server.cli import args_from_dict, serve_parser\n"
                           "args_from_dict({'model': 'x.gguf', 'max_num_seqs': 4}, 'a test')\nserve_parser()")
    for other in ("quickdraft.bench", "quickdraft.commands", "quickdraft.commands.advise", "quickdraft.train",
                  "quickdraft.commands.check", "quickdraft.commands.profile", "quickdraft.deploy.ray_serve"):
        assert other not in loaded, other


def test_the_proposer_registry_imports_only_the_method_asked_for():
    proposers = {"quickdraft.proposers." + m for m in ("none", "lookup.ngram", "lookup.suffix", "draft.model",
                                                       "heads.eagle3", "heads.medusa", "draft.layer_skip")}
    assert not _loaded_after("import quickdraft.proposers.base") & proposers
    loaded = _loaded_after("from quickdraft.proposers.base import proposer_class\nproposer_class('ngram')")
    assert loaded & proposers == {"quickdraft.proposers.lookup.ngram"}


def test_the_registry_table_names_every_method_and_class():
    from quickdraft.config import METHODS
    from quickdraft.proposers.base import REGISTRY, proposer_class

    assert set(REGISTRY) == set(METHODS)
    for method in REGISTRY:
        assert proposer_class(method).method == method
