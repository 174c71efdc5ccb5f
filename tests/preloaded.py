"""`python SCRIPT ARGS` without paying for Python's imports each time: a process that has imported the libraries
train.py uses (torch alone takes about 3 s on the 2-core CI machine) forks a child for each launch, and the child
runs the script as `__main__` with the launch's argv, working directory and environment, its output in a file.

The child is a real process running the real program: its own pid, signals, exit status, atexit handlers and
interpreter shutdown. What it shares with the parent is only the libraries' import (not our code: `src` is
imported fresh by each child). Launches that this cannot stand for keep the real command (tests/conftest.py):
several processes, a launcher, an environment of their own, or a process the test signals while it runs.
"""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs in the preloaded process: a request per line on stdin, answered with the child's pid and then its status.
SERVER = r"""
import json, os, runpy, sys
import numpy, torch, torch._dynamo, torch.utils.tensorboard, accelerate, hydra, omegaconf, safetensors.torch, tqdm
print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the launch: as `python SCRIPT ARGS` would start, from here on
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null, out = os.open(os.devnull, os.O_RDONLY), os.open(request["output"], os.O_WRONLY | os.O_TRUNC)
        os.dup2(null, 0), os.dup2(out, 1), os.dup2(out, 2)
        os.close(null), os.close(out)
        sys.argv = request["argv"]
        script = os.path.abspath(sys.argv[0])
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
        sys.exit(0)  # the interpreter's own exit: atexit handlers, buffered output, threads
    print(json.dumps({"pid": pid}), flush=True)
    print(json.dumps({"status": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
"""


class PreloadedPython:
    def __init__(self):
        self.server: subprocess.Popen | None = None

    def _start(self) -> None:
        self.server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._answer(timeout=300)  # {"ready": pid}

    def _answer(self, timeout: float) -> dict:
        if not select.select([self.server.stdout], [], [], timeout)[0]:
            raise TimeoutError
        line = self.server.stdout.readline()
        if not line:
            raise RuntimeError(f"the preloaded Python exited ({self.server.wait()})")
        return json.loads(line)

    def run(self, argv: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        """`python *argv` in cwd with env; stdout and stderr merged, as subprocess.run(..., text=True) gives them."""
        if self.server is None or self.server.poll() is not None:
            self._start()
        with tempfile.NamedTemporaryFile("r", prefix="launch_", suffix=".out") as output:
            request = {"argv": argv, "cwd": str(cwd), "env": env, "output": output.name}
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            pid = self._answer(timeout=60)["pid"]
            try:
                status = self._answer(timeout=timeout)["status"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._answer(timeout=60)
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, output.read()) from None
            return subprocess.CompletedProcess([sys.executable, *argv], status, output.read())

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()
            self.server.wait(timeout=60)
