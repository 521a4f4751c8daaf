"""The harness every study in ``benchmarks/`` runs on: shared flags, one environment record, one
peak-memory probe, fresh-process children and the JSON / Markdown / PNG writers.

A study is a script ``benchmarks/<name>.py`` whose ``main`` hands :func:`main` four things:

    arguments  ``harness.parser(__doc__, quick=..., threads=...)`` plus the study's own flags
    measure    ``measure(args) -> dict``: runs the study and returns the JSON payload
    markdown   ``markdown(payload) -> str``: the Markdown summary, from the payload alone
    plot       ``plot(payload) -> Figure``: the figure, from the payload alone (drawn with :func:`pyplot`)

:func:`main` sets the run up (logging to stderr, torch threads, no Hub downloads), records the machine
and the load average around ``measure``, writes ``<out-dir>/<name>.json``, ``.md`` and ``.png`` (the
figure laid out tight, at ``DPI``) and prints the Markdown to stdout. Since the summary and the figure
depend on the payload only, ``--from-json`` writes them again from an earlier JSON, measuring nothing.

Shared flags (``python benchmarks/<name>.py --help`` lists each study's own):

    --quick       a small configuration that runs in a minute or two: a smoke test, its figures say nothing. It
                  sets the study's ``quick_flags`` (``parser``) as their defaults: a flag given with it wins
    --out-dir     where the three files go (default ``benchmarks/results/``, where the committed results are; a
                  ``--quick`` run without it writes to a new temporary folder, which it logs, so that its smoke figures
                  replace no committed result)
    --threads     torch threads, 0 for torch's default (only the studies that take it; their defaults differ,
                  $OMP_NUM_THREADS over them where it is set)
    --from-json   write the Markdown and the PNG again from this JSON (no measurement)

Bad flags end at once with a usage error, before any measurement: counts below their least (:func:`at_least`, the
``type=`` of the studies' count flags), an ``--out-dir`` that a file stands in the way of, a ``--from-json`` that is no
JSON object, or not the study's.

A study may call :func:`checkpoint` with its payload so far (``model_speed.py`` does, after each configuration): the
JSON and the Markdown are then written, marked partial, during the run, and a run stopped before its end (a time
limit around it, the OOM killer) leaves what it measured; the finished run's files replace them.

Every JSON holds ``environment``: ``{"machine": {...}, "load_average": {"before": [...], "after": [...]}}``,
the machine as :func:`_machine` describes it and the 1-, 5- and 15-minute load averages when ``measure``
starts and ends. Timings depend on what else runs on the machine: compare runs with the load in view.

Peak memory, one probe for every study (:class:`PeakMemory`): the extra resident memory a block needed
at its peak, ``VmHWM - VmRSS`` read at the block's start, after resetting the kernel's resident-set
high-water mark (``echo 5 > /proc/self/clear_refs``) there. It counts what the block allocated and
touched (activations, saved tensors, gradients, the allocator's scratch), not what was resident before
it. Memory that earlier work freed but the heap kept resident would hide part of the block's peak (the block reuses
it without the resident set growing): run the probe in a fresh process (:func:`in_fresh_process`), or give that
memory back to the system first (``PeakMemory(release_freed=True)``: glibc's ``malloc_trim``, after which pages the
block touches count again, measured on the whole-model steps of ``model_speed.py``). Where ``clear_refs`` is
unavailable the probe falls back to the growth of ``ru_maxrss`` over the block, which can only under-report, and says
so in ``method``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from performer_hf.cpu_memory import retain_freed_memory
from performer_hf_cli import at_least  # also the studies' count flags (harness.at_least)

RESULTS = Path(__file__).resolve().parent / "results"
DPI = 120
PACKAGES = ("performer-hf", "transformers", "performer-pytorch")  # versions recorded with the machine
FRESH_PROCESS = "--fresh-process"  # first argument of a child started by in_fresh_process
RESULT_MARK = "RESULT"  # precedes the child's JSON answer on its stdout
ALLOCATORS = {False: "the system's (glibc defaults)", True: "glibc, freed memory retained (performer_hf.cpu_memory)"}
PARTIAL_NOTE = "**Partial results**: the run stopped before its end; these are its last checkpoint's."
logger = logging.getLogger("benchmarks.harness")
# the study main() is measuring: name, out_dir, markdown, load_before, allocator (:func:`checkpoint`)
_measuring: dict = {}


def output_folder(text: str) -> Path:
    """The ``type=`` of ``--out-dir``: a folder, existing or not, that no file stands in the way of (found only when
    the results are written, the mistake would lose the measurement)."""
    path = Path(text)
    existing = next(folder for folder in (path, *path.parents) if folder.exists())  # "." or "/" at the latest
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{existing} is a file, not a folder: give --out-dir a folder (new or not)")
    return path


def _quick_help(quick: str, quick_flags: dict) -> str:
    """``--quick``'s help: what it runs, and the flags it sets unless given."""
    flags = " ".join(
        f"--{dest.replace('_', '-')} {' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}"
        for dest, value in quick_flags.items()
    )
    sets = f"; it sets {flags} where they are not given (a flag given wins)" if flags else ""
    return f"smoke test, its figures say nothing: {quick}{sets}"


def parser(
    doc: str, *, quick: str, quick_flags: dict | None = None, threads: int | None = None
) -> argparse.ArgumentParser:
    """An argument parser showing the study's docstring, with the shared flags.

    ``quick`` says what ``--quick`` runs; ``quick_flags`` are the study's flags it sets, by destination (``{"steps":
    16}``): the defaults of a ``--quick`` run, so that a flag given on the command line wins over them. ``threads``
    is the default of ``--threads`` (``None``: the study takes no ``--threads``).
    """
    quick_flags = quick_flags or {}
    arguments = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments.set_defaults(quick_flags=quick_flags)  # read, and taken out, by main()
    arguments.add_argument("--quick", action="store_true", help=_quick_help(quick, quick_flags))
    arguments.add_argument(
        "--out-dir",
        type=output_folder,
        help="where the JSON, Markdown and PNG go; default benchmarks/results/ (the committed results), under --quick "
        "a new temporary folder (logged)",
    )
    if threads is not None:
        arguments.add_argument(
            "--threads",
            type=at_least(0),
            default=int(os.environ.get("OMP_NUM_THREADS") or threads),
            help="torch threads, 0 for torch's default; default $OMP_NUM_THREADS where it is set, else %(default)s "
            "(on a shared CPU, more threads than free cores can make every step ~10x slower)",
        )
    arguments.add_argument("--from-json", type=Path, help="write the Markdown and PNG again from this JSON")
    arguments.add_argument(
        "--retain-freed-memory",
        action="store_true",
        help="keep freed memory in the process for reuse (performer_hf.cpu_memory), for every arm alike",
    )
    return arguments


# ---- the machine and its load -------------------------------------------------------------------


def _machine() -> dict:
    """This machine and its software: platform, CPU, cores, Python, torch and its threads, package versions."""
    import torch

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    with contextlib.suppress(OSError, AttributeError):
        info["cpu"] = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1)
    for package in PACKAGES:
        with contextlib.suppress(PackageNotFoundError):
            info[package] = version(package)
    return info


def _load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages now."""
    return [round(x, 2) for x in os.getloadavg()]


def environment(payload: dict) -> dict:
    """The payload's ``environment`` record.

    Results written before the harness (the committed ones) kept the machine and the load average in
    fields of their own; the record is read from there (threads, and the load where it was kept).
    """
    if "environment" in payload:
        return payload["environment"]
    settings = payload.get("settings", {})
    machine_info = dict(payload["machine"]) if isinstance(payload.get("machine"), dict) else {}
    if "threads" in machine_info:  # decode.py
        machine_info["torch_threads"] = machine_info.pop("threads")
    before, after = payload.get("load_average_start"), payload.get("load_average_end")  # speed.py
    if "load_average_before" in payload:  # compat_*.py
        before, after = payload["load_average_before"], payload.get("load_average_after")
    if "load_average" in payload:  # approximation_quality.py: the three figures before, then the three after
        before, after = payload["load_average"][:3], payload["load_average"][3:]
    if "load_average" in settings:  # decode.py, long_context.py: the 1-minute figure
        before, after = [settings["load_average"]["start"]], [settings["load_average"]["end"]]
    return {"machine": machine_info, "load_average": {"before": before, "after": after}}


# ---- peak memory ----------------------------------------------------------------------------------


def _status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    return 1024 * int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def _max_resident_bytes() -> int:
    """The process's lifetime peak resident set (``ru_maxrss``: kilobytes on Linux, bytes on macOS)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def release_freed_memory() -> bool:
    """Give the free memory of every heap arena back to the system (glibc ``malloc_trim(0)``), so that a block's
    reuse of it counts in its resident set again. False where the C library has no ``malloc_trim`` (not glibc)."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


class PeakMemory:
    """Context manager: the extra resident memory a block needed at its peak (the module docstring says how).

    ``release_freed``: first give the heap's free memory back to the system (:func:`release_freed_memory`), so that
    none of the block's peak hides in what earlier work freed.

    After the block: ``before`` (resident bytes at its start), ``peak`` (the high-water mark during it),
    ``extra = peak - before`` and ``method`` (the probe that ran).
    """

    def __init__(self, release_freed: bool = False):
        self.release_freed = release_freed

    def __enter__(self) -> PeakMemory:
        released = self.release_freed and release_freed_memory()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
        except OSError:
            self.method = "ru_maxrss delta (clear_refs unavailable)"
            self.before = _max_resident_bytes()
        else:
            self.method = "VmHWM after clear_refs"
            self.before = _status_bytes("VmRSS")
        if released:
            self.method += ", freed heap memory released first (malloc_trim)"
        return self

    def __exit__(self, *exc_info) -> None:
        self.peak = _status_bytes("VmHWM") if self.method.startswith("VmHWM") else _max_resident_bytes()
        self.extra = self.peak - self.before


def in_fresh_process(script: str, *, memory_cap_gb: float | None = None, env: dict | None = None, **kwargs) -> dict:
    """The study's ``child(**kwargs)`` (``script``: its ``__file__``) run in a new Python process: its answer,
    or ``{"ok": False, "error": ...}`` when the process ended without one.

    ``memory_cap_gb`` caps the child's address space, so that an allocation beyond it fails inside the child
    (which may catch it) instead of waking the machine's OOM killer; ``env`` is added to the environment.
    """
    request = json.dumps({"memory_cap_gb": memory_cap_gb, "kwargs": kwargs})
    done = subprocess.run(
        [sys.executable, script, FRESH_PROCESS, request],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if RESULT_MARK not in done.stdout:
        return {"ok": False, "error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
    return json.loads(done.stdout.split(RESULT_MARK, 1)[1].splitlines()[0])


def reset_accelerate() -> None:
    """After a training run in this process (``performer_hf.training``'s functions): Accelerate's process-wide state
    cleared, so that the next run builds its own ``Accelerator``."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _answer_parent(child: Callable[..., dict], request: str) -> None:
    """The child's side of :func:`in_fresh_process`: apply the cap, run ``child``, print its answer."""
    request = json.loads(request)
    if request["memory_cap_gb"]:
        cap = int(request["memory_cap_gb"] * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    print(RESULT_MARK + json.dumps(child(**request["kwargs"])), flush=True)


# ---- writing the results --------------------------------------------------------------------------


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend: the studies draw, :func:`main` saves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file renamed over it."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _write(
    name: str, payload: dict, out_dir: Path, markdown: Callable, plot: Callable | None, *, with_json: bool
) -> str:
    """Write ``<out_dir>/<name>.json`` (if ``with_json``), ``.md`` and ``.png`` (if ``plot``); returns the Markdown.

    The Markdown and the figure see the payload as the JSON holds it (dictionary keys are strings), whether
    it was just measured or read back with ``--from-json``. A partial payload's Markdown says so under its title.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.{ext}" for ext in ("json", "md", "png")]
    serialized = json.dumps(payload, indent=2, default=str) + "\n"
    if with_json:
        _replace_text(paths[0], serialized)
    payload = json.loads(serialized)
    text = markdown(payload)
    if payload.get("partial"):
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{PARTIAL_NOTE}\n{rest}"
    _replace_text(paths[1], text)
    if plot is None:
        return text
    figure = plot(payload)
    figure.tight_layout()
    figure.savefig(paths[2], dpi=DPI)
    pyplot().close(figure)
    logger.info("wrote %s", ", ".join(str(path) for path in paths[not with_json :]))
    return text


def _environment(load_before: list[float], allocator: str) -> dict:
    return {
        "machine": _machine(),
        "load_average": {"before": load_before, "after": _load_average()},
        "allocator": allocator,
    }


def checkpoint(payload: dict) -> None:
    """Write the payload a study has measured so far as its JSON and Markdown, marked ``"partial": true`` (the
    environment as it stands), so that a run stopped later leaves them; an earlier run's figure is removed
    (``--from-json`` draws the partial one). Nothing outside :func:`main`'s measurement."""
    if not _measuring:
        return
    study = _measuring
    (study["out_dir"] / f"{study['name']}.png").unlink(missing_ok=True)
    partial = {**payload, "environment": _environment(study["load_before"], study["allocator"]), "partial": True}
    _write(study["name"], partial, study["out_dir"], study["markdown"], None, with_json=True)


def main(
    name: str,
    arguments: argparse.ArgumentParser,
    measure: Callable[[argparse.Namespace], dict],
    markdown: Callable[[dict], str],
    plot: Callable,
    *,
    child: Callable[..., dict] | None = None,
    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None,
    argv: list[str] | None = None,
) -> dict:
    """Run the study ``name`` on the command line ``argv`` (default ``sys.argv[1:]``); returns its payload.

    ``child`` is the study's function for :func:`in_fresh_process`, when it has one. ``check(arguments, args)`` checks
    the study's flags together before it measures (not under ``--from-json``), ending a combination that cannot run
    with ``arguments.error``; it may fill in defaults that depend on other flags.
    """
    argv = sys.argv[1:] if argv is None else argv
    if child is not None and argv[:1] == [FRESH_PROCESS]:
        _answer_parent(child, argv[1])
        return {}
    args = _parse(arguments, argv)
    from_json = vars(args).pop("from_json")  # not a setting of the study
    earlier = None if from_json is None else _earlier_payload(arguments, from_json)
    if earlier is None and check is not None:
        check(arguments, args)
    retained = vars(args).pop("retain_freed_memory") and retain_freed_memory()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.out_dir is None:
        args.out_dir = _default_out_dir(name, args.quick)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the studies read installed models and data only
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)
    if earlier is not None:
        try:
            print(_write(name, earlier, args.out_dir, markdown, plot, with_json=False))
        except KeyError as missing:
            arguments.error(f"--from-json {from_json}: not {name}'s JSON (no {missing} in it); give its {name}.json")
        return earlier
    before = _load_average()
    _measuring.update(
        name=name, out_dir=args.out_dir, markdown=markdown, load_before=before, allocator=ALLOCATORS[retained]
    )
    try:
        payload = measure(args)
    finally:
        _measuring.clear()
    payload["environment"] = _environment(before, ALLOCATORS[retained])
    print(_write(name, payload, args.out_dir, markdown, plot, with_json=True))
    return payload


def _parse(arguments: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command line; under ``--quick`` the study's quick flags stand in for the defaults (argparse sets a default
    only where the namespace it fills has no value), so that a flag given wins."""
    args = arguments.parse_args(argv)
    if args.quick:
        unknown = sorted(set(args.quick_flags) - set(vars(args)))
        if unknown:
            raise ValueError(f"the study's quick flags {unknown} are none of its flags: correct its parser()")
        args = arguments.parse_args(argv, namespace=argparse.Namespace(**args.quick_flags))
    del args.quick_flags
    return args


def _default_out_dir(name: str, quick: bool) -> Path:
    """Where a run without ``--out-dir`` writes: the committed results (:data:`RESULTS`), or for a ``--quick`` run a new
    temporary folder, logged (a smoke run replaced the committed JSON, Markdown and figure with its figures)."""
    if not quick:
        return RESULTS
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-quick-"))
    logger.info("--quick without --out-dir: writing to %s (the committed results stay as they are)", folder)
    return folder


def _earlier_payload(arguments: argparse.ArgumentParser, path: Path) -> dict:
    """``--from-json``'s payload; a usage error naming the file where it cannot be read or holds no JSON object."""
    try:
        payload = json.loads(path.read_text())
    except OSError as error:
        arguments.error(f"--from-json {path}: {error.strerror or error}; give the JSON of an earlier run")
    except ValueError as error:
        arguments.error(f"--from-json {path}: not JSON ({error}); give the JSON of an earlier run")
    if not isinstance(payload, dict):
        arguments.error(f"--from-json {path}: holds a JSON {type(payload).__name__}, not a study's JSON object")
    return payload
