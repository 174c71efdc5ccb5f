"""One live run per run directory: two runs writing one directory mix their checkpoints, logs and exports.

Rank 0 holds `RUN_DIR/.run.lock` (its host, pid, the process's start time) for as long as the run lives, and
touches it every few seconds (a heartbeat). A second launch into the directory, fresh or resuming, is refused
with the holder's name. A holder that died without letting go (SIGKILL, a lost node) does not block a resume: a
lock whose process is gone (same host: exited, a zombie not yet reaped, or its pid reused) or whose heartbeat is
older than the lease (any host, e.g. on a shared filesystem where flock cannot be trusted) is taken over.
Creation is O_EXCL and a takeover first renames the stale file away, so of two launches racing for one directory
exactly one wins. A requeued SLURM job waits up to one lease for its previous instance to let go.

Module state: `_HELD`, the locks this process holds, which the second Ctrl-C's signal handler
(src/faults/preemption.py) releases before it ends the process at once, as the end of a run does.
"""

import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Optional

from src.errors import RunDirInUse

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"
_HELD: list["RunDirLock"] = []


class RunDirLock:
    def __init__(self, path: Path, token: str, lease_s: float):
        self.path, self.token, self.lease_s = path, token, lease_s
        self._stop = threading.Event()
        threading.Thread(target=self._beat, name="run-dir-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the directory went away, or a full disk: the lease runs out, which is what it is for

    def release(self) -> None:
        self._stop.set()
        holder = _read(self.path)
        if holder is not None and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)


def acquire_run_dir(run_dir: Path, lease_s: float, requeued: bool = False) -> RunDirLock:
    """Hold run_dir for this run (main process only), or raise RunDirInUse naming the live holder."""
    path = run_dir / LOCK_FILE
    deadline = time.monotonic() + (lease_s if requeued else 0)
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "since": datetime.now().isoformat(timespec="seconds"),
            "started": _process_start(os.getpid()), "job": os.environ.get("SLURM_JOB_ID"), "token": uuid.uuid4().hex}
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            raw, age = _read_bytes(path), _age(path)
            holder = _parse(raw)
            gone = _why_gone(holder, age, lease_s)
            if gone:
                if _set_aside(path, raw):
                    log.warning("run dir %s: took over the lock of %s (%s)", run_dir, _describe(holder), gone)
                continue
            if time.monotonic() < deadline:
                time.sleep(min(2.0, lease_s / 4))
                continue
            raise RunDirInUse(
                f"{run_dir} is in use by a live run: {_describe(holder)}, heartbeat {age:.0f} s ago. Two runs in one "
                f"directory would mix their checkpoints and logs. Wait for it to end or stop it (kill "
                f"{holder.get('pid', '?') if holder else '?'} on {holder.get('host', '?') if holder else '?'}), or "
                f"use another hydra.run.dir. A holder that died is taken over once its process is gone (same host) "
                f"or its heartbeat is trainer.run_dir_lease_s={lease_s:g} s old; {path} holds its name."
            ) from None
        with os.fdopen(fd, "w") as file:
            json.dump(mine, file)
            file.flush()
            os.fsync(file.fileno())
        lock = RunDirLock(path, mine["token"], lease_s)
        _HELD.append(lock)
        return lock


def release_run_dirs() -> None:
    """Let go of every run dir this process holds (a run's end, its failure, an in-process sweep's next job)."""
    while _HELD:
        _HELD.pop().release()


def _read_bytes(path: Path) -> Optional[bytes]:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _parse(raw: Optional[bytes]) -> Optional[dict]:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None  # caught between its creation and its first write


def _read(path: Path) -> Optional[dict]:
    return _parse(_read_bytes(path))


def _age(path: Path) -> float:
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        return 0.0


def _why_gone(holder: Optional[dict], age: float, lease_s: float) -> Optional[str]:
    """Why the holder no longer runs, or None while it may."""
    if age > lease_s:
        return f"no heartbeat for {age:.0f} s, more than trainer.run_dir_lease_s={lease_s:g}"
    if holder and holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        pid = holder["pid"]
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"its process {pid} is gone"
        except PermissionError:
            pass  # alive, someone else's
        # A SIGKILLed worker whose launcher died too stays a zombie until init reaps it, which can take seconds.
        if _process_state(pid) in ("Z", "X"):
            return f"its process {pid} has exited"
        started = holder.get("started")
        if started is not None and _process_start(pid) not in (None, started):
            return f"its process {pid} is gone (the pid now belongs to another process)"
    return None


def _stat_fields(pid: int) -> Optional[list[str]]:
    """/proc/PID/stat after the command name (which may hold spaces), or None where there is no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_state(pid: int) -> Optional[str]:
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def _process_start(pid: int) -> Optional[int]:
    """Clock ticks since boot at which the process started: with the pid, it names one process for good."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def _set_aside(path: Path, judged: Optional[bytes]) -> bool:
    """Move the lock judged stale out of the way. Another launch may have replaced it since it was read; then
    what was moved is that launch's live lock, and it goes straight back (link: only where nothing is)."""
    aside = path.with_name(f"{LOCK_FILE}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    taken = aside.read_bytes() == judged
    if not taken:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    aside.unlink()
    return taken


def _describe(holder: Optional[dict]) -> str:
    if not holder:
        return "a run whose lock is being written"
    job = f", SLURM job {holder['job']}" if holder.get("job") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, since {holder.get('since')}"
