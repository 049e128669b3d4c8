"""The recovery matrix: each fault of a catalogue injected into real processes during saves, then measured.

- :mod:`.fault`: what a fault is; :mod:`.catalogue` (with :mod:`.faults_network` and :mod:`.faults_environment`):
  the faults (id, name, description, the configurations each runs in, how to inject it and what to restart), one
  declarative entry each;
- :mod:`.scenario`: the processes of one row: a real ``LocalCluster``, trainer ranks as real processes
  (:mod:`.worker`) saving a deterministic state (:mod:`.state`) every step, every rank's restore; what RPO,
  RTO and exact mean;
- :mod:`.links`: the links of a row through fault proxies (store to store, rank to store), for network faults;
- :mod:`.runner`: one row run: start, inject the fault during saves, recover, restore, measure;
- :mod:`.report`: ``docs/recovery-matrix.md`` and its raw JSON.

Run it with ``python -m tools.recovery_matrix`` (``--help``).
"""
