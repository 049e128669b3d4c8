"""The showcase runs the wheel ships: ``memstore demo`` and ``memstore chaos``.

:mod:`~memstore.demo.showcase` runs the end-to-end showcase (DDP training survives a host loss bit-exactly),
:mod:`~memstore.demo.chaos_run` the seeded fault run, both on a :class:`~memstore.testing.LocalCluster` and with
:mod:`~memstore.demo.worker` as the trainer rank they start (``python -m memstore.demo.worker``). Their commands
are :mod:`memstore.cli.demo` and :mod:`memstore.cli.chaos`. The lab that does not ship (the fuzzer, the recovery
matrix, fake S3 and DNS servers, fault proxies, the clock shifter, scale runs) lives in the repository's ``tools/``.
"""
