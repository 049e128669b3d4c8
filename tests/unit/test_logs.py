"""Structured logs: host, job, step and rank fields, human and JSON formats."""

from __future__ import annotations

import io
import json
import logging

import pytest

from memstore.core.model import ShardKey
from memstore.logs import ContextFilter, JsonFormatter, configure

pytestmark = pytest.mark.unit


def emit(formatter: logging.Formatter, msg: str, *args: object, **extra: object) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter("h3"))
    handler.setFormatter(formatter)
    log = logging.getLogger("memstore.test.logs")
    log.propagate = False
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        log.warning(msg, *args, extra=extra or None)
    finally:
        log.removeHandler(handler)
    return stream.getvalue().strip()


def test_fields_come_from_a_shard_key_argument() -> None:
    key = ShardKey("llama", 120, 7)
    doc = json.loads(emit(JsonFormatter(), "repair of %s failed: %s", key, "peer down"))
    assert doc["level"] == "WARNING" and doc["logger"] == "memstore.test.logs"
    assert (doc["host"], doc["job"], doc["step"], doc["rank"]) == ("h3", "llama", 120, 7)
    assert doc["message"].endswith("failed: peer down") and doc["time"].endswith("Z")


def test_extra_wins_and_lines_about_no_shard_carry_the_host_only() -> None:
    doc = json.loads(emit(JsonFormatter(), "spill of %s done", "llama", job="llama", step=5))
    assert (doc["job"], doc["step"], "rank" in doc) == ("llama", 5, False)
    plain = json.loads(emit(JsonFormatter(), "membership v3"))
    assert plain["host"] == "h3" and not {"job", "step", "rank"} & set(plain)


def test_human_format_shows_the_fields_in_brackets() -> None:
    line = emit(logging.Formatter("%(levelname)s %(name)s%(context)s: %(message)s"), "lost %s", ShardKey("j", 2, 0))
    assert line.startswith("WARNING memstore.test.logs [host=h3 job=j step=2 rank=0]: lost ")


def test_configure_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="log format 'xml' is invalid"):
        configure("INFO", "xml")
