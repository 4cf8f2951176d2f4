"""Nexmark: the streaming benchmark's auctions, bids and people, and its queries.

``generator.py`` makes the events by Flink Nexmark's rules (github nexmark/nexmark,
``nexmark-flink/.../generator``), seeded so that a run can be repeated; ``generate.py``
is the command that writes them as files (``python -m millwheel.nexmark.generate``)
with ``nexmark.json`` beside them (``meta.py``); ``queries/`` holds each query as a spec
file ``millwheel run`` takes, and what renders one for a generated data set;
``running.py`` is the per-key aggregate over the whole stream q4 needs.
docs/nexmark.md says how ours maps to Flink's SQL.
"""
