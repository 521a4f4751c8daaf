"""The ``performer-hf`` command line.

``performer-hf convert SOURCE OUT [options]`` converts a BERT / RoBERTa / GPT-2 checkpoint (a folder
or a Hub id) into a Performer checkpoint, and a Llama / Mistral / Qwen2 / Qwen3 / Gemma3 one into the
same class with Performer attention; ``performer-hf demo`` runs the offline demo on the real
all-MiniLM-L6-v2; ``performer-hf zoo list|build`` lists / rebuilds the model zoo; ``performer-hf push
FOLDER REPO_ID`` uploads a checkpoint folder to the Hub. Problems with the inputs end with a
one-line message and exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
from pathlib import Path

import performer_hf_cli

from .conversion import SUPPORTED_ARCHITECTURES, ConversionError, TransferSettings, convert
from .conversion.convert import DEFAULT_IN_PLACE_METHOD, DEFAULT_METHOD, FIXED_BY_SOURCE, METHODS
from .conversion.source import resolve_source
from .hub import PushError
from .modeling.attention_methods import ATTENTION_FIELDS
from .modeling.configuration_performer import PerformerConfig
from .zoo.errors import ZooError


def _config_options() -> list[tuple[str, type, str]]:
    """(field, type, help) of the PerformerConfig fields with an option of their own: every attention field but
    the method (``--method``), and the positions. The help is the field's; the defaults named are the config's and
    the converter's presets for the default method. Any other field goes through ``--set FIELD=VALUE``."""
    fields = {f.name: f for f in dataclasses.fields(PerformerConfig)}
    presets = METHODS[DEFAULT_METHOD]
    options = []
    for name in (*ATTENTION_FIELDS, "max_position_embeddings"):
        field = fields[name]
        if name == "attention_method":
            continue
        default, annotation = field.default, str(field.type)
        kind = (
            bool
            if isinstance(default, bool)
            else str
            if "str" in annotation
            else float
            if "float" in annotation
            else int
        )
        hybrid, causal = presets["bidirectional"].get(name, default), presets["causal"].get(name, default)
        in_place = METHODS[DEFAULT_IN_PLACE_METHOD]["causal"].get(name, default)
        named = [f"default {default}"] if default is not None and name in ATTENTION_FIELDS else []
        named += [f"{DEFAULT_METHOD} {hybrid}"] if hybrid != default else []
        named += [f"causal {causal}"] if causal != hybrid else []
        named += [f"{DEFAULT_IN_PLACE_METHOD} (Llama & co.) {in_place}"] if in_place != default else []
        help_text = field.metadata["help"]
        options.append((name, kind, f"{help_text} ({'; '.join(named)})" if named else help_text))
    return options


_CONFIG_OPTIONS = _config_options()


def options_text() -> str:
    """The text of ``performer_hf_cli/options.py``: what the command line's front needs to know of the package."""
    options = ",\n".join(f"    ({name!r}, {kind.__name__!r}, {text!r})" for name, kind, text in _CONFIG_OPTIONS)
    return (
        "# ruff: noqa: E501 (written by performer_hf.cli.write_options(): one line per option)\n"
        '"""What the command line\'s front (``performer_hf_cli``) knows of performer_hf without importing it. Written\n'
        'by ``performer_hf.cli.write_options()``; do not edit."""\n\n'
        f"METHODS = {tuple(sorted(METHODS))!r}\n"
        f"DEFAULT_METHOD = {DEFAULT_METHOD!r}\n"
        f"DEFAULT_IN_PLACE_METHOD = {DEFAULT_IN_PLACE_METHOD!r}\n"
        f"SUPPORTED_ARCHITECTURES = {tuple(SUPPORTED_ARCHITECTURES)!r}\n"
        "# PerformerConfig's fields (what --set takes), and those the source weights fix\n"
        f"CONFIG_FIELDS = {tuple(sorted(f.name for f in dataclasses.fields(PerformerConfig)))!r}\n"
        f"FIXED_BY_SOURCE = {tuple(sorted(FIXED_BY_SOURCE))!r}\n"
        "# (PerformerConfig field, option type, help) of each field with an option of its own\n"
        f"CONFIG_OPTIONS = [\n{options},\n]\n"
    )


def write_options() -> Path:
    """Write ``performer_hf_cli/options.py`` again (after a change to the config fields or the presets)."""
    import performer_hf_cli.options

    path = Path(performer_hf_cli.options.__file__)
    path.write_text(options_text())
    return path


def _field_value(text: str):
    """``--set`` values: JSON (numbers, true/false/null, lists) or else a plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _zoo(args: argparse.Namespace) -> None:
    from . import zoo

    if args.zoo_command == "list":
        registry = zoo.load_registry()
        for name, entry in registry.items():
            print(f"{name}\n    {entry['description']}")
        return
    print(zoo.build(args.name, args.output_dir, overwrite=args.overwrite, quick=args.quick))


def _overrides(args: argparse.Namespace) -> dict:
    overrides = {name: getattr(args, name) for name, _, _ in _CONFIG_OPTIONS if getattr(args, name) is not None}
    for item in args.fields:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConversionError(f"--set expects FIELD=VALUE, got {item!r}.")
        name = name.strip()
        if name in overrides:
            raise ConversionError(
                f"{name} is given twice, as --{name.replace('_', '-')} and as --set {name}=...: give it once."
            )
        overrides[name] = _field_value(value)
    return overrides


def _convert(args: argparse.Namespace) -> Path:
    """``performer-hf convert``: the source resolved at ``--revision``, the transfer settings, the conversion."""
    if args.transfer_text is not None and not args.transfer_steps:
        raise ConversionError("a transfer text was given without transfer steps: set --transfer-steps too.")
    transfer = None
    if args.transfer_steps:
        transfer = TransferSettings(args.transfer_steps, args.transfer_text, args.transfer_length)
    source, repo_id = resolve_source(args.source, args.revision)
    return convert(
        source,
        args.output_dir,
        overwrite=args.overwrite,
        base_model=args.base_model or repo_id,
        fidelity=args.fidelity,
        method=args.method,
        calibrate=args.calibrate,
        transfer=transfer,
        **_overrides(args),
    )


@contextlib.contextmanager
def _command_logging(quiet: bool):
    """While a command runs: the package's log records on stdout as plain lines (INFO, or WARNING with ``-q``) and
    no progress bars from transformers. What it changes is put back after, so that ``main`` called in a running
    process (a notebook, a test) leaves that process's logging as it was."""
    from transformers.utils import logging as hf_logging

    package_logger = logging.getLogger("performer_hf")
    before = package_logger.handlers[:], package_logger.level, package_logger.propagate
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    package_logger.handlers[:] = [handler]
    package_logger.setLevel(logging.WARNING if quiet else logging.INFO)
    package_logger.propagate = False
    try:
        yield
    finally:
        package_logger.handlers[:], package_logger.propagate = before[0], before[2]
        package_logger.setLevel(before[1])
        if bars:
            hf_logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """The ``performer-hf`` command line (the console script runs ``performer_hf_cli.main``, which parses and checks
    it before importing this package); returns the exit status."""
    return performer_hf_cli.main(argv)


def run(args: argparse.Namespace) -> int:
    """Run a parsed command line (``performer_hf_cli.parser()``); returns the exit status."""
    with _command_logging(getattr(args, "quiet", False)):
        try:
            _dispatch(args)
        except (ConversionError, ZooError, PushError) as error:
            print(f"performer-hf: error: {error}", file=sys.stderr)
            return 1
    return 0


def _dispatch(args: argparse.Namespace) -> None:
    """Run the command ``args`` names, printing its result."""
    if args.command == "convert":
        print(_convert(args))
    elif args.command == "zoo":
        _zoo(args)
    elif args.command == "push":
        from .hub import push_to_hub

        commit = push_to_hub(
            args.folder,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.message,
            create_pr=args.create_pr,
        )
        print(commit.commit_url)
    else:
        from .conversion.demo import format_demo, run_demo

        result = run_demo(
            args.output_dir,
            length=args.length,
            num_sentences=args.sentences,
            repeats=args.repeats,
            overwrite=args.overwrite,
            method=args.method,
        )
        print(format_demo(result))


if __name__ == "__main__":
    sys.exit(main())
