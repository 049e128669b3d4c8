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
