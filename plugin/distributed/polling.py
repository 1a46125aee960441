"""How a wait of the :class:`~megastart.distributed.Board` blocks: in slices, short at first
and longer once it has waited a while, and polling what costs the store no request."""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.1
"""How long a wait blocks before it looks at the :class:`Board` again, for its first
:data:`SETTLE_S` seconds (most waits end within them)."""

SETTLE_S = 3.0
LONG_POLL_S = 1.0
"""After :data:`SETTLE_S` seconds a wait looks at the board once every this many seconds: a
leader that waits long (a far bucket) costs the store a request a second, not ten, and a
failure still reaches it within a second."""


def next_slice(started: float, deadline: float) -> float:
    """How long the next slice of a wait that started at ``started`` may block: :data:`POLL_S`
    at first, :data:`LONG_POLL_S` after :data:`SETTLE_S`, never past the ``deadline``."""
    now = time.monotonic()
    length = POLL_S if now - started < SETTLE_S else LONG_POLL_S
    return max(0.001, min(length, deadline - now))  # 0 would mean "no timeout" to gloo


OVERSHOOT = 0.125
"""How long a local poll sleeps at most, as a share of how long it has waited so far: a
condition met during a pause is seen that much later at worst."""

LONGEST_PAUSE_S = 0.002
"""How long a local poll sleeps at most: the ranks of a warm load that wait 50-100 ms for the
last one at the final barrier saw its gate open up to 12 ms late with pauses of up to a
quarter :data:`POLL_S`, and the verdict after it waited for them. At worst 500 looks a second
at a word of shared memory (a few microseconds of CPU each)."""


def polled_locally(condition: Callable[[], bool]) -> Callable[[float], bool]:
    """A ``ready`` for :meth:`~megastart.distributed.Board.wait` that polls a ``condition`` costing no request (a word
    of node-shared memory, a name in ``/dev/shm``): every 50 microseconds at first (the peer
    usually answers at once), then less often, each pause at most :data:`OVERSHOOT` of the
    wait so far and :data:`LONGEST_PAUSE_S`. (Pauses that doubled freely overshot a 30 ms
    wait at a node's barrier by up to 25 ms, a tenth of a warm load.) The wait's start
    carries over from one slice to the next."""
    started = time.monotonic()

    def ready(slice_s: float) -> bool:
        deadline = time.monotonic() + slice_s
        while not condition():
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                return False
            pause = min(max(5e-5, OVERSHOOT * (now - started)), LONGEST_PAUSE_S)
            time.sleep(min(pause, left))
        return True

    return ready
