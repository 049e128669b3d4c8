"""Render a kustomization: ``kubectl kustomize`` when kubectl is installed, else this module's own renderer.

The fallback implements exactly the kustomize features ``k8s/`` uses, so CI without kubectl still renders and
checks every overlay. It refuses anything else (an unknown kustomization key, a strategic-merge patch, labels
on selectors), so an overlay cannot silently grow past what it emulates; where kubectl is present,
``test_render.py`` checks that both give the same objects for every kustomization in ``k8s/``.

Supported: ``resources`` (files and directories), ``namespace``, ``labels`` (metadata only),
``configMapGenerator``/``secretGenerator`` (``files``, ``literals``, ``behavior`` create/replace/merge,
``options.disableNameSuffixHash``), ``patches`` (JSON 6902 ops add/remove/replace from ``path``, with a ``target``)
and ``images`` (``newName``, ``newTag``, ``digest``). As kustomize does, generated ConfigMaps and Secrets get a
content-hash suffix at the end, and the pod specs that refer to them are updated.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {"apiVersion", "kind", "namespace", "labels", "resources", "configMapGenerator", "secretGenerator", "patches", "images"}
#: kinds the namespace transformer leaves alone (cluster-scoped); a Namespace object is renamed instead
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "CustomResourceDefinition", "StorageClass",
    "PersistentVolume", "Node", "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration", "IngressClass",
    "RuntimeClass", "CSIDriver",
}  # fmt: skip
WORKLOAD_POD_SPEC = {
    "Pod": ("spec",),
    "Deployment": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}


class UnsupportedKustomization(ValueError):
    """The kustomization uses a feature this renderer does not emulate."""


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects of the kustomization in ``directory``: from kubectl when installed, else from :func:`build`."""
    return render_with_kubectl(directory) if shutil.which("kubectl") else build(directory)


def render_with_kubectl(directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed: {out.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


# -- the fallback renderer ------------------------------------------------------------------------------------------
@dataclass
class _Res:
    doc: dict[str, Any]
    needs_hash: bool = False  # a generated ConfigMap/Secret: the name gets a content hash at the end


def build(directory: Path) -> list[dict[str, Any]]:
    """Render the kustomization in ``directory`` with this module's subset of kustomize."""
    items = _build_level(Path(directory))
    _add_hash_suffixes(items)
    return [r.doc for r in items]


def _kustomization(directory: Path) -> dict[str, Any]:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            data = yaml.safe_load(path.read_text()) or {}
            unknown = sorted(set(data) - SUPPORTED_KEYS)
            if unknown:
                raise UnsupportedKustomization(f"{path}: kustomization keys this renderer does not emulate: {', '.join(unknown)}")
            return dict(data)
    raise FileNotFoundError(f"no kustomization file in {directory}")


def _build_level(directory: Path) -> list[_Res]:
    k = _kustomization(directory)
    items: list[_Res] = []
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            items.extend(_build_level(path))
        else:
            items.extend(_Res(doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    for spec in k.get("configMapGenerator", []):
        _generate(items, directory, spec, "ConfigMap")
    for spec in k.get("secretGenerator", []):
        _generate(items, directory, spec, "Secret")
    for patch in k.get("patches", []):
        _apply_patch(items, directory, patch)
    if "namespace" in k:
        _set_namespace(items, k["namespace"])
    for entry in k.get("labels", []):
        _add_labels(items, entry)
    for image in k.get("images", []):
        _set_images(items, image)
    return items


# -- generators -----------------------------------------------------------------------------------------------------
def _generator_data(directory: Path, spec: dict[str, Any]) -> dict[str, str]:
    data: dict[str, str] = {}
    for entry in spec.get("files", []):
        key, sep, rel = str(entry).partition("=")
        rel = rel if sep else key
        data[key if sep else Path(rel).name] = (directory / rel).read_text()
    for entry in spec.get("literals", []):
        key, sep, value = str(entry).partition("=")
        if not sep:
            raise UnsupportedKustomization(f"literal {entry!r} is not KEY=VALUE")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        data[key] = value
    unknown = sorted(set(spec) - {"name", "files", "literals", "behavior", "options", "type"})
    if unknown:
        raise UnsupportedKustomization(f"generator {spec.get('name')!r}: unsupported fields {', '.join(unknown)}")
    return data


def _generate(items: list[_Res], directory: Path, spec: dict[str, Any], kind: str) -> None:
    name = spec["name"]
    data = _generator_data(directory, spec)
    if kind == "Secret":
        data = {k: _kyaml_base64(v) for k, v in data.items()}
    needs_hash = not (spec.get("options") or {}).get("disableNameSuffixHash", False)
    behavior = spec.get("behavior", "create")
    existing = [r for r in items if r.doc.get("kind") == kind and r.doc["metadata"]["name"] == name]
    if behavior == "create":
        if existing:
            raise UnsupportedKustomization(f"{kind} {name} already exists: use behavior replace or merge")
        doc: dict[str, Any] = {"apiVersion": "v1", "kind": kind, "metadata": {"name": name}, "data": data}
        if kind == "Secret":
            doc["type"] = spec.get("type", "Opaque")
        items.append(_Res(doc, needs_hash))
        return
    if len(existing) != 1:
        raise UnsupportedKustomization(f"{kind} {name}: behavior {behavior} needs exactly one existing {kind} of that name")
    target = existing[0]
    if behavior == "replace":
        target.doc["data"] = data
    elif behavior == "merge":
        target.doc.setdefault("data", {}).update(data)
    else:
        raise UnsupportedKustomization(f"{kind} {name}: unknown behavior {behavior!r}")
    target.needs_hash = needs_hash


def _kyaml_base64(value: str) -> str:
    """Base64 as kustomize (kyaml) writes Secret data: lines of 70 characters, each ending in a newline once the
    encoding needs more than one line (the API server's decoder skips the newlines)."""
    encoded = base64.b64encode(value.encode()).decode()
    if len(encoded) // 70 + 1 == 1:
        return encoded
    return "".join(encoded[i : i + 70] + "\n" for i in range(0, len(encoded), 70))


def _short_hash(doc: dict[str, Any]) -> str:
    """kustomize's name suffix: sha256 of a JSON encoding of kind, data (and type), mapped to avoid vowels.

    kustomize looks the name up with a path it never finds, so the encoded name is always "".
    """
    encoded: dict[str, Any] = {"kind": doc["kind"], "name": "", "data": doc.get("data") or ""}
    if doc["kind"] == "Secret":
        encoded["type"] = doc.get("type", "")
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escape in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escape)  # Go's json.Marshal escapes these
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _add_hash_suffixes(items: list[_Res]) -> None:
    renamed: dict[tuple[str, str, str], str] = {}
    for r in items:
        if r.needs_hash:
            meta = r.doc["metadata"]
            new = f"{meta['name']}-{_short_hash(r.doc)}"
            renamed[(r.doc["kind"], meta.get("namespace", ""), meta["name"])] = new
            meta["name"] = new
    for r in items:
        spec = pod_spec(r.doc)
        if spec is not None:
            _rename_references(spec, r.doc["metadata"].get("namespace", ""), renamed)


def _rename_references(spec: dict[str, Any], namespace: str, renamed: dict[tuple[str, str, str], str]) -> None:
    def fix(ref: dict[str, Any] | None, kind: str, key: str = "name") -> None:
        if ref and (kind, namespace, ref.get(key)) in renamed:
            ref[key] = renamed[(kind, namespace, ref[key])]

    for volume in spec.get("volumes", []):
        fix(volume.get("configMap"), "ConfigMap")
        fix(volume.get("secret"), "Secret", "secretName")
        for source in (volume.get("projected") or {}).get("sources", []):
            fix(source.get("configMap"), "ConfigMap")
            fix(source.get("secret"), "Secret")
    for container in containers(spec):
        for env in container.get("env", []):
            value_from = env.get("valueFrom") or {}
            fix(value_from.get("configMapKeyRef"), "ConfigMap")
            fix(value_from.get("secretKeyRef"), "Secret")
        for source in container.get("envFrom", []):
            fix(source.get("configMapRef"), "ConfigMap")
            fix(source.get("secretRef"), "Secret")


# -- transformers ---------------------------------------------------------------------------------------------------
def _matches(doc: dict[str, Any], target: dict[str, Any]) -> bool:
    unknown = sorted(set(target) - {"group", "version", "kind", "name", "namespace"})
    if unknown:
        raise UnsupportedKustomization(f"patch target selectors this renderer does not emulate: {', '.join(unknown)}")
    group, _, version = doc["apiVersion"].rpartition("/")
    wanted = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"],
              "namespace": doc["metadata"].get("namespace", "")}  # fmt: skip
    return all(wanted[key] == value for key, value in target.items())


def _apply_patch(items: list[_Res], directory: Path, patch: dict[str, Any]) -> None:
    if set(patch) - {"path", "target"} or "target" not in patch or "path" not in patch:
        raise UnsupportedKustomization(f"patch {patch!r}: only {{path, target}} entries are emulated")
    ops = yaml.safe_load((directory / patch["path"]).read_text())
    if not isinstance(ops, list):
        raise UnsupportedKustomization(f"{patch['path']}: only JSON 6902 patches (a list of operations) are emulated")
    hits = [r for r in items if _matches(r.doc, patch["target"])]
    if not hits:
        raise UnsupportedKustomization(f"{patch['path']}: no resource matches target {patch['target']}")
    for r in hits:
        for op in ops:
            json_patch(r.doc, op)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise UnsupportedKustomization(f"JSON pointer {path!r} must start with /")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def json_patch(doc: dict[str, Any], op: dict[str, Any]) -> None:
    """Apply one RFC 6902 operation (add, remove, replace) to ``doc`` in place."""
    *parents, last = _pointer(op["path"])
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    kind = op["op"]
    if kind not in ("add", "remove", "replace"):
        raise UnsupportedKustomization(f"JSON patch op {kind!r} is not emulated")
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if kind == "add":
            node.insert(index, copy.deepcopy(op["value"]))
        elif kind == "remove":
            del node[index]
        else:
            node[index] = copy.deepcopy(op["value"])
        return
    if kind in ("remove", "replace") and last not in node:
        raise KeyError(f"JSON patch {kind} of missing {op['path']}")
    if kind == "remove":
        del node[last]
    else:
        node[last] = copy.deepcopy(op["value"])


def _set_namespace(items: list[_Res], namespace: str) -> None:
    for r in items:
        kind = r.doc["kind"]
        if kind == "Namespace":
            r.doc["metadata"]["name"] = namespace
        elif kind not in CLUSTER_SCOPED:
            r.doc["metadata"]["namespace"] = namespace


def _add_labels(items: list[_Res], entry: dict[str, Any]) -> None:
    if entry.get("includeSelectors") or entry.get("includeTemplates") or set(entry) - {"pairs", "includeSelectors", "includeTemplates"}:
        raise UnsupportedKustomization(f"labels {entry!r}: only metadata labels (includeSelectors: false) are emulated")
    for r in items:
        r.doc["metadata"].setdefault("labels", {}).update({str(k): str(v) for k, v in entry["pairs"].items()})


def split_image(image: str) -> tuple[str, str, str]:
    """``registry/name:tag@sha256:...`` -> (name with registry, tag, digest); '' where absent."""
    rest, _, digest = image.partition("@")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        return rest[:colon], rest[colon + 1 :], digest
    return rest, "", digest


def _set_images(items: list[_Res], image: dict[str, Any]) -> None:
    unknown = sorted(set(image) - {"name", "newName", "newTag", "digest"})
    if unknown:
        raise UnsupportedKustomization(f"images entry {image.get('name')!r}: unsupported fields {', '.join(unknown)}")
    for r in items:
        spec = pod_spec(r.doc)
        for container in containers(spec) if spec is not None else ():
            name, tag, digest = split_image(container.get("image", ""))
            if name != image["name"]:
                continue
            name = image.get("newName", name)
            if "digest" in image:
                container["image"] = f"{name}@{image['digest']}"
            elif "newTag" in image:
                container["image"] = f"{name}:{image['newTag']}"
            else:
                container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


# -- helpers the tests share ----------------------------------------------------------------------------------------
def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The pod spec inside a workload object (None for other kinds)."""
    path = WORKLOAD_POD_SPEC.get(doc.get("kind", ""))
    if path is None:
        return None
    node: Any = doc
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every container of a pod spec: init containers first."""
    yield from spec.get("initContainers", [])
    yield from spec.get("containers", [])
