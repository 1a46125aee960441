"""Where a TP1 warm land's time goes: 4 GB of warm files by pread in 4 MiB ranges into page-locked
chunks on N threads, the main thread issuing one host-to-device copy per chunk (as Landing does),
per bucket of 8 chunks waited for (as land() does) or streamed without a wait."""

import os
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

d = sys.argv[1]
files = sorted(os.path.join(d, f) for f in os.listdir(d))
C = 4 << 20
jobs = [(f, o, C) for f in files for o in range(0, os.path.getsize(f), C)]
total = sum(n for *_, n in jobs)
dev = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
fds = {f: os.open(f, os.O_RDONLY) for f in files}


def run(threads, h2d, bucket):
    n = 2 * threads
    chunks = [torch.empty(C, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    views = [memoryview(c.numpy()) for c in chunks]
    fences = [None] * n
    pool = ThreadPoolExecutor(threads)
    list(pool.map(lambda c: c, range(threads)))
    pending = deque()
    nxt = 0

    def send(c, fut):
        fut.result()
        if h2d:
            dev[:C].copy_(chunks[c], non_blocking=True)
            e = torch.cuda.Event()
            e.record()
            fences[c] = e

    torch.cuda.synchronize()
    t = time.perf_counter()
    for i, (f, o, _m) in enumerate(jobs):
        if len(pending) == n:
            send(*pending.popleft())
        c, nxt = nxt, (nxt + 1) % n
        if fences[c] is not None:
            fences[c].synchronize()
            fences[c] = None
        pending.append((c, pool.submit(os.preadv, fds[f], [views[c]], o)))
        if bucket and (i + 1) % 8 == 0:
            while pending:
                send(*pending.popleft())
    while pending:
        send(*pending.popleft())
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    pool.shutdown()
    print(
        f"threads={threads:2d} h2d={h2d:d} wait_per_32MiB_bucket={bucket:d}: {s:.3f} s = {total / s / 1e9:5.1f} GB/s",
        flush=True,
    )


for threads in (1, 4, 8, 16):
    run(threads, False, False)
for threads in (8, 16):
    for bucket in (False, True):
        run(threads, True, bucket)
t = time.perf_counter()
x = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
print(f"cudaHostAlloc 64 MiB: {time.perf_counter() - t:.3f} s")
