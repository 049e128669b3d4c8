"""--failure-domain-node-labels against a stand-in Kubernetes API server (HTTPS on 127.0.0.1, bearer token)."""

from __future__ import annotations

import json
import shutil
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from memstore.config import StoreConfig
from memstore.errors import ConfigError
from memstore.membership import kube_node
from memstore.membership.kube_node import node_failure_domain
from tools.certs import make_tls

pytestmark = pytest.mark.integration

TOKEN = "sa-token-123"
NODES = {"node-a": {"topology.kubernetes.io/zone": "zone-1", "example.com/rack": "r7"}}


class ApiServer:
    """Answers GET /api/v1/nodes/<name> for a caller presenting TOKEN; ``forbid`` makes it answer 403."""

    def __init__(self, tmp: Path) -> None:
        self.forbid = False
        self.requests: list[str] = []
        tls = make_tls(tmp / "tls")["server"]
        self.account = tmp / "serviceaccount"
        self.account.mkdir()
        (self.account / "token").write_text(TOKEN + "\n")
        shutil.copy(tls.ca, self.account / "ca.crt")
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                api.requests.append(self.path)
                name = self.path.removeprefix("/api/v1/nodes/")
                if self.headers.get("Authorization") != f"Bearer {TOKEN}" or api.forbid:
                    self._answer(403, {"kind": "Status", "reason": "Forbidden"})
                elif name not in NODES:
                    self._answer(404, {"kind": "Status", "reason": "NotFound"})
                else:
                    self._answer(200, {"kind": "Node", "metadata": {"name": name, "labels": NODES[name]}})

            def _answer(self, code: int, body: dict[str, object]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls.cert, tls.key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def env(self, node: str = "node-a") -> dict[str, str]:
        return {"NODE_NAME": node, "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.port)}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[ApiServer]:
    server = ApiServer(tmp_path)
    try:
        yield server
    finally:
        server.close()


def test_labels_of_the_node_joined_with_a_slash(api: ApiServer) -> None:
    assert node_failure_domain("topology.kubernetes.io/zone", api.env(), api.account) == "zone-1"
    assert node_failure_domain("topology.kubernetes.io/zone, example.com/rack", api.env(), api.account) == "zone-1/r7"
    assert api.requests[-1] == "/api/v1/nodes/node-a"


def test_every_wrong_setting_names_what_to_fix(api: ApiServer, tmp_path: Path) -> None:
    def problem(labels: str, env: dict[str, str], account: Path = api.account) -> str:
        with pytest.raises(ConfigError) as info:
            node_failure_domain(labels, env, account, retry_seconds=0)
        return str(info.value)

    zone = "topology.kubernetes.io/zone"
    assert "NODE_NAME" in problem(zone, {k: v for k, v in api.env().items() if k != "NODE_NAME"})
    assert "does not run in a Kubernetes pod" in problem(zone, {"NODE_NAME": "node-a"})
    assert "has no label example.com/row" in problem(f"{zone},example.com/row", api.env())
    assert "knows no node 'node-z'" in problem(zone, api.env("node-z"))
    assert "service account token" in problem(zone, api.env(), tmp_path / "nowhere")
    api.forbid = True
    assert "get on nodes" in problem(zone, api.env())
    api.close()
    assert "cannot read node node-a from the API server" in problem(zone, api.env())


def test_store_serves_with_its_nodes_label(api: ApiServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The store server asks at start and reports the label in Hello, where DNS-discovered peers read it."""
    from memstore.server.app import StoreServer

    for key, value in api.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(kube_node, "SERVICE_ACCOUNT_DIR", api.account)
    cli = {"host_id": "k0", "listen": "127.0.0.1:0", "replicas": 1, "capacity": "16MiB", "shm_dir": str(tmp_path / "shm"),
           "failure_domain_node_labels": "topology.kubernetes.io/zone,example.com/rack"}  # fmt: skip
    config = StoreConfig.load(cli=cli, env={})
    server = StoreServer(config)
    try:
        assert server.config.failure_domain == "zone-1/r7"
        assert server.store.hello().failure_domain == "zone-1/r7"
        server.join()
        assert [s.domain for s in server.store.membership.view.table.slots] == ["zone-1/r7"]
    finally:
        server.stop(grace=0)
