"""The lab: development tools that run from a checkout and never ship in the wheel.

Tests (``tests/``), benchmarks (``benchmarks/``) and the generated pages of ``docs/`` use them from the repository
root: the fuzzer (:mod:`.fuzz`), the recovery matrix (:mod:`.recovery_matrix`), fake S3 and DNS servers
(:mod:`.s3_server`, :mod:`.dns_server`), fault proxies (:mod:`.faultproxy`, :mod:`.s3_proxy`), the clock shifter
(:mod:`.clockshift`), memory-cgroup runs (:mod:`.memcg`), throwaway TLS certificates (:mod:`.certs`), ranks as
threads (:mod:`.thread_ranks`) and the scale runs (:mod:`.scale`, :mod:`.save_scale`, :mod:`.shm_replacement`).
What the wheel ships for running stores locally is :mod:`memstore.testing`; the demo and chaos runs are
:mod:`memstore.demo`. Nothing in ``memstore`` or ``trainer_client`` imports this package.
"""
