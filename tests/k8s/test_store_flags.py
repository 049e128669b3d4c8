"""The store container's command line, env and config parse with memstore's own parser and StoreConfig, and
every port, address and path in the manifests agrees with them (containerPorts, hostPort, probes, Service,
NetworkPolicy, discovery name, preStop drain, mounted files, the example trainer's store address)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest

from memstore.cli import build_parser
from memstore.cli.common import CREDENTIAL_ENV
from memstore.config import StoreConfig
from memstore.v1.keys import ip_host_id
from tests.k8s.manifests import (
    DOWNWARD_API,
    EXAMPLE_STORES,
    KUSTOMIZATIONS,
    ROOT,
    STORE_DEPLOYMENTS,
    StoreSetup,
    argv,
    container,
    container_env,
    file_in_volume,
    find,
    one,
    port_of,
    rendered,
    spec_of,
    store_setup,
    workloads,
)
from tests.k8s.render import containers
from trainer_client.knobs import RUN_ID_ENV, STORE_ENV

pytestmark = pytest.mark.k8s

#: the variables memstore's clients read (trainer_client, the CLI): store address, credentials, run id
CLIENT_ENV = {STORE_ENV, *CREDENTIAL_ENV.values(), "MEMSTORE_AUTH_TOKEN", RUN_ID_ENV}
#: the store's: one per StoreConfig field, and the config file
SERVER_ENV = {f"MEMSTORE_{f.name.upper()}" for f in fields(StoreConfig)} | {"MEMSTORE_CONFIG"}
EXAMPLES_IN_IMAGE = "/opt/memstore/examples/"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


@dataclass
class Deployed:
    name: str  # the kustomization
    objs: list[dict[str, Any]]  # what it renders
    s: StoreSetup  # its store container and config


@pytest.fixture(params=STORE_DEPLOYMENTS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Deployed:
    objs = rendered(request.param)
    return Deployed(request.param, objs, store_setup(objs, tmp_path))


def named_port(c: dict[str, Any], name: str) -> dict[str, Any]:
    (port,) = [p for p in c["ports"] if p["name"] == name]
    return port


def test_config_loads_with_pod_values(store: Deployed) -> None:
    """StoreConfig.load accepted it (store_setup); the pod's values came through the layers as intended."""
    name, s = store.name, store.s
    pod_ip = DOWNWARD_API["status.podIP"]
    assert s.config.listen == f"{pod_ip}:7070", f"{name}: --listen must be the pod IP (the host id is derived from it)"
    assert s.config.host_id == ip_host_id(pod_ip), f"{name}: host id {s.config.host_id} is not what DNS discovery names the pod"
    assert s.config.health_listen.rpartition(":")[0] in (pod_ip, "0.0.0.0")
    assert s.config.data_port != 0, "a fixed --data-port, so the NetworkPolicy can name it"
    assert s.config.auth_token_file, f"{name}: authentication is on in every deployment"
    assert not s.config.insecure


def test_ports_agree_everywhere(store: Deployed) -> None:
    name, objs, s = store.name, store.objs, store.s
    grpc, data, health = port_of(s.config.listen), s.config.data_port, port_of(s.config.health_listen)
    metrics = s.config.metrics_port
    assert metrics, f"{name}: every deployment serves Prometheus metrics (--metrics-port)"
    assert len({grpc, data, health, metrics}) == 4, f"{name}: four distinct ports"
    c = s.container
    assert named_port(c, "grpc")["containerPort"] == grpc
    assert named_port(c, "grpc")["hostPort"] == grpc, "trainers reach their node's store at HOST_IP:<grpc port>"
    assert named_port(c, "data")["containerPort"] == data
    assert named_port(c, "health")["containerPort"] == health
    assert named_port(c, "metrics")["containerPort"] == metrics
    assert {p["name"] for p in c["ports"]} == {"grpc", "data", "health", "metrics"}
    assert named_port(c, "data")["hostPort"] == data, "trainers without the node's memory reach HOST_IP:<data port>"
    hosted = [p["name"] for p in c["ports"] if "hostPort" in p]
    assert hosted == ["grpc", "data"], f"{name}: hostPorts on the gRPC and data ports only"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == health

    svc = one(objs, "Service", "memstore-peers")
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(grpc, "grpc")]

    policy = one(objs, "NetworkPolicy")
    policy_ports = {port["port"] for rule in policy["spec"]["ingress"] for port in rule["ports"]}
    want = {grpc, data, health, metrics}
    assert policy_ports == want, f"{name}: NetworkPolicy ports {policy_ports} != {want}"


def test_discovery_names_the_headless_service(store: Deployed) -> None:
    objs, s = store.objs, store.s
    svc = one(objs, "Service", "memstore-peers")
    ns = s.daemonset["metadata"]["namespace"]
    assert s.config.discovery == f"dns://{svc['metadata']['name']}.{ns}.svc.cluster.local:{port_of(s.config.listen)}"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True, "stores find each other before they are Ready"
    assert svc["spec"]["selector"] == s.daemonset["spec"]["template"]["metadata"]["labels"]
    assert svc["metadata"]["namespace"] == ns


def test_tls_is_checked_for_the_services_name(store: Deployed) -> None:
    """Pod and node IPs change: with TLS on, certificates are checked for the headless Service's DNS name."""
    s = store.s
    if not s.config.tls_cert:
        return
    ns = s.daemonset["metadata"]["namespace"]
    assert s.config.tls_server_name == f"memstore-peers.{ns}.svc.cluster.local", f"{store.name}: set MEMSTORE_TLS_SERVER_NAME"
    assert s.config.tls_ca, f"{store.name}: TLS without a CA cannot verify peers"


def test_network_policy_admits_trainers_stores_and_probes(store: Deployed) -> None:
    objs, s = store.objs, store.s
    policy = one(objs, "NetworkPolicy")
    pod_labels = s.daemonset["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"] == pod_labels
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    grpc, data, health = port_of(s.config.listen), s.config.data_port, port_of(s.config.health_listen)
    metrics = s.config.metrics_port
    rules = [(tuple(sorted(p["port"] for p in rule["ports"])), rule.get("from")) for rule in policy["spec"]["ingress"]]
    stores = [{"podSelector": {"matchLabels": pod_labels}}]
    assert ((grpc, data), stores) in rules, "store <-> store: gRPC and data channel"
    (trainers,) = next(peers for ports, peers in rules if ports == (grpc, data) and peers != stores)
    assert trainers["namespaceSelector"] == {"matchLabels": {"memstore.io/trainers": "true"}}
    assert trainers["podSelector"] == {"matchLabels": {"memstore.io/trainer": "true"}}
    assert set(trainers) == {"namespaceSelector", "podSelector"}, "one peer: trainer pods in trainer namespaces (both selectors)"
    assert ((health,), None) in rules, "health from anywhere: the kubelet probes from the node"
    assert ((metrics,), [{"namespaceSelector": {}}]) in rules, "metrics from every pod of the cluster (Prometheus), nothing else"
    assert len(rules) == 4, "trainers (gRPC + data), stores (gRPC + data), health, metrics: nothing else"


def test_prestop_drain_parses_and_fits_the_grace_period(store: Deployed, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook runs in the store's container with its env: `memstore drain` finds the store through MEMSTORE_LISTEN."""
    name, s = store.name, store.s
    command = s.container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["memstore", "drain"]
    assert not any("$(" in part for part in command), "kubelet does not expand $(VAR) in exec hooks"
    for key, value in s.env.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(command[1:])  # the parser reads MEMSTORE_LISTEN when it is built
    assert args.store == s.config.listen, f"{name}: the preStop drain would not reach this store"
    budget = s.config.flush_grace_seconds + s.config.drain_grace_seconds
    grace = spec_of(s.daemonset)["terminationGracePeriodSeconds"]
    assert budget <= args.wait < grace, f"{name}: drain --wait {args.wait} must cover flush + drain ({budget}) and end before {grace}s"
    if s.config.admin_token_file:
        assert args.auth_token_file == s.config.admin_token_file, "draining needs the admin token"
    tls = {"tls_ca": s.config.tls_ca, "tls_cert": s.config.tls_cert, "tls_key": s.config.tls_key}
    for dest, value in tls.items():  # the CLI takes credentials from flags, else the env the store's config came from
        assert (getattr(args, dest) or s.env.get(CREDENTIAL_ENV[dest], "")) == value, f"{name}: drain's {dest} != the store's"


def test_every_file_the_store_reads_is_mounted(store: Deployed) -> None:
    name, objs, s = store.name, store.objs, store.s
    paths = {f: getattr(s.config, f) for f in ("auth_token_file", "admin_token_file", "job_tokens_file", "tls_ca", "tls_cert", "tls_key")}
    paths["config"] = s.args.config
    for what, path in paths.items():
        if not path:
            continue
        found = file_in_volume(s.daemonset, s.container, path)
        assert found is not None, f"{name}: {what} {path} is on no volume"
        volume, key = found
        if "secret" in volume:
            secrets = find(objs, "Secret", volume["secret"]["secretName"])
            assert volume["secret"].get("defaultMode", 0o644) & 0o040, "group-readable: the store reads it through fsGroup"
            if secrets:  # generated by the overlay: the key must be in it (others are the operator's)
                assert key in secrets[0]["data"], f"{name}: Secret {volume['secret']['secretName']} has no key {key} ({what})"
    tmp = file_in_volume(s.daemonset, s.container, "/tmp/x")
    assert tmp is not None and "emptyDir" in tmp[0], "a writable /tmp beside the read-only root filesystem"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_memstore_env_vars_are_real(name: str) -> None:
    """Every MEMSTORE_* variable in the manifests names a StoreConfig field or a variable memstore's clients read."""
    for doc in workloads(rendered(name)):
        for c in containers(spec_of(doc)):
            for env in c.get("env", []):
                var = env["name"]
                if var.startswith("MEMSTORE_"):
                    assert var in SERVER_ENV | CLIENT_ENV, f"{name}: {doc['metadata']['name']}/{c['name']} sets {var}, which nothing reads"


def test_example_job_reaches_its_node_store(tmp_path: Path) -> None:
    stores_objs = rendered(EXAMPLE_STORES)
    s = store_setup(stores_objs, tmp_path)
    objs = rendered("example-ddp-job")
    job = one(objs, "Job")
    trainer = container(job, "trainer")
    env = container_env(job, trainer)
    assert env["MEMSTORE_STORE"] == f"{DOWNWARD_API['status.hostIP']}:{named_port(s.container, 'grpc')['hostPort']}"
    host_ip = next(e for e in trainer["env"] if e["name"] == "HOST_IP")
    assert host_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    # the stores' NetworkPolicy admits it
    policy = one(stores_objs, "NetworkPolicy")
    (rule,) = [r for r in policy["spec"]["ingress"] if any({"namespaceSelector", "podSelector"} <= set(f) for f in r.get("from", ()))]
    assert [p["port"] for p in rule["ports"]] == [port_of(s.config.listen), s.config.data_port], "gRPC and the data channel"
    (peer,) = rule["from"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= labels.items()
    namespace = one(objs, "Namespace")
    assert namespace["metadata"]["name"] == job["metadata"]["namespace"]
    assert peer["namespaceSelector"]["matchLabels"].items() <= namespace["metadata"]["labels"].items()
    # it presents a token: the dev stores' jobs.json lists this job
    token = env["MEMSTORE_AUTH_TOKEN_FILE"]
    found = file_in_volume(job, trainer, token)
    assert found is not None and "secret" in found[0]
    line = argv(job, trainer)
    assert "--job=ddp-example" in line
    scripts = [part.removeprefix(EXAMPLES_IN_IMAGE) for part in line if part.startswith(EXAMPLES_IN_IMAGE)]
    assert scripts and all((ROOT / "examples" / script).is_file() for script in scripts), "the Job runs a script of examples/"
    assert line[0] == "torchrun" and f"--node-rank={DOWNWARD_API[COMPLETION_INDEX]}" in line
