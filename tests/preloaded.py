"""`python SCRIPT ARGS` and `python -m LAUNCHER ARGS` without paying for Python's imports each time: a process
that has imported the libraries train.py uses (torch, its compiler's front end and transformers take 3 to 5 s on
the 2-core CI machine) forks a child for each launch, and the child runs the script (or the launcher's module) as
`__main__` with the launch's argv, working directory and environment, its output in a file. A launcher's workers
are forked in turn instead of started as `python -u SCRIPT` (tests/preloaded_server.py says how).

The child is a real process running the real program: its own pid (and session, if asked), signals, exit status,
atexit handlers and interpreter shutdown; a launcher is accelerate's or torch's own code, its workers real
processes whose parent shows the launcher's command line and goes away with it. What they share with the server is
only the libraries' import, not our code: `src` is imported afresh by each child. Launches that this cannot stand
for keep the real command (tests/conftest.py): an environment that the libraries read at import, a command typed
into a shell (the README's), and the tests of the launcher's own pid. tests/test_preloaded.py compares the two.
"""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class PreloadedPython:
    def __init__(self):
        self.server: subprocess.Popen | None = None
        self.answers: dict[int, dict] = {}
        self.next_id = 0

    def _start(self) -> None:
        room = " " * 16384  # for a forked launch's command line and environment (tests/preloaded_server.py)
        self.server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("preloaded_server.py")), room],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1", "PRELOADED_SERVER_ROOM": room})
        self.answers, self.buffer = {}, b""
        self.outputs = tempfile.TemporaryDirectory(prefix="launches_")
        self._pump(timeout=300)  # {"ready": pid}

    def _pump(self, timeout: float) -> None:
        """Reads what the server has answered, waiting up to `timeout` for the first line."""
        fd = self.server.stdout.fileno()
        while select.select([fd], [], [], timeout)[0]:
            data = os.read(fd, 1 << 16)
            if not data:
                raise RuntimeError(f"the preloaded Python exited ({self.server.wait()})")
            self.buffer += data
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                fields = json.loads(line)
                self.answers.setdefault(fields.pop("id", -1), {}).update(fields)
            timeout = 0

    def _answer(self, request_id: int, key: str, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while key not in self.answers.get(request_id, {}):
            left = 1.0 if deadline is None else deadline - time.monotonic()
            self._pump(timeout=max(0.0, min(left, 1.0)))  # at least once, also for timeout=0 (poll)
            if left <= 0 and key not in self.answers.get(request_id, {}):
                return None
        return self.answers[request_id][key]

    def start(self, argv: list[str], cwd: Path, env: dict, new_session: bool = False) -> "Launched":
        """`python *argv` (a script or `-m` a launcher) in cwd with env, running on; stdout and stderr merged into
        a file."""
        if self.server is None or self.server.poll() is not None:
            self._start()
        self.next_id += 1
        output = Path(self.outputs.name) / f"{self.next_id}.out"
        output.touch()
        request = {"id": self.next_id, "argv": argv, "cwd": str(cwd), "env": env, "output": str(output),
                   "new_session": new_session}
        self.server.stdin.write((json.dumps(request) + "\n").encode())
        self.server.stdin.flush()
        return Launched(self, self.next_id, self._answer(self.next_id, "pid", 60), [sys.executable, *argv], output)

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()
            self.server.wait(timeout=60)
            self.outputs.cleanup()


class Launched:
    """What subprocess.Popen gives for a launch that the preloaded Python forked: pid, poll, wait, communicate,
    send_signal, kill, returncode (the output is in `output_path` as it is written)."""

    def __init__(self, server: PreloadedPython, request_id: int, pid: int, args: list[str], output_path: Path):
        self.server, self.request_id, self.pid, self.args, self.output_path = server, request_id, pid, args, output_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server._answer(self.request_id, "status", timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server._answer(self.request_id, "status", timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise subprocess.TimeoutExpired(self.args, timeout, self.output()) from None
        return self.output(), None

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
