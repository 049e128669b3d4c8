"""Development tools, apart from the store daemon: ``memstore demo`` and ``memstore chaos``.

:mod:`~memstore.devtools.demo` runs the end-to-end showcase (DDP training survives a host loss bit-exactly),
:mod:`~memstore.devtools.chaos` the seeded fault run, both with :mod:`~memstore.devtools.demo_worker` as the
trainer rank they start (``python -m memstore.devtools.demo_worker``). Their commands are
:mod:`memstore.cli.demo` and :mod:`memstore.cli.chaos`.
"""
