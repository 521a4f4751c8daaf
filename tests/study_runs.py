"""The ``--quick`` smoke runs of benchmarks/ that tests/test_studies.py checks, started in the background when the
session starts (tests/conftest.py), so that they run on the core the rest of the suite leaves idle.

Most of the suite is one thread of Python: over a whole run it kept 1.3 of the 2 cores busy, and the smoke runs,
started when their tests were reached, added about 6 minutes of their own at the end. Here they run two at a time,
each a fresh process on one thread at a lower priority (``nice``), so that the tests keep both cores when they use
them; by the time their tests are reached most have ended, and a test waits for the rest.
"""

import concurrent.futures
import os
import shutil
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
NOT_STUDIES = {
    "harness": "what the studies share",
    "passkey": "the pass-key task of the retrieval studies",
    # its report is tested in tests/test_studies.py
    "kvpress_anchor": "runs in an environment of its own (kvpress 0.5.5 needs transformers < 5.3)",
}
STUDIES = sorted(path.stem for path in BENCHMARKS.glob("*.py") if path.stem not in NOT_STUDIES)
# the longest smoke runs (about 45 to 120 s each on one thread), started first so that the last ones end together
LONGEST = ("llm_linearization", "model_speed", "long_context_retrieval", "long_documents", "long_context")
TIMEOUT_S = 900  # a smoke run that has not ended by then hangs
FIXTURE = "quick_runs"  # the fixture of tests/test_studies.py whose tests take these runs


def selected_studies(items) -> set[str]:
    """The studies whose smoke test the session runs (none under ``-m "not studies"`` or another file alone)."""
    return {item.callspec.params["study"] for item in items if FIXTURE in item.fixturenames}


class QuickRuns:
    """The studies' smoke runs, two at a time from construction, the longest first: ``runs[study]`` is (the future
    of its completed process, its output folder). ``close()`` cancels the runs not started and ends those running,
    so that a session stopped early (``-x``, Ctrl-C) does not wait for them."""

    def __init__(self, studies: set[str], make_dir):
        order = [study for study in LONGEST if study in studies] + sorted(studies - set(LONGEST))
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="study")
        self._running: set[subprocess.Popen] = set()
        self._closed = False
        self.runs = {}
        for study in order:
            out_dir = make_dir(study)
            self.runs[study] = self._pool.submit(self._run_quick, study, out_dir), out_dir

    def _run_quick(self, study: str, out_dir: Path) -> subprocess.CompletedProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []
        command = [*nice, sys.executable, str(BENCHMARKS / f"{study}.py"), "--quick", "--out-dir", str(out_dir)]
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=out_dir
        ) as process:
            self._running.add(process)
            if self._closed:  # close() came as this run started
                process.kill()
            try:
                stdout, stderr = process.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, stderr = process.communicate()
                stderr += f"\n(killed after {TIMEOUT_S} s: {study} --quick hung)"
            finally:
                self._running.discard(process)
        return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)

    def close(self):
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for process in list(self._running):
            process.kill()
        self._pool.shutdown(wait=True)
