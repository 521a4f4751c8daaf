"""A process that runs studies of benchmarks/ in children forked from it (tests/test_studies.py's smoke runs).

It imports what the studies share once (the harness, with torch, transformers and performer_hf; matplotlib; datasets):
in a fresh interpreter that is about 10 s of CPU per study, a fifth of a smoke run's time on average. A child forked
from it starts as a fresh process would after those imports: nothing has run in the server but the imports, and its
environment is the one it was started with.

    python tests/study_server.py BENCHMARKS_DIR

reads one request a line on stdin, ``{"argv": [script, *arguments], "cwd": ..., "log_dir": ..., "timeout_s": ...}``,
runs ``script`` as ``__main__`` with those arguments in a child of its own process group (stdout and stderr into
``log_dir/stdout.txt`` and ``stderr.txt``), and answers a line ``{"returncode": ..., "timed_out": ...}`` on stdout: the
child's exit status, or -9 when it was killed, with everything it started, after ``timeout_s``. It ends at the end of
its input.
"""

import json
import os
import runpy
import signal
import sys
import time
import traceback


def _preload(benchmarks: str) -> None:
    sys.path.insert(0, benchmarks)
    import datasets  # noqa: F401
    import harness  # noqa: F401 (torch, transformers, performer_hf)
    import matplotlib.pyplot  # noqa: F401


def _run_child(argv: list[str], cwd: str, log_dir: str) -> None:
    """In the forked child: run the script as a fresh interpreter would, then leave without returning."""
    code = 1
    try:
        os.setpgrp()  # so that a timeout ends the processes the study starts too
        os.chdir(cwd)
        for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
            log = os.open(os.path.join(log_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, fd)
            os.close(log)
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout_s: float) -> tuple[int, bool]:
    """The child's exit status (``returncode``'s convention: -N for signal N), and whether it was killed for time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), True


def main() -> None:
    _preload(sys.argv[1])
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_child(request["argv"], request["cwd"], request["log_dir"])
        returncode, timed_out = _wait(pid, request["timeout_s"])
        print(json.dumps({"returncode": returncode, "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    main()
