"""Helpers the command modules share (not a command)."""

from __future__ import annotations

import argparse
import logging


def configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level, logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def add_store_address_arguments(p: argparse.ArgumentParser) -> None:
    """``--store`` and ``--timeout``: the commands that ask a running cluster."""
    p.add_argument("--store", default="127.0.0.1:7070", help="address of any store of the cluster")
    p.add_argument("--timeout", type=float, default=3.0)
