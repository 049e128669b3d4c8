"""What the k8s tests share: the rendered kustomizations, the store's objects in them, and the store's
configuration read from them the way the pod will read it (kubelet's ``$(VAR)`` expansion, memstore's own
parser and :meth:`StoreConfig.load`)."""

from __future__ import annotations

import argparse
import functools
import re
from dataclasses import dataclass, fields
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from memstore.cli import build_parser
from memstore.config import StoreConfig
from tests.k8s.render import containers, pod_spec, render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
#: every kustomization the repository ships: name -> directory
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "dev": K8S / "overlays" / "dev",
    "production-tls": K8S / "overlays" / "production-tls",
    "example-ddp-job": K8S / "examples" / "ddp-job",
}
#: the ones that deploy stores
STORE_DEPLOYMENTS = ("base", "dev", "production-tls")
#: the deployment the example Job runs against
EXAMPLE_STORES = "dev"

#: what the downward API gives a pod here (kubelet fills these in; any concrete values will do)
DOWNWARD_API = {
    "status.podIP": "10.0.0.7",
    "status.hostIP": "192.168.0.7",
    "spec.nodeName": "node-7",
    "metadata.name": "pod-7",
    "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0",
}
GIB = 1 << 30
#: memory a store needs beside its --capacity (Python, gRPC buffers, chunks in flight)
STORE_OVERHEAD_BYTES = 1 * GIB


@functools.cache
def _render(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(KUSTOMIZATIONS[name]))


def rendered(name: str) -> list[dict[str, Any]]:
    """The objects of one kustomization (rendered once per test session; callers must not modify them)."""
    return list(_render(name))


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def store_daemonset(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, "DaemonSet", "memstore")


def spec_of(doc: dict[str, Any]) -> dict[str, Any]:
    spec = pod_spec(doc)
    assert spec is not None, f"{doc['kind']} {doc['metadata']['name']} has no pod spec"
    return spec


def container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in containers(spec_of(doc)) if c["name"] == name]
    assert len(found) == 1, f"{doc['kind']} {doc['metadata']['name']}: expected one container {name!r}"
    return found[0]


def workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if pod_spec(o) is not None]


# -- what kubelet does with env and args ----------------------------------------------------------------------------
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable is replaced, ``$$`` is ``$``, anything else stays."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def container_env(doc: dict[str, Any], c: dict[str, Any], downward: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment as kubelet builds it: downward-API values (``downward``, default
    :data:`DOWNWARD_API`), ``$(VAR)`` of earlier entries expanded.

    Values from Secrets and ConfigMaps (``secretKeyRef``, ``envFrom``) are not known here and left out.
    """
    downward = DOWNWARD_API if downward is None else downward
    env: dict[str, str] = {}
    for entry in c.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(str(entry["value"]), env)
            continue
        field_ref = (entry.get("valueFrom") or {}).get("fieldRef")
        if field_ref:
            path = field_ref["fieldPath"]
            value = doc["metadata"].get("namespace", "default") if path == "metadata.namespace" else downward.get(path)
            assert value is not None, f"{entry['name']}: no sample value for fieldPath {path}"
            env[entry["name"]] = value
    return env


def argv(doc: dict[str, Any], c: dict[str, Any], downward: dict[str, str] | None = None) -> list[str]:
    """The container's command line after kubelet's expansion (command + args; the image's ENTRYPOINT is not added)."""
    env = container_env(doc, c, downward)
    return [expand(str(a), env) for a in [*c.get("command", []), *c.get("args", [])]]


# -- the store's configuration --------------------------------------------------------------------------------------
def file_in_volume(doc: dict[str, Any], c: dict[str, Any], path: str) -> tuple[dict[str, Any], str] | None:
    """(volume, path inside it) of the mount of ``c`` that holds ``path``; None if no mount does."""
    target = PurePosixPath(path)
    best: tuple[dict[str, Any], str] | None = None
    best_len = -1
    volumes = {v["name"]: v for v in spec_of(doc).get("volumes", [])}
    for mount in c.get("volumeMounts", []):
        root = PurePosixPath(mount["mountPath"])
        if (target == root or root in target.parents) and len(root.parts) > best_len:
            best, best_len = (volumes[mount["name"]], str(target.relative_to(root))), len(root.parts)
    return best


def configmap_file(objs: list[dict[str, Any]], doc: dict[str, Any], c: dict[str, Any], path: str) -> str:
    """The content of ``path`` in container ``c``, which must be a key of a mounted ConfigMap of ``objs``."""
    found = file_in_volume(doc, c, path)
    assert found is not None and "configMap" in found[0], f"{path} is not in a ConfigMap volume of container {c['name']}"
    volume, key = found
    cm = one(objs, "ConfigMap", volume["configMap"]["name"])
    assert key in cm.get("data", {}), f"ConfigMap {cm['metadata']['name']} has no key {key} (mounted at {path})"
    return str(cm["data"][key])


@dataclass
class StoreSetup:
    """The store container of one rendered deployment, and what memstore makes of it."""

    daemonset: dict[str, Any]
    container: dict[str, Any]
    env: dict[str, str]
    argv: list[str]
    args: argparse.Namespace
    config: StoreConfig


def store_setup(objs: list[dict[str, Any]], tmp_path: Path) -> StoreSetup:
    """Parse the store container's args with memstore's parser and load its StoreConfig as ``memstore serve`` does.

    The image's ENTRYPOINT is ``memstore`` (test_dockerfile checks it), so the args are ``serve ...``.
    """
    ds = store_daemonset(objs)
    c = container(ds, "memstore")
    assert "command" not in c, "the store container runs the image's ENTRYPOINT (memstore)"
    env = container_env(ds, c)
    line = argv(ds, c)
    assert line[:1] == ["serve"], f"the store container's args start with 'serve', not {line[:1]}"
    args = build_parser().parse_args(line)
    config_file = tmp_path / "memstore.toml"
    config_path = args.config or env.get("MEMSTORE_CONFIG")
    assert config_path, "the store gets its [store] table with --config"
    config_file.write_text(configmap_file(objs, ds, c, config_path))
    cli = {f.name: getattr(args, f.name) for f in fields(StoreConfig)}  # what memstore/cli/serve.py's run() passes
    config = StoreConfig.load(cli, env=env, config_file=config_file)
    return StoreSetup(ds, c, env, line, args, config)


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


_QUANTITY = re.compile(r"^([0-9.]+)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P|m)?$")
_UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "m": 1e-3}  # fmt: skip


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity (``66Gi``, ``500m``, ``2``) as a number (bytes, cores)."""
    m = _QUANTITY.match(str(value))
    if not m:
        pytest.fail(f"{value!r} is not a resource quantity this test understands")
    return float(m.group(1)) * _UNITS[m.group(2)]
