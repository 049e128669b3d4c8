"""The recovery matrix: each fault of a catalogue injected into real processes during saves, then measured.

- :mod:`.catalogue`: the faults (id, name, description, the configurations each runs in, how to inject it and
  what to restart), one declarative entry each;
- :mod:`.scenario`: one row run: a real ``LocalCluster``, trainer ranks as real processes (:mod:`.worker`)
  saving a deterministic state (:mod:`.state`) every step, the fault, the recovery, every rank's restore;
  it measures RPO, RTO and whether the bytes are exact;
- :mod:`.report`: ``docs/recovery-matrix.md`` and its raw JSON.

Run it with ``python -m memstore.devtools.recovery_matrix`` (``--help``).
"""
