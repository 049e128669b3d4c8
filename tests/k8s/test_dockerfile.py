"""The Dockerfile the manifests run: multi-stage, base images pinned to a version, non-root numeric USER, the
entrypoint the DaemonSet's args assume, the torch the lock pins, and a .dockerignore that keeps the venv and .git out."""

from __future__ import annotations

import json
import re

import pytest

from tests.k8s.manifests import ROOT
from tests.k8s.render import split_image

pytestmark = pytest.mark.k8s


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def from_images() -> list[tuple[str, str]]:
    """(image, stage name) of every FROM, with ARG defaults substituted."""
    args: dict[str, str] = {}
    stages: list[tuple[str, str]] = []
    for word, rest in instructions():
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value
        elif word == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--")]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), parts[0])
            stage = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else ""
            stages.append((image, stage))
    return stages


def test_multi_stage_with_pinned_base_images() -> None:
    stages = from_images()
    assert len(stages) >= 2, "a builder stage and a runtime stage"
    names = {stage for _, stage in stages if stage}
    for image, _ in stages:
        if image in names:
            continue
        _, tag, digest = split_image(image)
        assert digest or re.match(r"^\d+\.\d+\.\d+", tag), f"base image {image} is not pinned to a version (x.y.z...)"
        assert "latest" not in tag


def test_runs_as_a_non_root_numeric_user() -> None:
    users = [rest for word, rest in instructions() if word == "USER"]
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, f"USER {users[-1]}: a numeric non-root uid (runAsNonRoot can check it)"
    assert not gid or (gid.isdigit() and int(gid) > 0)
    assert int(uid) == 10001, "the uid the manifests' runAsUser and the trainers' fast path assume"


def test_entrypoint_and_runtime_environment() -> None:
    found = dict(instructions()[::-1])  # the last of each instruction wins
    assert json.loads(found["ENTRYPOINT"]) == ["memstore"], "the DaemonSet's args start with the subcommand"
    assert json.loads(found["CMD"]) == ["serve"]
    env = " ".join(rest for word, rest in instructions() if word == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env, "no .pyc writes on a read-only root filesystem"


def test_torch_is_the_locked_cpu_build() -> None:
    lock = (ROOT / "requirements" / "dev.lock").read_text()
    (version,) = re.findall(r"^torch==([^\s;]+)", lock, flags=re.M)
    runs = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert f"torch=={version}" in runs, f"the image's torch is not requirements/dev.lock's ({version})"
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs


def test_examples_are_in_the_image() -> None:
    copies = [rest for word, rest in instructions() if word == "COPY"]
    assert "examples /opt/memstore/examples" in copies, "k8s/examples runs /opt/memstore/examples/*.py"


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")}
    for entry in (".git", ".venv", "build", "**/__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"):
        assert entry in ignored, f".dockerignore does not exclude {entry}"
    for needed in ("memstore", "trainer_client", "examples", "pyproject.toml", "requirements", "README.md"):
        assert needed not in ignored, f".dockerignore excludes {needed}, which the build copies"
