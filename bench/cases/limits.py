"""The machine's physical limits, measured with the workload's record sizes.

Each is the best a component on the hot path can do with nothing of millwheel around
it, so a millwheel figure divided by its limit says how much the framework costs:

* ``redis_lua_checkpoint``: one Lua script per batch of 100 or 1000 records doing
  what a checkpoint does at minimum (token check, consumed-ID add, per-key state
  write), sent through a redis-py pipeline ``depth`` scripts per round trip
  (depth 1 = a runner waiting for each checkpoint, as millwheel's runner does).
* ``grpc_stream``: 100-record batches over one bidirectional grpcio stream on
  loopback, the server acking each batch (generic handlers, bytes in and out).
* ``bloom``: pybloom-live ScalableBloomFilter adds and lookups per second, with the
  parameters of :mod:`millwheel.dedup`.
"""

from __future__ import annotations

import time
from concurrent import futures
from typing import Any, Iterator

from bench.workload import Workload

LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[3])
for i = 4, 3 + n do redis.call('ZADD', KEYS[2], 'NX', ARGV[2], ARGV[i]) end
for i = 4 + n, #ARGV, 2 do redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]) end
return 1
"""


def redis_lua_checkpoint(url: str, w: Workload, batch: int, depth: int, seconds: float) -> dict[str, Any]:
    import redis

    r = redis.Redis.from_url(url)
    r.flushdb()
    r.set("lim:token", 7)
    sha = r.script_load(LUA)
    records = w.records
    state_value = b'{"1700000000000000":[3,0.0,0.0,0.0,false]}'  # a window_aggregate state
    done = 0
    pos = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        pipe = r.pipeline(transaction=False)
        for _ in range(depth):
            chunk = records[pos:pos + batch] if pos + batch <= len(records) else records[:batch]
            pos = (pos + batch) % max(1, len(records) - batch)
            args: list[Any] = ["7", str(int(time.time() * 1e6)), str(len(chunk))]
            args += [rec.record_id for rec in chunk]
            for rec in chunk:
                args += [rec.key, state_value]
            pipe.evalsha(sha, 3, "lim:token", "lim:ids", "lim:state", *args)
        results = pipe.execute()
        assert all(x == 1 for x in results), results
        done += batch * depth
    elapsed = time.perf_counter() - started
    memory = r.info("memory")["used_memory"]
    r.flushdb()
    r.close()
    return {"batch": batch, "depth": depth, "records_per_s": done / elapsed, "used_memory": memory}


def grpc_stream(w: Workload, batch: int, seconds: float) -> dict[str, Any]:
    import grpc

    def echo(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        for _ in requests:
            yield b"k"

    handler = grpc.method_handlers_generic_handler(
        "bench.Limit", {"Stream": grpc.stream_stream_rpc_method_handler(echo)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    recs = w.records[:batch]
    # The same framing a length-prefixed record batch would use: key, value, id, ts.
    payload = b"".join(
        len(r.key).to_bytes(2, "big") + r.key.encode() + len(r.value).to_bytes(4, "big") + r.value
        + len(r.record_id).to_bytes(2, "big") + r.record_id.encode() + r.timestamp.to_bytes(8, "big", signed=True)
        for r in recs
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stream = channel.stream_stream("/bench.Limit/Stream")
    deadline = time.perf_counter() + seconds

    def requests() -> Iterator[bytes]:
        while time.perf_counter() < deadline:
            yield payload

    started = time.perf_counter()
    acks = sum(1 for _ in stream(requests()))
    elapsed = time.perf_counter() - started
    channel.close()
    server.stop(0)
    return {"batch": batch, "batch_bytes": len(payload), "records_per_s": acks * batch / elapsed}


def bloom(w: Workload, n: int) -> dict[str, Any]:
    """pybloom-live (the limit the issue names) and millwheel's rbloom-based filter
    (what :mod:`millwheel.dedup` uses since it won), both adding IDs one batch of
    1000 at a time as the dedup step does."""
    from pybloom_live import ScalableBloomFilter

    from millwheel.dedup import ScalableBloom

    ids = [f"r{i}" for i in range(n)]
    probes = [f"x{i}" for i in range(n)]
    f = ScalableBloomFilter(initial_capacity=100_000, error_rate=0.001, mode=ScalableBloomFilter.SMALL_SET_GROWTH)
    started = time.perf_counter()
    for rid in ids:
        f.add(rid)
    adds = n / (time.perf_counter() - started)
    started = time.perf_counter()
    hits = sum(1 for rid in probes if rid in f)
    lookups = n / (time.perf_counter() - started)
    rb = ScalableBloom(initial_capacity=100_000, error_rate=0.001)
    started = time.perf_counter()
    for i in range(0, n, 1000):
        rb.update(ids[i:i + 1000])
    rb_adds = n / (time.perf_counter() - started)
    started = time.perf_counter()
    rb_hits = len(rb.maybe_seen(probes))
    rb_lookups = n / (time.perf_counter() - started)
    return {"ids": n, "adds_per_s": adds, "lookups_per_s": lookups, "false_positive_rate": hits / n,
            "rbloom_adds_per_s": rb_adds, "rbloom_lookups_per_s": rb_lookups,
            "rbloom_false_positive_rate": rb_hits / n}
