"""gpipe's background threads end before the interpreter does: a daemon thread still inside torch
as the interpreter finalizes aborts the process ("terminate called without an active exception"),
which made finished torchrun workers crash at exit and their jobs fail."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A thread that multiplies matrices (torch releases the GIL inside) until it is asked to stop, or
# forever; the main thread exits while it runs.
SCRIPT = """
import sys, threading, time
import torch
from gpipe import threads

a = torch.randn(800, 800)
asked = threading.Event()

def work():
    while not asked.is_set() or {ignores}:
        a @ a

{starter}
time.sleep(0.1)
{status}
sys.exit(3)
"""


def start(starter: str, *, ignores: bool = False, status: str = "") -> subprocess.Popen[str]:
    code = SCRIPT.format(starter=starter, ignores=ignores, status=status)
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": ""}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def ended(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, stderr


def test_a_thread_in_torch_at_exit_ends_first_or_the_process_ends_with_its_status() -> None:
    plain = "threading.Thread(target=work, daemon=True).start()"
    ours = 'threads.start(work, name="gpipe-test", stop=asked.set)'
    crashed = start(plain)  # what happens without gpipe.threads (the failure this guards against)
    stopped = start(ours)  # asked to stop at exit, and waited for
    # a thread that does not stop (a peer that never answers): the exit waits SETTLE_SECONDS, then
    # ends the process with the status the gpipe command recorded, rather than finalizing beside it
    stuck = start(ours, ignores=True, status="threads.exiting(3); threads.SETTLE_SECONDS = 0.5")
    status, stderr = ended(crashed)
    assert status != 3 and "terminate called" in stderr, (status, stderr)
    assert ended(stopped) == (3, "")
    assert ended(stuck) == (3, "")
