"""Bridges between the store's tiers and ``trainer_client``'s formats.

Modules here may import ``trainer_client`` (the shard format, DCP metadata); ``memstore/server`` and
``memstore/spill`` never import this package. The command line plugs them in at the composition root
(``memstore serve`` hands ``DcpExport`` to the spill tier as a ``memstore.spill.port.SpillListener``).
"""
