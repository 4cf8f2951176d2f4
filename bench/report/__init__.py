"""The report of a bench run: its ratios and targets (:mod:`bench.report.targets`) and its
markdown table (:mod:`bench.report.tables`). Imports nothing."""
