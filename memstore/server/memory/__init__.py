"""The RAM a store holds shards in: shared-memory segments, their pool and the directories they live in.

:mod:`.segment` (one mapped segment), :mod:`.pool` (the ``SegmentPool``: segments pooled under a byte budget),
:mod:`.reserve` (fresh segments faulted in ahead of need, ``--prefault``; how much is
:mod:`memstore.core.reserve_policy`'s), :mod:`.rings` (each rank's capture ring), :mod:`.pages` and
:mod:`.shm_pages` (faulting pages in, huge or 4 KiB), :mod:`.shm_dirs` (a store's segment directory on the tmpfs),
:mod:`.shm_sweep` (directories dead stores left) and :mod:`.leftovers` (what a store leaves for the next one, and
its adoption). The engine that uses them is :mod:`memstore.server.engine`.
"""
