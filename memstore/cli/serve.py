"""``memstore serve``: run one store server.

Configuration precedence (flags > ``MEMSTORE_*`` env > config file > defaults) is :meth:`StoreConfig.load`'s.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from memstore.cli.common import configure_logging
from memstore.config import StoreConfig

HELP = "run one store server"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`StoreConfig` field; an unset flag (None) leaves env, file or default in charge."""
    for f in fields(StoreConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):  # --flag / --no-flag
            p.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=StoreConfig.help_of(f.name))
        else:
            p.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), help=StoreConfig.help_of(f.name))
    p.add_argument("--config", default=None, help="TOML config file ([store] table); also MEMSTORE_CONFIG")


def run(args: argparse.Namespace) -> int:
    from memstore.interop.dcp_export import DcpExport
    from memstore.server.app import serve

    cli = {f.name: getattr(args, f.name) for f in fields(StoreConfig)}
    config = StoreConfig.load(cli, config_file=args.config)
    configure_logging(config.log_level, config.log_format, config.host_id)
    return serve(config, spill_listeners=[DcpExport()])  # spilled DCP steps also load with plain DCP
