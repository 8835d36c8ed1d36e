"""grail/core/threads.py: calls that can be abandoned, in threads that never keep the process
alive (what reward plugins and batch scoring run in)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from grail.core.threads import DeadlineExceeded, call_with_deadline, in_daemon_thread


def _fail(message: str) -> None:
    raise ValueError(message)


def test_a_call_within_its_deadline_gives_its_result_or_its_exception() -> None:
    assert call_with_deadline(lambda a, b: a + b, 1, 2, timeout_s=5) == 3
    with pytest.raises(ValueError, match="bad"):
        call_with_deadline(_fail, "bad", timeout_s=5)
    # A TimeoutError the call raises itself is its own error, not the deadline's.
    with pytest.raises(TimeoutError, match="mine"):
        call_with_deadline(lambda: (_ for _ in ()).throw(TimeoutError("mine")), timeout_s=5)


def test_a_call_past_its_deadline_is_abandoned_in_a_daemon_thread() -> None:
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="no result within 0.2 s"):
        call_with_deadline(release.wait, timeout_s=0.2, name="test-stuck")
    assert time.monotonic() - t0 < 2
    stuck = [t for t in threading.enumerate() if t.name == "test-stuck"]
    assert stuck and all(t.daemon for t in stuck)
    release.set()


def test_in_daemon_thread_gives_the_result_or_exception_to_the_awaiting_task() -> None:
    async def both() -> int:
        with pytest.raises(ValueError, match="bad"):
            await in_daemon_thread(_fail, "bad")
        return await in_daemon_thread(sum, [1, 2, 3])

    assert asyncio.run(both()) == 6


# Each stuck call below would keep the interpreter alive at exit in a thread pool's worker
# (asyncio.to_thread, concurrent.futures): the process must end at once instead.
_STUCK = """
import asyncio, time
from grail.core.threads import DeadlineExceeded, call_with_deadline, in_daemon_thread
try:
    call_with_deadline(time.sleep, 3600, timeout_s=0.1)
except DeadlineExceeded:
    pass
async def cancelled():
    try:
        await asyncio.wait_for(in_daemon_thread(time.sleep, 3600), 0.1)
    except TimeoutError:
        pass
asyncio.run(cancelled())
print("done", flush=True)
"""


def test_abandoned_calls_do_not_keep_the_process_alive() -> None:
    t0 = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", _STUCK], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout == "done\n", result.stderr
    assert time.monotonic() - t0 < 30  # seconds to import; the sleeps would take an hour
