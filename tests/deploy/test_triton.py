"""The Triton model repository in ``deploy/triton``.

* ``config.pbtxt`` is parsed by protobuf with Triton's own ModelConfig message (tritonclient's
  model_config_pb2).
* ``model.py`` runs against a stub of ``triton_python_backend_utils`` (the module Triton's Python
  backend provides): greedy responses, streamed and not, equal ``LLM.generate``; a bad parameter
  is an error response; a model without the decoupled policy refuses to load.
* The real Triton Inference Server that ``nvidia-pytriton`` bundles (``tritonserver`` 2.51 with its
  Python backend and stubs; it runs on this CPU without a GPU) serves the same repository on
  loopback, and its generate and generate_stream endpoints answer like ``LLM.generate``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

MODEL = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[2]
REPO = ROOT / "deploy" / "triton"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
MAX_TOKENS = 10
# float32 (greedy equality is exact there) and a short context: quick to build in a test
TEST_PARAMETERS = {"dtype": "float32", "max_model_len": "256", "max_num_seqs": "4"}


def _config() -> model_config_pb2.ModelConfig:
    return text_format.Parse((REPO / "quickdraft" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def test_config_parses_as_tritons_model_config():
    c = _config()
    assert (c.name, c.backend, c.max_batch_size) == ("quickdraft", "python", 0)
    assert c.model_transaction_policy.decoupled
    inputs = {i.name: i for i in c.input}
    assert not inputs["text_input"].optional and all(i.optional for n, i in inputs.items() if n != "text_input")
    assert set(inputs) == {"text_input", "stream", "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos"}
    assert {o.name for o in c.output} == {"text_output", "token_ids", "finish_reason"}
    from quickdraft.server.cli import args_from_dict

    args = args_from_dict({k: v.string_value for k, v in c.parameters.items()}, "config.pbtxt")
    assert args.model == MODEL


@pytest.fixture(scope="module")
def reference(smollm2_path):
    from quickdraft import LLM, SamplingParams

    with LLM(MODEL, dtype="float32", max_model_len=256, max_num_seqs=4) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [(o.text, o.token_ids, o.finish_reason) for o in outs]


# -- model.py against a stub of the backend's module --------------------------------------------
class _Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class _Response:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name(): t.as_numpy() for t in output_tensors}
        self.error = error


class _Error:
    def __init__(self, message):
        self.message = message


def _stub_module() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Tensor, pb.InferenceResponse, pb.TritonError = _Tensor, _Response, _Error
    pb.TritonModelException = type("TritonModelException", (Exception,), {})
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    pb.using_decoupled_model_transaction_policy = lambda config: config["model_transaction_policy"]["decoupled"]
    return pb


class _Request:
    """A request and its response sender: what the model sent, and when it sent the final one."""

    def __init__(self, **inputs):
        self.inputs = {k: _Tensor(k, np.array([v], dtype=np.object_ if isinstance(v, bytes) else None))
                       for k, v in inputs.items()}
        self.responses, self.done = [], threading.Event()

    def get_response_sender(self):
        return self

    def send(self, response=None, flags=0):
        if response is not None:
            self.responses.append(response)
        if flags == 1:
            self.done.set()

    def is_cancelled(self):
        return False


def _model_config(decoupled: bool = True) -> str:
    params = {k: {"string_value": v.string_value} for k, v in _config().parameters.items()}
    params.update({k: {"string_value": v} for k, v in TEST_PARAMETERS.items()})
    return json.dumps({"model_transaction_policy": {"decoupled": decoupled}, "parameters": params})


@pytest.fixture(scope="module")
def stub_model(smollm2_path):
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = _stub_module()
    sys.modules.pop("quickdraft.deploy.triton", None)
    try:
        spec = importlib.util.spec_from_file_location("triton_model", REPO / "quickdraft" / "1" / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # as Triton's Python backend loads it
        model = module.TritonPythonModel()
        model.initialize({"model_config": _model_config()})
        yield module, model
        model.finalize()
    finally:
        sys.modules.pop("quickdraft.deploy.triton", None)
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved


def _run(model, requests):
    model.execute(requests)
    for r in requests:
        assert r.done.wait(60), "no final response"
    return requests


def _text(response) -> str:
    return response.outputs["text_output"][0].decode()


def test_stub_backend_answers_like_llm_generate(stub_model, reference):
    _, model = stub_model
    plain = [_Request(text_input=p.encode(), max_tokens=np.int32(MAX_TOKENS)) for p in PROMPTS]
    streamed = [_Request(text_input=p.encode(), max_tokens=np.int32(MAX_TOKENS), stream=True) for p in PROMPTS]
    _run(model, plain + streamed)  # one batch: six requests in the engine at once
    for r, (text, ids, reason) in zip(plain, reference):
        (resp,) = r.responses
        assert resp.error is None and _text(resp) == text
        assert resp.outputs["token_ids"].tolist() == ids and resp.outputs["finish_reason"][0].decode() == reason
    for r, (text, ids, reason) in zip(streamed, reference):
        assert len(r.responses) > 1 and all(x.error is None for x in r.responses)
        assert "".join(_text(x) for x in r.responses) == text
        assert [t for x in r.responses for t in x.outputs["token_ids"].tolist()] == ids
        assert [x.outputs["finish_reason"][0].decode() for x in r.responses][-1] == reason


def test_stub_backend_errors(stub_model):
    module, model = stub_model
    bad = _Request(text_input=b"hi", temperature=np.float32(-1))
    missing = _Request(max_tokens=np.int32(3))
    _run(model, [bad, missing])
    assert "temperature" in bad.responses[0].error.message
    assert "text_input" in missing.responses[0].error.message
    with pytest.raises(Exception, match="decoupled"):
        module.TritonPythonModel().initialize({"model_config": _model_config(decoupled=False)})


# -- the real Triton server ------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def triton(tmp_path_factory, smollm2_path):
    spec = importlib.util.find_spec("pytriton")
    if spec is None:
        if os.environ.get("CI"):
            pytest.fail("nvidia-pytriton is not installed (make test installs it)")
        pytest.skip("nvidia-pytriton is not installed: pip install --no-deps nvidia-pytriton==0.7.0")
    bundled = Path(spec.submodule_search_locations[0]) / "tritonserver"
    tmp = tmp_path_factory.mktemp("triton")
    backend = tmp / "backends" / "python"
    shutil.copytree(bundled / "backends" / "python", backend)
    shutil.copy(bundled / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" /
                "triton_python_backend_stub", backend)
    repo = tmp / "repo"
    shutil.copytree(REPO, repo)
    config = repo / "quickdraft" / "config.pbtxt"
    kept = [line for line in config.read_text().splitlines(keepends=True)
            if not any(f'key: "{k}"' in line for k in TEST_PARAMETERS)]
    config.write_text("".join(kept) + "".join(
        f'parameters: {{ key: "{k}", value: {{ string_value: "{v}" }} }}\n' for k, v in TEST_PARAMETERS.items()))
    http = _free_port()
    # The stub, copied out of the wheel, finds the libraries the wheel bundles (its CUDA runtime)
    # there, and the libpython of the interpreter running these tests first (else the system's
    # 3.11: another Python, whose headers would make torch rebuild quickdraft's kernels, minutes).
    libs = [sysconfig.get_config_var("LIBDIR"), str(Path(spec.submodule_search_locations[0]).parent / "nvidia_pytriton.libs"),
            os.environ.get("LD_LIBRARY_PATH")]
    # The bundled backend's stub reads tensors through numpy's 1.x layout (nvidia-pytriton pins
    # numpy < 2): the stub gets numpy 1.26 from here, ahead of the environment's (Makefile).
    old_numpy = Path(sys.prefix) / "triton-site"
    if not (old_numpy / "numpy").is_dir():
        pytest.skip(f"no numpy 1.x for Triton's Python backend in {old_numpy} (make test installs it)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(old_numpy), str(ROOT), sysconfig.get_paths()["purelib"]]),
           "LD_LIBRARY_PATH": os.pathsep.join(filter(None, libs))}
    log = open(tmp / "triton.log", "wb")
    proc = subprocess.Popen(
        [str(bundled / "bin" / "tritonserver"), f"--model-repository={repo}", f"--backend-directory={tmp / 'backends'}",
         "--http-address=127.0.0.1", f"--http-port={http}", "--allow-grpc=false", "--allow-metrics=false",
         "--exit-timeout-secs=20"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http}"
    try:
        _wait_ready(proc, url, tmp / "triton.log")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_ready(proc, url: str, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"tritonserver exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/v2/models/quickdraft/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        text = log.read_text(errors="replace")
        assert time.monotonic() < deadline and "failed to load" not in text and "error while loading" not in text, \
            text[-4000:]
        time.sleep(0.5)


@pytest.mark.slow
def test_tritonserver_generate_and_stream(triton, reference):
    with httpx.Client(timeout=120) as c:
        for prompt, (text, ids, reason) in zip(PROMPTS, reference):
            r = c.post(triton + "/v2/models/quickdraft/generate", json={"text_input": prompt, "max_tokens": MAX_TOKENS})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["text_output"] == text and body["token_ids"] == ids and body["finish_reason"] == reason
            events = []
            with c.stream("POST", triton + "/v2/models/quickdraft/generate_stream",
                          json={"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True}) as s:
                assert s.status_code == 200
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
            assert len(events) > 1 and "".join(e["text_output"] for e in events) == text
            # the generate endpoint's JSON gives a one-element tensor as a scalar
            streamed = [t for e in events for t in (e["token_ids"] if isinstance(e["token_ids"], list) else [e["token_ids"]])]
            assert streamed == ids and events[-1]["finish_reason"] == reason
        bad = c.post(triton + "/v2/models/quickdraft/generate", json={"text_input": "hi", "temperature": -1.0})
        assert bad.status_code == 400 and "temperature" in bad.json()["error"]
