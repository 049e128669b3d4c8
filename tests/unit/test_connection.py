"""``Connection``: one object for how a client reaches its store; ``from_env``; the old keyword arguments' deprecation."""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from memstore.v1.security import Credentials
from trainer_client import CheckpointClient, Connection, MemStoreReader, MemStoreWriter
from trainer_client.connection import DEFAULT_STORE, DEPRECATED_KWARGS, connection_from_kwargs
from trainer_client.errors import InvalidArgumentError, StoreUnavailableError

pytestmark = pytest.mark.unit

TOKEN = "t" * 20
UNREACHABLE = "127.0.0.1:1"


def tls_files(tmp_path: Path) -> dict[str, str]:
    paths = {}
    for name in ("ca", "cert", "key"):
        (tmp_path / f"{name}.pem").write_text("PEM")
        paths[name] = str(tmp_path / f"{name}.pem")
    return paths


# -- the object ---------------------------------------------------------------------------------------------
def test_a_connection_is_a_frozen_value_that_pickles_and_hides_its_secrets() -> None:
    conn = Connection("10.0.0.5:7070", timeout=5, credentials=Credentials(token=TOKEN, ca="/ca.pem"), shared_memory=False)
    assert (conn.address, conn.timeout, conn.shared_memory) == ("10.0.0.5:7070", 5.0, False)
    assert pickle.loads(pickle.dumps(conn)) == conn
    assert TOKEN not in repr(conn) and "10.0.0.5:7070" in repr(conn)
    with pytest.raises(AttributeError):
        conn.timeout = 1  # type: ignore[misc]
    assert Connection() == Connection(None, 60.0, None, None)  # everything left out: from the environment at connect time


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"address": "nohostport"}, r"address 'nohostport' is invalid: expected HOST:PORT"),
        ({"address": "h:99999"}, r"port '99999' is not a number in 1-65535"),
        ({"address": "h:"}, r"port '' is not"),
        ({"timeout": 0}, r"timeout 0 is invalid: expected a positive number"),
        ({"timeout": float("inf")}, r"timeout inf is invalid"),
        ({"timeout": True}, r"timeout True is invalid"),
        ({"shared_memory": "yes"}, r"shared_memory 'yes' is invalid"),
        ({"credentials": {"token": TOKEN}}, r"credentials must be a trainer_client.Credentials, got a dict"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Connection(**kwargs)


def test_ipv6_addresses_are_accepted() -> None:
    assert Connection("[::1]:7070").address == "[::1]:7070"


# -- from_env -----------------------------------------------------------------------------------------------
def test_from_env_reads_the_variables_the_client_honours(tmp_path: Path) -> None:
    tls = tls_files(tmp_path)
    env = {
        "MEMSTORE_STORE": "10.1.2.3:7070",
        "MEMSTORE_AUTH_TOKEN": TOKEN,
        "MEMSTORE_TLS_CA": tls["ca"],
        "MEMSTORE_TLS_CERT": tls["cert"],
        "MEMSTORE_TLS_KEY": tls["key"],
        "MEMSTORE_TLS_SERVER_NAME": "memstore.internal",
    }
    conn = Connection.from_env(env, timeout=7)
    assert conn == Connection(
        "10.1.2.3:7070", 7.0, Credentials(token=TOKEN, ca=tls["ca"], cert=tls["cert"], key=tls["key"], server_name="memstore.internal")
    )
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    assert Connection.from_env({"MEMSTORE_AUTH_TOKEN_FILE": str(token_file)}).credentials == Credentials(token=TOKEN)


def test_from_env_with_nothing_set_is_the_default_store_without_credentials() -> None:
    conn = Connection.from_env({})
    assert conn == Connection(None, 60.0, Credentials(), None)
    assert conn.resolved({}).address == DEFAULT_STORE


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MEMSTORE_STORE": "store.local"}, r"MEMSTORE_STORE='store.local' is invalid: expected HOST:PORT"),
        ({"MEMSTORE_STORE": "store.local:http"}, r"MEMSTORE_STORE='store.local:http' is invalid: port 'http'"),
        ({"MEMSTORE_TLS_CA": "/no/such/ca.pem"}, r"MEMSTORE_TLS_CA='/no/such/ca.pem' is invalid: no such file"),
        ({"MEMSTORE_AUTH_TOKEN_FILE": "/no/such/token"}, r"MEMSTORE_AUTH_TOKEN_FILE /no/such/token: cannot read the token file"),
    ],
)
def test_from_env_names_the_variable_and_the_value_of_a_bad_setting(env: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Connection.from_env(env)


def test_from_env_names_a_bad_token_variable_but_never_echoes_the_token() -> None:
    with pytest.raises(InvalidArgumentError, match=r"MEMSTORE_AUTH_TOKEN is invalid: the token is too short") as err:
        Connection.from_env({"MEMSTORE_AUTH_TOKEN": "hunter2"})
    assert "hunter2" not in str(err.value)


def test_from_env_refuses_a_client_certificate_without_its_key(tmp_path: Path) -> None:
    tls = tls_files(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"MEMSTORE_TLS_CERT is set but MEMSTORE_TLS_KEY is not"):
        Connection.from_env({"MEMSTORE_TLS_CA": tls["ca"], "MEMSTORE_TLS_CERT": tls["cert"]})
    with pytest.raises(InvalidArgumentError, match=r"MEMSTORE_TLS_KEY is set but MEMSTORE_TLS_CERT is not"):
        Connection.from_env({"MEMSTORE_TLS_KEY": tls["key"]})


def test_resolved_fills_in_only_what_the_connection_leaves_out() -> None:
    env = {"MEMSTORE_STORE": "10.1.2.3:7070", "MEMSTORE_AUTH_TOKEN": TOKEN}
    assert Connection().resolved(env) == Connection("10.1.2.3:7070", credentials=Credentials(token=TOKEN))
    explicit = Connection("10.9.9.9:1", timeout=3, credentials=Credentials())
    assert explicit.resolved(env) is explicit  # nothing left out: nothing read
    assert Connection("10.9.9.9:1").resolved(env).credentials == Credentials(token=TOKEN)
    assert Connection(credentials=Credentials()).resolved(env) == Connection("10.1.2.3:7070", credentials=Credentials())


def test_a_client_reports_a_bad_environment_before_it_dials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMSTORE_STORE", "no-port")
    with pytest.raises(InvalidArgumentError, match=r"MEMSTORE_STORE='no-port' is invalid"):
        CheckpointClient("j", 0, 1)


# -- the old keyword arguments ------------------------------------------------------------------------------
def test_old_keyword_arguments_warn_naming_each_and_its_replacement() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        conn = connection_from_kwargs("CheckpointClient", None, {"store": "10.0.0.1:7070", "timeout": 3, "use_shared_memory": False})
    assert conn == Connection("10.0.0.1:7070", timeout=3, shared_memory=False)
    assert len(caught) == 1  # one warning per call, naming every old argument used
    message = str(caught[0].message)
    assert "CheckpointClient(store=, timeout=, use_shared_memory=) is deprecated" in message
    assert "Connection(address=...)" in message and "Connection(timeout=...)" in message and "Connection(shared_memory=...)" in message


def test_old_credential_arguments_become_credentials_with_the_rest_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMSTORE_TLS_SERVER_NAME", "memstore.internal")
    with pytest.warns(DeprecationWarning, match=r"auth_token=.*Credentials\(token=\.\.\.\)"):
        conn = connection_from_kwargs("MemStoreWriter", None, {"auth_token": TOKEN})
    assert conn.credentials == Credentials(token=TOKEN, server_name="memstore.internal")  # as client_credentials() did


def test_none_counts_as_not_passed_and_warns_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert connection_from_kwargs("CheckpointClient", None, {"store": None, "timeout": None}) == Connection()
        conn = Connection("10.0.0.1:7070")
        assert connection_from_kwargs("CheckpointClient", conn, {"store": None}) is conn


def test_a_connection_and_an_old_argument_together_are_a_type_error_naming_both() -> None:
    with pytest.raises(TypeError, match=r"CheckpointClient\(\) got both connection= and the deprecated store=, timeout="):
        CheckpointClient("j", 0, 1, UNREACHABLE, connection=Connection(UNREACHABLE), timeout=1)
    with pytest.raises(TypeError, match=r"MemStoreWriter\(\) got both connection= and the deprecated use_shared_memory="):
        MemStoreWriter("j", 1, connection=Connection(), use_shared_memory=False)
    with pytest.raises(TypeError, match=r"MemStoreReader\(\) got both connection= and the deprecated auth_token="):
        MemStoreReader("j", connection=Connection(), auth_token=TOKEN)


def test_unknown_keyword_arguments_are_still_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"CheckpointClient\(\) got an unexpected keyword argument 'stroe'"):
        CheckpointClient("j", 0, 1, stroe=UNREACHABLE)
    with pytest.raises(TypeError, match=r"expects a trainer_client.Connection, got a str"):
        MemStoreReader("j", connection=UNREACHABLE)  # type: ignore[arg-type]


def test_the_old_and_the_new_way_connect_alike() -> None:
    """Same behaviour either way: the deprecated call only adds its warning."""
    deprecated = pytest.warns(DeprecationWarning, match=r"CheckpointClient\(store=, timeout=\)")
    with deprecated, pytest.raises(StoreUnavailableError, match=r"store at 127\.0\.0\.1:1 not reachable within 0\.3s") as old:
        CheckpointClient("j", 0, 1, UNREACHABLE, timeout=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(StoreUnavailableError) as new:
            CheckpointClient("j", 0, 1, connection=Connection(UNREACHABLE, timeout=0.3))
    assert str(old.value) == str(new.value)


@pytest.mark.parametrize("cls", [MemStoreWriter, MemStoreReader])
def test_the_dcp_classes_translate_the_old_arguments_the_same_way(cls: type) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{cls.__name__}\(store=, timeout=, use_shared_memory=\) is deprecated"):
        old = cls("j", 1, UNREACHABLE, timeout=4, use_shared_memory=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = cls("j", 1, connection=Connection(UNREACHABLE, timeout=4, shared_memory=False))
    assert old.connection == new.connection == Connection(UNREACHABLE, 4, Credentials(), False)
    assert pickle.loads(pickle.dumps(new)).connection == new.connection  # async_save's process mode carries it


def test_the_dcp_classes_read_the_environment_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMSTORE_STORE", "10.1.2.3:7070")
    monkeypatch.setenv("MEMSTORE_AUTH_TOKEN", TOKEN)
    writer = MemStoreWriter("j", 1)
    assert writer.connection == Connection("10.1.2.3:7070", credentials=Credentials(token=TOKEN))
    monkeypatch.setenv("MEMSTORE_STORE", "bad")
    with pytest.raises(InvalidArgumentError, match=r"MEMSTORE_STORE='bad'"):
        MemStoreReader("j")


# -- one import line ----------------------------------------------------------------------------------------
def test_every_public_name_comes_from_trainer_client() -> None:
    import importlib

    import trainer_client

    expected = {
        "CheckpointClient", "Connection", "Credentials", "MemStoreWriter", "MemStoreReader", "SaveHandle", "SaveResult",
        "RestorePoint", "ClientStats", "TrainingState", "ResumableDataLoader", "MemstoreClientError", "InvalidArgumentError",
        "SerializationError", "CapacityExceededError", "ReplicationError", "StoreUnavailableError", "NotFoundError",
        "NoCheckpointError", "CorruptShardError", "AlreadySavedError", "CheckpointExistsError", "CaptureError",
        "AuthenticationError", "AccessDeniedError", "ReplicaMismatchError",
    }  # fmt: skip
    assert set(trainer_client.__all__) == expected
    errors = importlib.import_module("trainer_client.errors")
    for name in trainer_client.__all__:
        value = getattr(trainer_client, name)
        assert value.__name__ == name
        if name.endswith("Error"):
            assert value is getattr(errors, name) and issubclass(value, errors.MemstoreClientError)
    namespace: dict = {}
    exec("from trainer_client import *", namespace)
    assert expected <= set(namespace)
    with pytest.raises(AttributeError, match="no attribute 'client_credentials'"):
        trainer_client.client_credentials  # noqa: B018


def test_importing_the_package_loads_neither_grpc_nor_torch() -> None:
    code = "import sys, trainer_client; print(sorted(m for m in ('grpc', 'torch', 'trainer_client.dcp') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# -- memstore.ray -------------------------------------------------------------------------------------------
RAY_CLUSTER_TOKEN = "ray-cluster-token-" + "c" * 20
RAY_CLUSTER = Credentials(token=RAY_CLUSTER_TOKEN)


@pytest.fixture
def ray_worker(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """RayTrainCheckpoints inside a fake Ray Train worker (rank 1 of 2, node store 10.0.0.7:7070, the cluster token
    ``RAY_CLUSTER_TOKEN`` in Ray's GCS); records the clients it builds."""
    pytest.importorskip("ray.train")
    import memstore.ray.stores as stores
    import memstore.ray.train as train

    class Context:
        def get_world_rank(self) -> int:
            return 1

        def get_world_size(self) -> int:
            return 2

        def get_experiment_name(self) -> str:
            return "run one"

    built: list[dict] = []
    monkeypatch.setattr(train.ray.train, "get_context", Context)
    monkeypatch.setattr(stores, "local_store_address", lambda namespace, timeout: "10.0.0.7:7070")
    monkeypatch.setattr(stores.gcs.Registry, "cluster_token", lambda self: RAY_CLUSTER_TOKEN)
    for name in ("MEMSTORE_AUTH_TOKEN", "MEMSTORE_AUTH_TOKEN_FILE", "MEMSTORE_TLS_CA", "MEMSTORE_TLS_CERT", "MEMSTORE_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(train, "CheckpointClient", lambda *args, **kwargs: built.append({"args": args, **kwargs}))
    return built


def test_ray_train_workers_take_a_connection_and_default_to_the_node_s_store(ray_worker: list[dict]) -> None:
    from memstore.ray.train import RayTrainCheckpoints

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RayTrainCheckpoints(connection=Connection(timeout=5), on_capacity="skip")
        RayTrainCheckpoints(connection=Connection("10.9.9.9:1"))
    assert ray_worker[0] == {
        "args": ("run-one", 1, 2),
        "connection": Connection("10.0.0.7:7070", timeout=5, credentials=RAY_CLUSTER),  # the node's store, the cluster token
        "on_capacity": "skip",
    }
    assert ray_worker[1]["connection"] == Connection("10.9.9.9:1", credentials=RAY_CLUSTER)  # an address of its own is kept


def test_ray_credentials_come_from_the_connection_then_the_environment_then_the_cluster_token(
    ray_worker: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    import memstore.ray as mray

    own = Credentials(token="own-token-" + "o" * 20)
    assert mray.local_store_connection(Connection(credentials=own)) == Connection("10.0.0.7:7070", credentials=own)
    assert mray.store_credentials() == RAY_CLUSTER
    monkeypatch.setenv("MEMSTORE_AUTH_TOKEN", "env-token-" + "e" * 20)  # e.g. a job token: the environment's wins
    assert mray.local_store_connection().credentials == Credentials(token="env-token-" + "e" * 20)


def test_ray_train_workers_still_take_the_old_arguments_with_a_warning(ray_worker: list[dict]) -> None:
    from memstore.ray.train import RayTrainCheckpoints

    with pytest.warns(DeprecationWarning, match=r"RayTrainCheckpoints\(timeout=\) is deprecated"):
        RayTrainCheckpoints(timeout=30, run_id="r1")
    assert ray_worker[0] == {
        "args": ("run-one", 1, 2),
        "connection": Connection("10.0.0.7:7070", timeout=30, credentials=RAY_CLUSTER),
        "run_id": "r1",
    }
    with pytest.raises(TypeError, match=r"RayTrainCheckpoints\(\) got both connection= and the deprecated timeout="):
        RayTrainCheckpoints(connection=Connection(), timeout=30)


def test_ray_train_workers_refuse_an_unknown_option_before_they_connect(ray_worker: list[dict]) -> None:
    from memstore.ray.train import RayTrainCheckpoints

    with pytest.raises(
        TypeError, match=r"RayTrainCheckpoints\(\) got unexpected options retries: it takes job_id, namespace=, connection="
    ):
        RayTrainCheckpoints(retries=3, on_capacity="skip")
    assert ray_worker == []  # no client was made


def test_the_examples_use_no_deprecated_argument() -> None:
    import ast

    examples = Path(__file__).resolve().parents[2] / "examples"
    for path in sorted(examples.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("CheckpointClient", "MemStoreWriter", "MemStoreReader"):
                old = {k.arg for k in node.keywords} & set(DEPRECATED_KWARGS)
                assert not old, f"{path.name}:{node.lineno} passes {old}: use connection="


def test_a_dcp_reader_names_a_group_that_is_not_a_process_group() -> None:
    reader = MemStoreReader("j", connection=Connection("127.0.0.1:1"), group=object())
    with pytest.raises(InvalidArgumentError, match=r"MemStoreReader\(group=.*\) is not a process group of this job"):
        reader.latest_step()
