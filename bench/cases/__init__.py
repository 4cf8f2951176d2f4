"""The measured cases, one module each, each also a command: ``python -m bench.cases.NAME``.

The suite's sections (:mod:`bench.suite`): :mod:`~bench.cases.limits`,
:mod:`~bench.cases.recovery` (which runs :mod:`~bench.cases.recovery_target`),
:mod:`~bench.cases.service`, :mod:`~bench.cases.ha` (with
:mod:`~bench.cases.ha_failover`), :mod:`~bench.cases.long_runs` (with
:mod:`~bench.cases.growth` and :mod:`~bench.cases.ttl`), :mod:`~bench.cases.soak` (with
:mod:`~bench.cases.soak_series`: its series and what is concluded from them), and the
opt-in Nexmark sections of issue 32: :mod:`~bench.cases.nexmark` (events/s per core) and
:mod:`~bench.cases.nexmark_latency` (latency at 50% of capacity), whose runs of each
system are :mod:`~bench.cases.nexmark_runs`.
Before/after checks of a change, run from several source trees alternated:
:mod:`~bench.cases.ab`, :mod:`~bench.cases.latency_ab`, :mod:`~bench.cases.redis_ab`,
:mod:`~bench.cases.service_ab`. Figures of their own: :mod:`~bench.cases.redis_vs_sqlite`,
:mod:`~bench.cases.spark_vs_inprocess`.

They import :mod:`bench.harness` and the modules beside it, never the suite or the report.
"""
