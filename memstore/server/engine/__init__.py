"""The store engine's parts and the catalog they collaborate over.

:class:`~memstore.server.engine.catalog.Catalog` holds the entries (:mod:`.entries`), their leases and the engine's one
condition; under that same condition :mod:`.arrivals` keeps what is on its way in (pulls, inbound transfers) and
:mod:`.eviction` what retention, pressure and deletes drop. Each part does one job over them, given what it needs in its
constructor by the store (:mod:`memstore.server.store`): saving (:mod:`.saving`, with captures pushed while written,
:mod:`.progress`, and the room a shard takes, :mod:`.room`), replication (:mod:`.replication`), the data channel's
tickets and transfers (:mod:`.datapath`, :mod:`.tickets`, per-sender :mod:`.admission`), local reads
(:mod:`.local_reads`), recovery and repair (:mod:`.recovery`), upkeep (:mod:`.janitor`), leaving on purpose
(:mod:`.drain`), assembly of replica-group stripes (:mod:`.assembler`) and the scrub (:mod:`.scrub`). The RAM they hold
shards in is :mod:`memstore.server.memory`.
"""
