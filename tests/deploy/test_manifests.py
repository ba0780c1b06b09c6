"""The deployment files in ``deploy/``, checked offline.

* Kubernetes objects against Kubernetes' own OpenAPI schemas, strict (an unknown field is an
  error), by kubernetes-validate with jsonschema, for the oldest and newest versions named here.
  KubeRay's RayService is a custom resource with no schema here: its pod templates are validated
  as Kubernetes PodTemplates, its serveConfigV2 by Ray Serve's own config schema.
* What the schemas cannot see: the container's args are flags ``quickdraft serve`` accepts; the
  probes' paths are the app's; the grace period covers preStop and the drain; the HPA's metrics
  are gauges the server exports, under the names the adapter rules give them.
"""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from quickdraft.commands.cli import build_parser
from quickdraft.deploy.ray_serve import deployment_options, parse_builder_args
from quickdraft.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VERSIONS = ("1.30.0", "1.37.0")  # preStop's sleep action is on by default from 1.30


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _all() -> dict[str, dict]:
    return {f"{p.name}:{d['kind']}": d for p in sorted(K8S.glob("*.yaml")) for d in _docs(p.name)}


def _validate(doc: dict, version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("key", [k for k, d in _all().items() if d["apiVersion"] != "ray.io/v1"])
def test_kubernetes_objects_match_the_schema(key, version):
    _validate(_all()[key], version)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_validator_is_strict(version):
    """A misspelt field fails: the test above would catch one."""
    doc = _docs("deployment.yaml")[0]
    doc["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(doc, version)


def _container() -> dict:
    return _docs("deployment.yaml")[0]["spec"]["template"]["spec"]["containers"][0]


def test_deployment_args_are_quickdraft_serve_flags():
    c = _container()
    args = build_parser().parse_args(c["args"])
    assert args.host == "0.0.0.0" and str(args.port) == str(c["ports"][0]["containerPort"])
    assert args.shutdown_timeout and args.max_num_seqs >= 1
    env = {e["name"]: e for e in c["env"]}
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert env["QUICKDRAFT_CACHE"]["value"] == mount["cache"]  # the model cache is the volume
    assert int(env["OMP_NUM_THREADS"]["value"]) == int(c["resources"]["requests"]["cpu"])


def test_probes_and_grace_period_fit_the_drain():
    spec = _docs("deployment.yaml")[0]["spec"]["template"]["spec"]
    c = spec["containers"][0]
    app_routes = re.findall(r'app\.get\("([^"]+)"\)', (ROOT / "quickdraft/server/app.py").read_text())
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] in app_routes, probe
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"  # the route that turns 503 while draining
    drain = build_parser().parse_args(c["args"]).shutdown_timeout
    assert spec["terminationGracePeriodSeconds"] >= c["lifecycle"]["preStop"]["sleep"]["seconds"] + drain + 5


def test_hpa_scales_on_gauges_the_server_exports():
    exported = {f.name for f in ServerMetrics("m").registry.collect() if f.type == "gauge"}
    rules = yaml.safe_load(_docs("prometheus-adapter-rules.yaml")[0]["data"]["config.yaml"])["rules"]
    exposed = {}
    for rule in rules:
        series = rule["seriesQuery"].split("{")[0]
        assert series in exported, series
        renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
        exposed[renamed] = series
    hpa = _docs("hpa.yaml")[0]
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert names and set(names) <= set(exposed), (names, exposed)
    assert "quickdraft:num_requests_waiting" in {exposed[n] for n in names}  # the queue gauge
    assert hpa["spec"]["scaleTargetRef"]["name"] == _docs("deployment.yaml")[0]["metadata"]["name"]


def test_service_and_volume_point_at_the_deployment():
    dep = _docs("deployment.yaml")[0]
    svc = _docs("service.yaml")[0]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == _container()["ports"][0]["name"]
    claim = dep["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == _docs("pvc.yaml")[0]["metadata"]["name"]


# -- Ray Serve's config and KubeRay's RayService ----------------------------------------------
def _serve_configs() -> list[dict]:
    ray_service = _docs("rayservice.yaml")[0]
    return [yaml.safe_load((ROOT / "deploy/ray/serve-config.yaml").read_text()),
            yaml.safe_load(ray_service["spec"]["serveConfigV2"])]


def test_serve_configs_match_ray_serves_schema_and_build():
    from ray.serve.schema import ServeDeploySchema

    file_config, ray_service_config = _serve_configs()
    assert file_config == ray_service_config  # one configuration, two places
    ServeDeploySchema.model_validate(file_config)
    for app in file_config["applications"]:
        assert app["import_path"] == "quickdraft.deploy.ray_serve:app_builder"
        opts = deployment_options(parse_builder_args(app["args"]))
        assert opts["max_ongoing_requests"] == app["args"]["max_num_seqs"]
        assert opts["autoscaling_config"]["max_replicas"] == app["args"]["max_replicas"]


@pytest.mark.parametrize("version", VERSIONS)
def test_rayservice_pod_templates_match_the_schema(version):
    doc = _docs("rayservice.yaml")[0]
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    cluster = doc["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())  # KubeRay wants strings
        _validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                   "template": group["template"]}, version)
    worker = cluster["workerGroupSpecs"][0]
    args = _serve_configs()[1]["applications"][0]["args"]
    assert float(worker["rayStartParams"]["num-cpus"]) >= args["replica_cpus"]  # a replica fits a worker
    assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]


def test_dockerfile_installs_the_ray_extra_and_models():
    text = (ROOT / "deploy/Dockerfile").read_text()
    assert '"/src[ray]"' in text and "ENTRYPOINT [\"quickdraft\"]" in text
