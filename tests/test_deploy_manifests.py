"""The deployment manifests of ``deploy/``: KubeRay's kinds against KubeRay's JSON Schemas,
Kubernetes' own kinds against Kubernetes' (``kubernetes-validate``), the Ray cluster launcher's
YAML against Ray's schema, and the Prometheus configuration with ``promtool``. A misspelt field
must fail each check, so each check is also run on a copy with one."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import ray
import yaml

from tandem.cluster.topology import Topology

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.33"


def _kuberay_schemas() -> Path:
    """KubeRay's schemas: ``TANDEM_KUBERAY_SCHEMAS``, or ``shared/schemas/kuberay`` beside the
    checkout or at the workspace root."""
    candidates = [
        os.environ.get("TANDEM_KUBERAY_SCHEMAS", ""),
        ROOT.parent / "shared" / "schemas" / "kuberay",
        Path("/work/shared/schemas/kuberay"),
    ]
    for candidate in candidates:
        if candidate and (Path(candidate) / "raycluster_v1.json").is_file():
            return Path(candidate)
    pytest.skip("KubeRay's JSON Schemas are not here; set TANDEM_KUBERAY_SCHEMAS to their folder")


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _kuberay_validator(kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads((_kuberay_schemas() / f"{kind.lower()}_v1.json").read_text())
    return jsonschema.Draft7Validator(schema)


KUBERAY = {"RayCluster", "RayJob", "RayService"}


def _all_kuberay_documents() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{p.name}#{i}", d)
        for p in sorted((DEPLOY / "kuberay").glob("*.yaml"))
        for i, d in enumerate(_documents(p))
    ]


@pytest.mark.parametrize(
    ("name", "document"), _all_kuberay_documents(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_kuberay_manifest_is_valid(name: str, document: dict[str, Any]) -> None:
    if document["kind"] in KUBERAY:
        errors = sorted(_kuberay_validator(document["kind"]).iter_errors(document), key=str)
        assert not errors, f"{name}: {errors[0].message} at {list(errors[0].absolute_path)}"
    else:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def _misspell(document: dict[str, Any], path: list[str], wrong: str) -> dict[str, Any]:
    """A copy with the field at ``path`` renamed to ``wrong``."""
    out = copy.deepcopy(document)
    node = out
    for key in path[:-1]:
        node = node[key] if not key.isdigit() else node[int(key)]  # type: ignore[index]
    node[wrong] = node.pop(path[-1])
    return out


def test_a_misspelt_field_fails_each_kind() -> None:
    cluster = _documents(DEPLOY / "kuberay" / "raycluster.yaml")[0]
    bad = _misspell(cluster, ["spec", "workerGroupSpecs", "0", "rayStartParams"], "rayStartParam")
    assert not list(_kuberay_validator("RayCluster").iter_errors(cluster))
    assert list(_kuberay_validator("RayCluster").iter_errors(bad))

    job = _documents(DEPLOY / "kuberay" / "rayjob.yaml")[0]
    assert list(
        _kuberay_validator("RayJob").iter_errors(_misspell(job, ["spec", "entrypoint"], "entryPoint"))
    )

    service = _documents(DEPLOY / "kuberay" / "service.yaml")[0]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            _misspell(service, ["spec", "ports", "0", "appProtocol"], "appProtocl"),
            KUBERNETES_VERSION,
            strict=True,
        )


def test_the_node_labels_match_the_default_placement() -> None:
    """The worker groups carry the labels the topology's placement selects by, and the service
    exposes gRPC as h2c and the metrics port."""
    placement = Topology().placement
    cluster = _documents(DEPLOY / "kuberay" / "raycluster.yaml")[0]
    labels = {g["groupName"]: g["labels"][placement.label_key] for g in cluster["spec"]["workerGroupSpecs"]}
    assert labels == {"prefill": placement.prefill_label, "decode": placement.decode_label}
    for group in cluster["spec"]["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1
    ports = {p["name"]: p for p in _documents(DEPLOY / "kuberay" / "service.yaml")[0]["spec"]["ports"]}
    assert ports["grpc"]["appProtocol"] == "kubernetes.io/h2c" and ports["metrics"]["port"] == 9400
    launcher = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    types = launcher["available_node_types"]
    assert types["prefill"]["labels"] == {placement.label_key: placement.prefill_label}
    assert types["decode"]["labels"] == {placement.label_key: placement.decode_label}


def _ray_launcher_schema() -> jsonschema.Draft7Validator:
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    return jsonschema.Draft7Validator(schema)


def test_the_ray_cluster_launcher_yaml_is_valid() -> None:
    config = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    errors = list(_ray_launcher_schema().iter_errors(config))
    assert not errors, errors[0].message
    bad = _misspell(config, ["available_node_types", "decode", "min_workers"], "min_worker")
    assert list(_ray_launcher_schema().iter_errors(bad))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool comes with Debian's prometheus")
def test_the_prometheus_scrape_configuration_is_valid(tmp_path: Path) -> None:
    config_map = _documents(DEPLOY / "kuberay" / "prometheus-scrape.yaml")[0]
    path = tmp_path / "prometheus.yml"
    path.write_text(config_map["data"]["prometheus.yml"])
    check = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    path.write_text(config_map["data"]["prometheus.yml"].replace("http_sd_configs", "http_sd_config"))
    assert subprocess.run(["promtool", "check", "config", str(path)], capture_output=True).returncode != 0
