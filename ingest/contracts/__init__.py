"""The contracts between rtrl's processes, in one place at the bottom of the import order.

Every name that two processes (or a process and the chart) must spell the same lives here:
the Redis keys (:mod:`ingest.contracts.keys`), the registry's aliases, tags and the adapter
manifest (:mod:`ingest.contracts.registry`), Kafka transactional ids
(:mod:`ingest.contracts.transactions`), what a product metric means
(:mod:`ingest.contracts.metrics`: edit persistence at a named horizon, the per-arm cohort
summary) and the Prometheus catalogue (:mod:`ingest.contracts.prometheus`). The event
contract itself is :mod:`ingest.events`. Any room may import these; they import nothing of
rtrl but :mod:`ingest.events`.
"""
