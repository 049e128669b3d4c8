"""Every kustomization in k8s/ renders, validates strictly against the Kubernetes API schemas, and the fallback
renderer (tests/k8s/render.py, used where kubectl is absent) gives exactly what kubectl gives."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.k8s.manifests import KUSTOMIZATIONS, rendered
from tests.k8s.render import UnsupportedKustomization, build, render_with_kubectl

pytestmark = pytest.mark.k8s

#: the oldest Kubernetes docs/kubernetes.md supports (gRPC probes are GA from 1.27) and the newest the validator knows
KUBERNETES_VERSIONS = ("1.27", kubernetes_validate.latest_version())
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def key(doc: dict) -> tuple[str, str, str, str]:  # type: ignore[type-arg]
    return doc["apiVersion"], doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_renders_distinct_objects(name: str) -> None:
    objs = rendered(name)
    assert objs, f"{name} renders nothing"
    keys = [key(o) for o in objs]
    assert len(keys) == len(set(keys)), f"{name}: an object appears twice"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_validates_strictly(name: str, version: str) -> None:
    for obj in rendered(name):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {obj['kind']} {obj['metadata']['name']} is invalid for Kubernetes {version}: {exc}")


@needs_kubectl
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_fallback_renderer_equals_kubectl(name: str) -> None:
    ours = {key(o): o for o in build(KUSTOMIZATIONS[name])}
    theirs = {key(o): o for o in render_with_kubectl(KUSTOMIZATIONS[name])}
    assert sorted(ours) == sorted(theirs)
    for k, obj in theirs.items():
        assert ours[k] == obj, f"{name}: {k[1]} {k[3]} differs between tests/k8s/render.py and kubectl kustomize"


def _write(directory: Path, files: Mapping[str, object]) -> None:
    """Write each object as YAML; a ``*.multi.yaml`` list as one document per item."""
    for rel, content in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".multi.yaml") and isinstance(content, list):
            path.write_text(yaml.safe_dump_all(content))
        else:
            path.write_text(yaml.safe_dump(content))


EDGE_CASES: dict[str, object] = {
    "base/kustomization.yaml": {
        "namespace": "edge",
        "labels": [{"pairs": {"team": "ml"}, "includeSelectors": False}],
        "resources": ["objects.multi.yaml"],
        "configMapGenerator": [{"name": "cfg", "literals": ["a=1", "quoted=\"x y\"", "html=<&>"]}],
        "secretGenerator": [
            {"name": "long", "literals": ["k=" + "v" * 120, "short=s"]},
            {"name": "fixed", "literals": ["k=v"], "options": {"disableNameSuffixHash": True}},
        ],
        "images": [{"name": "app", "newName": "registry.example/app", "newTag": "1.2.3"},
                   {"name": "side", "digest": "sha256:" + "a" * 64}],
    },
    "base/objects.multi.yaml": [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "whatever"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "cr"},
         "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
         "spec": {"selector": {"matchLabels": {"app": "d"}}, "template": {"metadata": {"labels": {"app": "d"}}, "spec": {
             "initContainers": [{"name": "i", "image": "side:0.1"}],
             "containers": [{"name": "c", "image": "app", "env": [
                 {"name": "A", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "a"}}},
                 {"name": "B", "valueFrom": {"secretKeyRef": {"name": "long", "key": "k"}}}],
                 "envFrom": [{"secretRef": {"name": "fixed"}}]}],
             "volumes": [{"name": "v", "projected": {"sources": [{"configMap": {"name": "cfg"}}, {"secret": {"name": "long"}}]}}],
         }}}},
    ],
    "overlay/kustomization.yaml": {
        "resources": ["../base"],
        "namespace": "edge",
        "configMapGenerator": [{"name": "cfg", "behavior": "merge", "literals": ["b=2"]}],
        "patches": [{"path": "patch.yaml", "target": {"kind": "Deployment", "name": "d"}}],
    },
    "overlay/patch.yaml": [
        {"op": "add", "path": "/spec/template/spec/containers/0/env/0", "value": {"name": "FIRST", "value": "1"}},
        {"op": "remove", "path": "/spec/template/spec/containers/0/envFrom"},
        {"op": "replace", "path": "/spec/template/metadata/labels/app", "value": "d"},
        {"op": "add", "path": "/metadata/annotations", "value": {"example.com~1x": "plain"}},
        {"op": "add", "path": "/metadata/annotations/a~1b", "value": "slash"},
    ],
}  # fmt: skip


@needs_kubectl
@pytest.mark.parametrize("level", ["base", "overlay"])
def test_fallback_renderer_equals_kubectl_on_edge_cases(tmp_path: Path, level: str) -> None:
    """Features k8s/ may use that its overlays do not exercise yet: long Secret values, merge, digests, escapes."""
    _write(tmp_path, EDGE_CASES)
    ours = {key(o): o for o in build(tmp_path / level)}
    theirs = {key(o): o for o in render_with_kubectl(tmp_path / level)}
    assert ours == theirs


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        ({"kustomization.yaml": {"resources": ["cm.yaml"], "commonLabels": {"a": "b"}}}, "commonLabels"),
        ({"kustomization.yaml": {"resources": ["cm.yaml"], "labels": [{"pairs": {"a": "b"}, "includeSelectors": True}]}}, "labels"),
        ({"kustomization.yaml": {"resources": ["cm.yaml"], "patches": [{"path": "p.yaml", "target": {"kind": "ConfigMap"}}]},
          "p.yaml": {"data": {"k": "w"}}}, "JSON 6902"),
        ({"kustomization.yaml": {"resources": ["cm.yaml"], "patches": [{"path": "p.yaml", "target": {"kind": "ConfigMap"}}]},
          "p.yaml": [{"op": "move", "from": "/data/k", "path": "/data/j"}]}, "move"),
    ],
)  # fmt: skip
def test_fallback_renderer_refuses_what_it_does_not_emulate(tmp_path: Path, files: dict[str, object], problem: str) -> None:
    _write(tmp_path, {"cm.yaml": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"k": "v"}}, **files})
    with pytest.raises(UnsupportedKustomization, match=problem):
        build(tmp_path)
