"""A connector sink's watermark is what its external system is known to hold (issue 34
item 9: it stayed `-inf (nothing yet)` after every row was written). A real controller
and worker, a redis-stream sink on a second redis-server: once the rows are in Redis,
the sink's node shows the producers' watermark, and +inf once they are done."""

from __future__ import annotations

import time
from pathlib import Path

import redis

from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP
from millwheel.spec import spec_parts
from services.generated import millwheel_pb2 as pb
from tests.support.redis_server import RedisServer
from tests.support.service_cluster import Cluster, wait_for

T0 = 1_700_000_000_000_000


def test_a_sink_shows_the_watermark_of_what_it_wrote_then_done(tmp_path: Path) -> None:
    with RedisServer() as target:
        out = redis.Redis.from_url(target.url)
        cluster = Cluster(tmp_path)
        try:
            cluster.start_controller()
            cluster.start_worker()
            comps, injs, logs, sinks = spec_parts({
                "injectors": [{"name": "ev", "stream": "ev"}],
                "computations": [{"name": "upper", "inputs": ["ev"], "outputs": ["up"],
                                  "code": {"name": "map", "params": {"value": "value.upper()"}}}],
                "sinks": [{"name": "out", "stream": "up", "type": "redis-stream", "url": target.url,
                           "redis_stream": "out"}],
            })
            from services.rpc.convert import spec_to_proto
            cluster.client.register_topology([spec_to_proto(c) for c in comps], injs, logs, sinks=sinks)

            def sink_wm() -> int:
                return next(w.low_watermark for w in cluster.client.watermarks() if w.node == "sink:out")

            assert sink_wm() == MIN_TIMESTAMP  # nothing written yet
            records = [pb.Record(key=f"k{i}", value=f"v{i}".encode(), timestamp=T0 + i, id=f"r{i}")
                       for i in range(50)]
            cluster.client.inject(iter([pb.InjectRequest(injector="ev", records=records, watermark=T0 + 1000)]))
            wait_for(lambda: out.xlen("out") >= 50 or None, 60, "50 entries in the sink's stream")
            wait_for(lambda: sink_wm() == T0 + 1000 or None, 30,
                     "the sink's watermark at the producers' once its rows are written")
            assert out.xlen("out") == 50
            cluster.client.inject(iter([pb.InjectRequest(injector="ev", done=True)]))
            wait_for(lambda: sink_wm() == MAX_TIMESTAMP or None, 30, "the sink done after its producers")
            time.sleep(0.5)
            assert out.xlen("out") == 50  # nothing written twice on the way
        finally:
            cluster.stop()
