"""A JSON-lines tracker for ``accelerator.log`` (``--report_to json``), and tracker selection."""

from __future__ import annotations

import json
import os

from accelerate.tracking import GeneralTracker

from .arguments import LOG_FILE, REPORT_TO_JSON


class JSONLinesTracker(GeneralTracker):
    """Appends one JSON object per ``log`` call to ``<logging_dir>/train_log.jsonl``.

    The first line written by a run holds its configuration (``{"config": {...}}``); later lines are
    ``{"step": N, ...values}``. A resumed run appends to the same file.
    """

    name = REPORT_TO_JSON
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs):
        super().__init__()
        self.run_name = run_name
        self.path = os.path.join(logging_dir, LOG_FILE)
        os.makedirs(logging_dir, exist_ok=True)

    @property
    def tracker(self):
        return self.path

    def _append(self, record: dict) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record, default=str) + "\n")

    def store_init_configuration(self, values: dict):
        self._append({"config": values})

    def log(self, values: dict, step: int | None = None, **kwargs):
        self._append({"step": step, **values})


def select_trackers(report_to: str, output_dir: str) -> list:
    """``log_with`` for ``Accelerator``: the JSON tracker object for 'json', names for the others."""
    names = [name.strip() for name in report_to.split(",") if name.strip()]
    trackers = []
    for name in names:
        if name in (REPORT_TO_JSON, "all"):
            trackers.append(JSONLinesTracker("train", output_dir))
        if name != REPORT_TO_JSON:
            trackers.append(name)
    return trackers


def read_log(output_dir: str) -> list[dict]:
    """The records of ``<output_dir>/train_log.jsonl`` (configuration lines excluded)."""
    with open(os.path.join(output_dir, LOG_FILE)) as handle:
        return [record for record in map(json.loads, handle) if "config" not in record]
