"""``--failure-domain-node-labels``: this host's failure-domain label from its Kubernetes Node.

The downward API gives a pod its node's name but not the node's labels (zone, rack), so the store asks the
API server once at start, as the pod's service account (``GET /api/v1/nodes/<NODE_NAME>``; RBAC ``get`` on
``nodes``, see ``k8s/base``). The label is the values of the named labels joined with ``/``
(``topology.kubernetes.io/zone`` -> ``europe-west4-a``; zone and a rack label -> ``europe-west4-a/r12``).

Every way this can go wrong is a ConfigError that says what to fix: not in a pod, NODE_NAME unset, no
permission, no such node, a label missing on the node. The API server not answering is retried for
``RETRY_SECONDS`` (a node that just booted), then the same error.

Plain Python: the standard library's HTTPS client, no Kubernetes client library.
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from memstore.errors import ConfigError

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
RETRY_SECONDS = 30.0
REQUEST_SECONDS = 5.0
FLAG = "--failure-domain-node-labels"


def node_failure_domain(
    labels: str,
    env: Mapping[str, str] | None = None,
    account_dir: Path | None = None,
    retry_seconds: float = RETRY_SECONDS,
) -> str:
    """The failure-domain label of the node ``env['NODE_NAME']``: its ``labels`` (comma-separated) joined with '/'.
    ``account_dir``: the service account's token and CA (default: where Kubernetes mounts them)."""
    env = os.environ if env is None else env
    account_dir = account_dir or SERVICE_ACCOUNT_DIR
    names = [n.strip() for n in labels.split(",") if n.strip()]
    node = env.get("NODE_NAME", "")
    if not node:
        raise ConfigError(f"{FLAG} needs NODE_NAME: set it from the downward API (env valueFrom fieldRef spec.nodeName)")
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError(f"{FLAG}: KUBERNETES_SERVICE_HOST is not set: this store does not run in a Kubernetes pod")
    try:
        token = (account_dir / "token").read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"{FLAG}: cannot read the service account token {account_dir / 'token'} ({exc.strerror}); is automountServiceAccountToken off?"
        ) from None
    ca = account_dir / "ca.crt"
    context = ssl.create_default_context(cafile=str(ca) if ca.exists() else None)
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    url = f"https://{netloc}/api/v1/nodes/{urllib.parse.quote(node, safe='')}"
    node_labels = _get_labels(url, token, context, node, retry_seconds)
    missing = [n for n in names if not node_labels.get(n)]
    if missing:
        raise ConfigError(f"{FLAG}: node {node} has no label {', '.join(missing)} (kubectl label node {node} {missing[0]}=...)")
    return "/".join(node_labels[n] for n in names)


def _get_labels(url: str, token: str, context: ssl.SSLContext, node: str, retry_seconds: float) -> dict[str, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
    deadline = time.monotonic() + retry_seconds
    while True:
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_SECONDS, context=context) as response:
                body = json.load(response)
            break
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise ConfigError(
                    f"{FLAG}: the API server refused to show node {node} (HTTP {exc.code}): give the store's service "
                    "account get on nodes (the ClusterRole in k8s/base)"
                ) from None
            if exc.code == 404:
                raise ConfigError(f"{FLAG}: the API server knows no node {node!r}: is NODE_NAME spec.nodeName?") from None
            problem = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            problem = str(getattr(exc, "reason", exc))
        if time.monotonic() >= deadline:
            raise ConfigError(f"{FLAG}: cannot read node {node} from the API server at {url}: {problem}")
        time.sleep(1.0)
    labels = body.get("metadata", {}).get("labels", {}) if isinstance(body, dict) else None
    if not isinstance(labels, dict):
        raise ConfigError(f"{FLAG}: the API server's answer for node {node} has no metadata.labels")
    return {str(k): str(v) for k, v in labels.items()}
