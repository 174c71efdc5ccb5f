"""The preloaded Python of tests/preloaded.py: it imports the libraries once, then forks a child for each launch.

Requests arrive on stdin, one JSON line each; answers leave on stdout: {"id", "pid"} once forked, {"id", "status"}
once the child has exited (several children may run at once). A launch is `python SCRIPT ARGS` or `python -m
MODULE ARGS` (the launchers: accelerate launch, torchrun). A launcher's workers are forked too, so that no launch
pays for an interpreter's start-up: by a zygote where torch's elastic agent starts them (it has threads by then,
which a fork must not copy), by the launcher itself where accelerate's one-process launcher starts its child.

Run as `python preloaded_server.py ROOM` with PRELOADED_SERVER_ROOM set: blank space in the process's argument and
environment areas, which a forked launch overwrites with its own command line and environment, as /proc shows them
(train.py reads its launcher's argv from /proc/PPID/cmdline, a test finds a worker's rank in /proc/PID/environ).
"""

import atexit
import ctypes
import gc
import inspect
import json
import os
import select
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Callable, NoReturn

import accelerate  # noqa: F401
import accelerate.commands.launch  # noqa: F401
import hydra  # noqa: F401
import numpy  # noqa: F401
import omegaconf  # noqa: F401
import safetensors.torch  # noqa: F401
import torch
import torch._dynamo  # noqa: F401
import torch.distributed.run  # noqa: F401
import torch.utils.tensorboard  # noqa: F401
import tqdm  # noqa: F401
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

try:  # the extras, where installed (the classes the model and data options load)
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast  # noqa: F401
except ImportError:
    pass
gc.freeze()  # the preloaded objects stay out of the children's collections (and their pages shared, not copied)


def answer(fd: int, **fields) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def read_lines(fd: int, pending: bytes) -> tuple[list[dict], bytes, bool]:
    """The complete JSON lines now readable on fd, what is left of a partial one, and whether fd reached its end."""
    data = os.read(fd, 1 << 16)
    pending += data
    lines = []
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        lines.append(json.loads(line))
    return lines, pending, not data


def fork_per_request(requests: int, answers: int, child: Callable[[dict], None]) -> None:
    """Until `requests` ends, or whoever reads `answers` has gone: fork a child for each request, which runs
    `child(request)`, and answer {"id", "pid"} once the child has closed `request["started"]` (its session and
    output set up, where Popen's exec would be), {"id", "status"} once it has exited."""
    children, pending = {}, b""

    def tell(**fields) -> bool:
        try:
            answer(answers, **fields)
            return True
        except BrokenPipeError:
            return False

    while True:
        if select.select([requests], [], [], 0.01 if children else None)[0]:
            lines, pending, ended = read_lines(requests, pending)
            for request in lines:
                started, child_started = os.pipe()
                pid = os.fork()
                if pid == 0:  # the launch, as `python ARGV` would start it, from here on
                    os.close(started)
                    run_then_exit(lambda: child({**request, "started": child_started}))
                os.close(child_started)
                os.read(started, 1)  # its end, once the child has its session: as Popen returns after the exec
                os.close(started)
                children[pid] = request["id"]
                if not tell(id=request["id"], pid=pid):
                    return
            if ended:
                return
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if not tell(id=children.pop(pid), status=os.waitstatus_to_exitcode(status)):
                return


def run_then_exit(program: Callable[[], None]) -> NoReturn:
    """A forked child's end, as the interpreter ends `python ARGV`: the status a SystemExit asks for (a message is
    printed and gives 1), non-daemon threads joined, atexit callbacks run, buffered output flushed. Only its last
    step is left out: tearing down the modules, which in a child of this process decrements the reference counts
    of torch's and transformers' objects and so copies most of the pages it shares with the server (0.4 to 0.6 s
    a launch, a third of a short one) to free memory that the process's end frees anyway. Any other exception
    ends the child as Python ends a program it escapes (its traceback, status 1; SIGINT for a KeyboardInterrupt)."""
    try:
        program()
        status = 0
    except SystemExit as exit_request:
        status = exit_request.code
    if status is None:
        status = 0
    elif not isinstance(status, int):
        print(status, file=sys.stderr)
        status = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the program, or its reader gone: as at the interpreter's end
            pass
    os._exit(status & 0xFF)


def overwrite_area(first: int, argv_or_env: list[str], what: str) -> None:
    """Write NUL-separated strings over one of this process's start-up areas (fields `first` and `first + 1` of
    /proc/self/stat: its start and end), padded with NULs: what /proc/self/cmdline or /proc/self/environ (and
    ps) show, as setproctitle does it."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[first - 3]), int(fields[first - 2])  # fields are numbered from 1, pid and comm before
    text = b"".join(item.encode() + b"\0" for item in argv_or_env)
    if len(text) > end - start:
        raise RuntimeError(f"a {what} of {len(text)} bytes does not fit the server's {end - start}: give it more room")
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def set_command_line(argv: list[str]) -> None:
    overwrite_area(48, argv, "command line")  # arg_start, arg_end


def set_environment(env: dict) -> None:
    """os.environ, and /proc/self/environ, which shows a process's environment as it started (a test finds a
    worker's rank there). Once os.environ is replaced, no variable points into that area any more."""
    os.environ.clear()
    os.environ.update(env)
    overwrite_area(50, [f"{key}={value}" for key, value in env.items()], "environment")  # env_start, env_end


def become(argv: list[str], env: dict) -> None:
    """Run `python *argv` in this process, as the interpreter would: argv as typed, __file__ and sys.path[0]
    absolute for a script, the module's file as argv[0] and the working directory first on the path for -m."""
    set_environment(env)
    if argv[0] == "-u":  # how torch's launcher starts workers; PYTHONUNBUFFERED is set for every launch here
        argv = argv[1:]
    if argv[0] == "-m":
        import runpy
        import warnings

        # The server imported the module ahead of time, on purpose: runpy's warning about it is about us, not the test.
        warnings.filterwarnings("ignore", r".* found in sys\.modules after import of package", RuntimeWarning)
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = argv
    script = os.path.abspath(argv[0])
    sys.path[0] = os.path.dirname(script)
    main = types.ModuleType("__main__")
    main.__file__, main.__cached__, main.__builtins__ = script, None, __builtins__
    sys.modules["__main__"] = main
    with open(script, "rb") as source:
        code = compile(source.read(), script, "exec")
    exec(code, main.__dict__)


def launch(request: dict) -> None:
    """The forked child: a new launch, from its session to its output file."""
    if request["new_session"]:
        os.setsid()
    os.close(request["started"])
    os.chdir(request["cwd"])
    null, out = os.open(os.devnull, os.O_RDONLY), os.open(request["output"], os.O_WRONLY | os.O_APPEND)
    os.dup2(null, 0), os.dup2(out, 1), os.dup2(out, 2)
    os.close(null), os.close(out)
    if request["argv"][0] == "-m":  # a launcher: its command line for its workers to read, and a zygote for them
        set_command_line([sys.executable, *request["argv"]])
        Zygote.start()
        subprocess.Popen._execute_child = _execute_child_forked
    become(request["argv"], request["env"])


def start_worker(request: dict, *zygote_pipes: int) -> None:
    os.setsid()  # as torch's launcher starts each worker: start_new_session=True
    for fd in (*zygote_pipes, request["started"]):
        os.close(fd)
    become(request["argv"], request["env"])


class Zygote:
    """A child of the launcher, forked before the launcher starts any thread, that forks the launcher's workers
    in its place: torch's elastic agent would start each as `python -u SCRIPT` (its `_popen` is replaced by
    `ForkedWorker`). A worker's parent is then the zygote, which shows the launcher's command line and exits
    with the launcher (its request pipe ends), so the workers see their launcher as they would: its argv in
    /proc, and their parent gone when it is killed (though the pid they name for it is the zygote's: the tests
    of that message start the real command)."""

    requests: int  # the launcher writes worker requests here
    answers: int  # and reads the zygote's answers here
    buffer = b""
    replies: dict[int, dict] = {}
    next_id = 0

    @classmethod
    def start(cls) -> None:
        request_r, cls.requests = os.pipe()
        cls.answers, answer_w = os.pipe()
        if os.fork() == 0:
            os.close(cls.requests), os.close(cls.answers)
            os.setpgid(0, 0)  # out of the launcher's group: a Ctrl-C to the launch is not for the zygote
            fork_per_request(request_r, answer_w, lambda request: start_worker(request, request_r, answer_w))
            os._exit(0)  # the launcher has exited
        os.close(request_r), os.close(answer_w)
        subprocess_handler.SubprocessHandler._popen = _forked_popen

    @classmethod
    def reply(cls, request_id: int, key: str, timeout: float | None):
        """The zygote's answer `key` for a request, waiting up to timeout (None: for ever), or None."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while key not in cls.replies.get(request_id, {}):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([cls.answers], [], [], left)[0]:
                return None
            lines, cls.buffer, _ = read_lines(cls.answers, cls.buffer)
            for line in lines:
                cls.replies.setdefault(line.pop("id"), {}).update(line)
        return cls.replies[request_id][key]


class ForkedWorker:
    """What torch's launcher keeps of a worker it started with subprocess.Popen: pid, poll, wait, signals."""

    def __init__(self, args: tuple, env: dict):
        Zygote.next_id += 1
        self.request_id, self.args, self.returncode = Zygote.next_id, list(args), None
        answer(Zygote.requests, id=self.request_id, argv=self.args[1:], env=env)
        self.pid = Zygote.reply(self.request_id, "pid", None)

    def poll(self):
        if self.returncode is None:
            self.returncode = Zygote.reply(self.request_id, "status", 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = Zygote.reply(self.request_id, "status", timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


def _forked_popen(self, args: tuple, env: dict):
    if args[0] == sys.executable and self._stdout is None and self._stderr is None:
        return ForkedWorker(args, env)
    return _real_popen(self, args, env)  # redirected output or another program: the real Popen


_real_popen = subprocess_handler.SubprocessHandler._popen
_real_execute_child = subprocess.Popen._execute_child


def _execute_child_forked(self, args, *rest):
    """accelerate's one-process launcher starts `python SCRIPT` with subprocess.Popen while it has no thread of
    its own yet: fork it from here instead, a child of the launcher as Popen's would be (Popen waits for it)."""
    given = inspect.signature(_real_execute_child).bind(self, args, *rest).arguments
    plain = (given["executable"] is None and given["cwd"] is None and given["preexec_fn"] is None
             and not given["shell"] and not given["start_new_session"] and given["process_group"] in (None, -1)
             and all(given[fd] == -1 for fd in ("p2cread", "c2pwrite", "errwrite")))
    if not (plain and isinstance(args, list) and args[0] == sys.executable and threading.active_count() == 1):
        return _real_execute_child(self, args, *rest)
    pid = os.fork()
    if pid == 0:
        os.close(Zygote.requests), os.close(Zygote.answers)
        run_then_exit(lambda: become(args[1:], given["env"] if given["env"] is not None else dict(os.environ)))
    self.pid, self._child_created = pid, True


def main() -> None:
    answer(1, ready=os.getpid())
    fork_per_request(0, 1, launch)


if __name__ == "__main__":
    main()
