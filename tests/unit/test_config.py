"""StoreConfig: precedence CLI > env > file > defaults, and clear errors for bad values."""

from __future__ import annotations

import pytest

from memstore.config import StoreConfig
from memstore.errors import ConfigError

pytestmark = pytest.mark.unit

PEERS = "h0=127.0.0.1:7070,h1=127.0.0.1:7071"


def test_defaults_single_host() -> None:
    c = StoreConfig.load({"host_id": "h0", "replicas": "1"}, env={})
    assert c.peers == (("h0", "127.0.0.1:7070"),)
    assert c.keep == 2 and c.capacity == 4 << 30


def test_precedence(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "store.toml"
    f.write_text('[store]\nhost_id = "h0"\npeers = "' + PEERS + '"\nkeep = 5\ncapacity = "1GiB"\nreplicas = 2\n')
    env = {"MEMSTORE_KEEP": "4", "MEMSTORE_CAPACITY": "2GiB"}
    c = StoreConfig.load({"keep": "3"}, env=env, config_file=f)
    assert c.keep == 3  # CLI wins
    assert c.capacity == 2 << 30  # env beats file
    assert c.host_ids == ("h0", "h1")  # file beats defaults


@pytest.mark.parametrize(
    ("cli", "message"),
    [
        ({"host_id": "bad/id"}, "--host-id"),
        ({"host_id": "h0", "peers": "h1=127.0.0.1:1"}, "missing"),
        ({"host_id": "h0", "peers": "h0=127.0.0.1:1,h0=127.0.0.1:2"}, "more than once"),
        ({"host_id": "h0", "peers": "h0"}, "ID=HOST:PORT"),
        ({"host_id": "h0", "peers": "h0=nowhere"}, "HOST:PORT"),
        ({"host_id": "h0", "replicas": "3", "peers": PEERS}, "larger than the number of hosts"),
        ({"host_id": "h0", "replicas": "0"}, "--replicas"),
        ({"host_id": "h0", "capacity": "lots"}, "--capacity"),
        ({"host_id": "h0", "placement": "random"}, "--placement"),
        ({"host_id": "h0", "keep": "two"}, "--keep"),
    ],
)
def test_bad_values_name_the_flag(cli: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StoreConfig.load({"replicas": "1", **cli}, env={})


def test_bad_config_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "bad.toml"
    f.write_text("this is = = not toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        StoreConfig.load({}, env={}, config_file=f)
    with pytest.raises(ConfigError, match="does not exist"):
        StoreConfig.load({}, env={}, config_file=tmp_path / "missing.toml")
    f.write_text('[store]\nhost_id = "h0"\nbogus = 1\n')
    with pytest.raises(ConfigError, match="unknown configuration keys: bogus"):
        StoreConfig.load({}, env={}, config_file=f)


def test_host_id_from_the_listen_ip_with_dns_discovery() -> None:
    dns = {"discovery": "dns://memstore-peers.ns.svc.cluster.local:7070", "insecure": "true"}
    assert StoreConfig.load({**dns, "listen": "10.1.2.3:7070"}, env={}).host_id == "10-1-2-3"
    assert StoreConfig.load({**dns, "listen": "[fd00::7]:7070"}, env={}).host_id == "fd00--7"
    assert StoreConfig.load({**dns, "listen": "10.1.2.3:7070", "host_id": "pod-0"}, env={}).host_id == "pod-0"
    with pytest.raises(ConfigError, match=r"--host-id is not set and --listen 0\.0\.0\.0:7070 is not one IP address"):
        StoreConfig.load({**dns, "listen": "0.0.0.0:7070"}, env={})
    with pytest.raises(ConfigError, match="--host-id ''"):  # without DNS discovery the id stays required
        StoreConfig.load({"listen": "127.0.0.1:7070", "replicas": "1"}, env={})


@pytest.mark.parametrize(
    ("cli", "message"),
    [
        ({"data_port": "70000"}, "--data-port 70000 is invalid: expected 0..65535"),
        ({"data_port": "x"}, "--data-port 'x' is invalid"),
        ({"health_listen": "7072"}, "--health-listen '7072' is invalid"),
        ({"failure_domain_node_labels": "zone,Bad Label"}, "'Bad Label' is not a Kubernetes label name"),
        ({"failure_domain_node_labels": "topology.kubernetes.io/zone", "failure_domain": "z1"}, "are exclusive"),
        ({"tls_server_name": "memstore-peers.ns.svc"}, "--tls-server-name needs TLS"),
    ],
)
def test_kubernetes_flags_name_what_is_wrong(cli: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        StoreConfig.load({"host_id": "h0", "replicas": "1", **cli}, env={})


def test_kubernetes_flags_parse() -> None:
    labels = "topology.kubernetes.io/zone,example.com/rack"
    cli = {"host_id": "h0", "replicas": "1", "data_port": "7071", "health_listen": "127.0.0.1:7072", "failure_domain_node_labels": labels}
    c = StoreConfig.load(cli, env={})
    assert (c.data_port, c.health_listen, c.failure_domain_node_labels) == (7071, "127.0.0.1:7072", labels)


def test_the_durable_tier_is_told_its_options_not_the_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from memstore.spill import SpillOptions, build_spiller

    base = {"host_id": "h0", "replicas": "1"}
    assert StoreConfig.load(base, env={}).spill_settings() is None
    assert build_spiller(None, source=None) is None  # type: ignore[arg-type]
    cli = {**base, "spill": f"file://{tmp_path}", "spill_keep_best": "1", "spill_metric": "loss", "spill_metric_mode": "max",
           "spill_every_steps": "5", "spill_compression": "zstd", "spill_max_rate": "1MiB"}  # fmt: skip
    options = StoreConfig.load(cli, env={}).spill_settings()
    assert options == SpillOptions(
        url=f"file://{tmp_path}", storage_options="", every_steps=5, every_seconds=0.0, keep_last=2, keep_best=1, metric="loss",
        metric_max=True, compression="zstd", max_rate=1 << 20, orphan_seconds=300.0,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# --redundancy and --replicas (issue 42)
# --------------------------------------------------------------------------------------------------

FIVE = ",".join(f"h{i}=127.0.0.1:{7070 + i}" for i in range(5))


def test_replicas_alone_means_replicas_redundancy() -> None:
    c = StoreConfig.load({"host_id": "h0", "peers": FIVE, "replicas": "3"}, env={})
    assert (c.replicas, str(c.redundancy)) == (3, "replicas:3")
    d = StoreConfig.load({"host_id": "h0", "peers": FIVE}, env={})
    assert (d.replicas, str(d.redundancy)) == (2, "replicas:2")  # the defaults agree


def test_redundancy_from_flag_env_and_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = StoreConfig.load({"host_id": "h0", "peers": FIVE, "redundancy": "replicas:3"}, env={})
    assert (c.replicas, str(c.redundancy)) == (3, "replicas:3")
    e = StoreConfig.load({"host_id": "h0", "peers": FIVE}, env={"MEMSTORE_REDUNDANCY": "ec:4+1"})
    assert (e.replicas, str(e.redundancy), e.redundancy.group_size) == (1, "ec:4+1", 5)  # ec: the owner's copy only
    f = tmp_path / "store.toml"
    f.write_text('[store]\nredundancy = "ec:3+2"\n')
    assert str(StoreConfig.load({"host_id": "h0", "peers": FIVE}, env={}, config_file=f).redundancy) == "ec:3+2"


def test_replicas_and_redundancy_that_agree_are_accepted() -> None:
    c = StoreConfig.load({"host_id": "h0", "peers": FIVE, "replicas": "2", "redundancy": "replicas:2"}, env={})
    assert (c.replicas, str(c.redundancy)) == (2, "replicas:2")


@pytest.mark.parametrize(("replicas", "redundancy"), [("3", "ec:4+1"), ("1", "ec:4+1"), ("2", "ec:4+1"), ("3", "replicas:2")])
def test_replicas_and_redundancy_that_disagree_are_refused_naming_both(replicas: str, redundancy: str) -> None:
    with pytest.raises(ConfigError) as err:
        StoreConfig.load({"host_id": "h0", "peers": FIVE, "replicas": replicas, "redundancy": redundancy}, env={})
    assert f"--replicas {replicas}" in str(err.value) and f"--redundancy {redundancy}" in str(err.value)


def test_disagreement_across_sources_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--replicas 3 and --redundancy ec:4\+1 disagree"):
        StoreConfig.load({"host_id": "h0", "peers": FIVE, "replicas": "3"}, env={"MEMSTORE_REDUNDANCY": "ec:4+1"})


@pytest.mark.parametrize("text", ["ec:4", "ec:0+1", "ec:4+0", "replicas:0", "raid5", "ec:60+5"])
def test_bad_redundancy_names_the_flag_and_the_forms(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        StoreConfig.load({"host_id": "h0", "redundancy": text}, env={})
    message = str(err.value)
    assert message.startswith(f"--redundancy {text!r} is invalid") and "replicas:R" in message and "ec:K+M" in message


def test_ec_needs_k_plus_m_hosts_naming_both_numbers() -> None:
    four = ",".join(f"h{i}=127.0.0.1:{7070 + i}" for i in range(4))
    with pytest.raises(ConfigError, match=r"--redundancy ec:4\+1 needs at least 5 hosts \(K\+M\), but --peers lists 4"):
        StoreConfig.load({"host_id": "h0", "peers": four, "redundancy": "ec:4+1"}, env={})
    with pytest.raises(ConfigError, match="needs at least 5 hosts"):
        StoreConfig.load({"host_id": "h0", "redundancy": "ec:4+1"}, env={})  # no --peers: one host


def test_ec_with_dynamic_members_is_checked_when_they_are_known() -> None:
    c = StoreConfig.load({"host_id": "h0", "peers_file": "/nonexistent/members.json", "redundancy": "ec:4+1"}, env={})
    assert str(c.redundancy) == "ec:4+1"


def test_ec_places_groups_only() -> None:
    with pytest.raises(ConfigError, match=r"--placement ring does not apply to --redundancy ec:4\+1"):
        StoreConfig.load({"host_id": "h0", "peers": FIVE, "redundancy": "ec:4+1", "placement": "ring"}, env={})
