"""The progress block's seqlock under load: a reader in another process never sees a
torn slot (an active batch with a start time or deadline that the writer never wrote).

A torn read made the watchdog kill a healthy worker in a 25-minute run ("a batch of 0
record(s) of /0 has run 5920.7 s, over its deadline of 0.0 s": the machine's uptime
against a start of 0). Here one process publishes and ends batches as fast as it can
while this one reads every slot in a loop for a few seconds; every batch it sees must
carry what some publish wrote: a positive start no later than now, the deadline, the
computation name and range. The reader reads for 5 s and on until it has seen 2,000 running batches
(up to a minute on a loaded machine), so a slow machine checks as many as a quiet one;
one writer thread's batches last a millisecond so that some are always seen running,
the other two publish and end back to back. Before the fix this failed in 5 runs of 5
(83 to 510 torn reads among 364 to 3,319 batches seen in 3 s on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from services.worker.progress import ProgressBlock

WRITER = r"""
import os, sys, threading, time
from services.worker.progress import ProgressBlock
block = ProgressBlock(int(sys.argv[1]))
stop = threading.Event()
def hammer(n):
    i = 0
    while not stop.is_set():
        i += 1
        with block.batch(f"comp{n}", n, 1000 + n, 30.0 + n, ids=[f"id{i}"]):
            if n == 0:
                time.sleep(0.001)  # one thread's batches last a while: the reader sees them running
threads = [threading.Thread(target=hammer, args=(n,)) for n in range(3)]
for t in threads: t.start()
sys.stdin.read()  # the reader closes our stdin when it has seen enough
stop.set()
for t in threads: t.join()
"""


def test_a_reader_in_another_process_never_sees_a_torn_slot() -> None:
    block = ProgressBlock()
    wanted, started = 2000, time.monotonic()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(block.fd)],
                              pass_fds=(block.fd,), cwd=os.getcwd(), stdin=subprocess.PIPE)
    seen = torn = 0
    examples: list[str] = []
    try:
        while writer.poll() is None and time.monotonic() - started < 60.0 \
                and (seen < wanted or time.monotonic() - started < 5.0):
            for r in block.running():
                seen += 1
                n = r.range_id
                ok = (0.0 < r.start <= time.monotonic() and r.deadline_s == 30.0 + n
                      and r.computation == f"comp{n}" and r.token == 1000 + n and r.n_ids == 1)
                if not ok:
                    torn += 1
                    if len(examples) < 5:
                        examples.append(repr(r))
    finally:
        assert writer.stdin is not None
        writer.stdin.close()
        writer.wait(timeout=30)
        block.close()
    assert writer.returncode == 0
    assert seen >= wanted, f"the reader saw only {seen} running batches: the test proves nothing"
    assert torn == 0, f"{torn} torn reads of {seen}, e.g. {examples}"
