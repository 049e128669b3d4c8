"""The rules every rendered pod follows: resources, Guaranteed QoS for the store, hardened security contexts,
pinned images, and the store's memory, grace period, probes and rollout settings against its own config."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.manifests import (
    GIB,
    KUSTOMIZATIONS,
    ROOT,
    STORE_DEPLOYMENTS,
    STORE_OVERHEAD_BYTES,
    container,
    find,
    one,
    port_of,
    quantity,
    rendered,
    spec_of,
    store_setup,
    workloads,
)
from tests.k8s.render import containers, split_image

pytestmark = pytest.mark.k8s

ALL = list(KUSTOMIZATIONS)


def every_container(name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(doc, c) for doc in workloads(rendered(name)) for c in containers(spec_of(doc))]


def test_there_are_pods_to_check() -> None:
    for name in ALL:
        assert every_container(name), f"{name} has no containers"


@pytest.mark.parametrize("name", ALL)
def test_every_container_requests_and_limits_cpu_and_memory(name: str) -> None:
    for doc, c in every_container(name):
        res = c.get("resources", {})
        for part in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                assert resource in res.get(part, {}), f"{name}: {doc['metadata']['name']}/{c['name']} has no {part}.{resource}"


@pytest.mark.parametrize("name", STORE_DEPLOYMENTS)
def test_store_pod_is_guaranteed_qos(name: str) -> None:
    for c in containers(spec_of(one(rendered(name), "DaemonSet", "memstore"))):
        res = c["resources"]
        for resource in ("cpu", "memory"):
            assert quantity(res["requests"][resource]) == quantity(res["limits"][resource]), (
                f"{name}: {c['name']} {resource} requests != limits (the store pod must be Guaranteed QoS)"
            )


@pytest.mark.parametrize("name", ALL)
def test_every_container_is_hardened(name: str) -> None:
    for doc, c in every_container(name):
        where = f"{name}: {doc['metadata']['name']}/{c['name']}"
        pod_sc = spec_of(doc).get("securityContext", {})
        sc = c.get("securityContext", {})
        assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, f"{where}: runAsNonRoot"
        uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
        assert isinstance(uid, int) and uid > 0, f"{where}: runAsUser must be a non-root uid"
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
        assert seccomp.get("type") == "RuntimeDefault", f"{where}: seccompProfile RuntimeDefault"
        assert sc.get("readOnlyRootFilesystem") is True, f"{where}: readOnlyRootFilesystem"
        assert sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation false"
        assert "ALL" in sc.get("capabilities", {}).get("drop", []), f"{where}: capabilities drop ALL"
        assert not sc.get("capabilities", {}).get("add"), f"{where}: adds capabilities"
        assert not sc.get("privileged"), f"{where}: privileged"
        assert not spec_of(doc).get("hostNetwork") and not spec_of(doc).get("hostPID") and not spec_of(doc).get("hostIPC")


@pytest.mark.parametrize("name", ALL)
def test_images_have_a_pinned_tag(name: str) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for doc, c in every_container(name):
        image_name, tag, digest = split_image(c["image"])
        assert "/" in image_name, f"{name}: {c['image']} has no registry (kustomize images: did not apply)"
        assert digest or (tag and tag != "latest"), f"{name}: {doc['metadata']['name']}/{c['name']} image {c['image']} is not pinned"
        if image_name.endswith("/memstore"):
            assert tag == version, f"{name}: the memstore image tag {tag} is not the package version {version} (pyproject.toml)"


@pytest.mark.parametrize("name", STORE_DEPLOYMENTS)
def test_store_memory_limit_covers_capacity(name: str, tmp_path: Path) -> None:
    """Segments are tmpfs pages charged to the store's memory cgroup: limit >= --capacity + the process's own needs."""
    s = store_setup(rendered(name), tmp_path)
    limit = quantity(s.container["resources"]["limits"]["memory"])
    need = s.config.capacity + STORE_OVERHEAD_BYTES
    assert limit >= need, f"{name}: memory limit {limit / GIB:.1f}GiB < capacity {s.config.capacity / GIB:.1f}GiB + 1GiB"


@pytest.mark.parametrize("name", STORE_DEPLOYMENTS)
def test_grace_period_covers_flush_and_drain(name: str, tmp_path: Path) -> None:
    s = store_setup(rendered(name), tmp_path)
    budget = s.config.flush_grace_seconds + s.config.drain_grace_seconds
    grace = spec_of(s.daemonset)["terminationGracePeriodSeconds"]
    assert grace >= budget + 10, f"{name}: terminationGracePeriodSeconds {grace} < flush + drain grace {budget} + 10 s margin"


@pytest.mark.parametrize("name", STORE_DEPLOYMENTS)
def test_store_probes_use_the_grpc_health_port(name: str, tmp_path: Path) -> None:
    s = store_setup(rendered(name), tmp_path)
    health = port_of(s.config.health_listen)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert s.container[probe]["grpc"]["port"] == health, f"{name}: {probe} is not a gRPC probe on --health-listen"
    assert s.container["livenessProbe"]["grpc"].get("service", "") == ""
    assert s.container["startupProbe"]["grpc"].get("service", "") == ""
    assert s.container["readinessProbe"]["grpc"]["service"] == "memstore.v1.Store"


@pytest.mark.parametrize("name", STORE_DEPLOYMENTS)
def test_store_rolls_one_node_at_a_time(name: str) -> None:
    ds = one(rendered(name), "DaemonSet", "memstore")
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}  # maxSurge 0: hostPort 7070 is the node's
    assert ds["spec"].get("minReadySeconds", 0) > 0


@pytest.mark.parametrize("name", STORE_DEPLOYMENTS)
def test_store_pod_priority_and_service_account(name: str, tmp_path: Path) -> None:
    objs = rendered(name)
    s = store_setup(objs, tmp_path)
    spec = spec_of(s.daemonset)
    priority = one(objs, "PriorityClass", spec["priorityClassName"])
    assert priority["value"] >= 1_000_000 and not priority.get("globalDefault", False)
    sa = one(objs, "ServiceAccount", spec["serviceAccountName"])
    assert sa.get("automountServiceAccountToken") is False, "the ServiceAccount mounts no token unless a pod asks"
    # the token is there exactly when the store reads its Node's labels
    reads_node = bool(s.config.failure_domain_node_labels)
    assert spec.get("automountServiceAccountToken", False) is reads_node, f"{name}: token mounted without need, or missing"
    if reads_node:
        node_name = [e for e in s.container["env"] if e["name"] == "NODE_NAME"]
        assert node_name and node_name[0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


@pytest.mark.parametrize("name", STORE_DEPLOYMENTS)
def test_rbac_is_get_on_nodes_only(name: str) -> None:
    objs = rendered(name)
    ds = one(objs, "DaemonSet", "memstore")
    roles = find(objs, "ClusterRole") + find(objs, "Role")
    assert [r["rules"] for r in roles] == [[{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]]
    binding = one(objs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == roles[0]["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": spec_of(ds)["serviceAccountName"], "namespace": ds["metadata"]["namespace"]}
    ]


@pytest.mark.parametrize("name", STORE_DEPLOYMENTS)
def test_node_shared_memory_only_where_needed(name: str, tmp_path: Path) -> None:
    """The node's /dev/shm is a hostPath of type Directory, mounted in the store container only (at --shm-dir's tmpfs)."""
    objs = rendered(name)
    s = store_setup(objs, tmp_path)
    spec = spec_of(s.daemonset)
    host_paths = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    assert list(host_paths.values()) == [{"path": "/dev/shm", "type": "Directory"}]
    (shm,) = host_paths
    mounts = [(c["name"], m["mountPath"]) for c in containers(spec) for m in c.get("volumeMounts", []) if m["name"] == shm]
    assert mounts == [("memstore", "/dev/shm")]
    assert s.config.shm_dir.startswith("/dev/shm/")
    for doc in workloads(objs):
        if doc is not s.daemonset:
            assert not any("hostPath" in v for v in spec_of(doc).get("volumes", [])), f"{doc['metadata']['name']} mounts a hostPath"


@pytest.mark.parametrize("name", STORE_DEPLOYMENTS)
def test_namespace_allows_the_store_pod(name: str) -> None:
    """hostPort and hostPath need the privileged Pod Security level in the store's namespace."""
    objs = rendered(name)
    ns = one(objs, "Namespace")
    assert ns["metadata"]["name"] == one(objs, "DaemonSet", "memstore")["metadata"]["namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_example_trainer_can_use_the_fast_path(tmp_path: Path) -> None:
    """Same uid as the store, and the store's segment directory of the node mounted at the same path."""
    stores = store_setup(rendered("dev"), tmp_path)
    job = one(rendered("example-ddp-job"), "Job")
    assert job["spec"]["completionMode"] == "Indexed"
    spec = spec_of(job)
    trainer = container(job, "trainer")
    store_sc = spec_of(stores.daemonset)["securityContext"]
    assert spec["securityContext"]["runAsUser"] == store_sc["runAsUser"]
    assert spec["securityContext"]["runAsGroup"] == store_sc["runAsGroup"]
    shm = [v for v in spec["volumes"] if "hostPath" in v]
    assert [v["hostPath"] for v in shm] == [{"path": stores.config.shm_dir, "type": "Directory"}]
    assert [m["mountPath"] for m in trainer["volumeMounts"] if m["name"] == shm[0]["name"]] == [stores.config.shm_dir]
