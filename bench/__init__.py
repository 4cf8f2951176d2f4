"""millwheel's benchmarks: ``python -m bench`` runs the suite (bench/__main__.py).

Layout, by purpose; a module imports only from the groups above its own, never below:

1. :mod:`bench.workload`, :mod:`bench.pipelines`, :mod:`bench.redis_memory`,
   :mod:`bench.run_local`: the seeded workload and its exact answer, the two benchmark
   pipelines, and millwheel's local runner under backlog and paced load;
2. :mod:`bench.harness`: what several cases share (a case in a fresh process, fresh
   stores, free ports, the checkout's root);
3. :mod:`bench.cases`: the measured cases, each also a command
   (``python -m bench.cases.NAME``); :mod:`bench.peers`: the same workload on Bytewax,
   Flink SQL and Pathway;
4. :mod:`bench.report`: the ratios, the targets and the markdown table of a run;
5. :mod:`bench.suite` and ``__main__``: the plan of a run, section by section.

Results of past runs are in bench/results/. This module imports nothing.
"""
