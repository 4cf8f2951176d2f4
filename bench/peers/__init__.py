"""The peers: the same workload, the same keyed 10 s tumbling count and the same check on
Bytewax (:mod:`~bench.peers.peer_bytewax`), Flink SQL (:mod:`~bench.peers.peer_flink`,
whose ``python -m bench.peers.peer_flink`` also alternates rounds with millwheel and the
other peers) and Pathway (:mod:`~bench.peers.peer_pathway`). Flink SQL and Pathway run in
a virtualenv of their own (:mod:`~bench.peers.peer_common`), their side being
:mod:`~bench.peers.flink_job` and :mod:`~bench.peers.pathway_job`.
"""
