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
import dataclasses
import json
import logging
import sys
from pathlib import Path

from .conversion import SUPPORTED_ARCHITECTURES, ConversionError, TransferSettings, convert
from .conversion.convert import DEFAULT_IN_PLACE_METHOD, DEFAULT_METHOD, METHODS
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


def _field_value(text: str):
    """``--set`` values: JSON (numbers, true/false/null, lists) or else a plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class _OneLineErrors(argparse.ArgumentParser):
    """Bad command-line input ends with one line that names it and where the options are listed, not the usage
    block (exit status 2, as argparse's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(prog="performer-hf", description="Performers (FAVOR+) for Hugging Face models.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineErrors)

    conv = commands.add_parser(
        "convert",
        help="convert a BERT / RoBERTa / GPT-2 checkpoint into a Performer, or give a Llama / Mistral / Qwen2 / "
        "Qwen3 / Gemma3 one Performer attention",
        description=f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}.",
    )
    conv.add_argument("source", help="checkpoint folder or Hub id")
    conv.add_argument("output_dir", help="folder to write (must be empty or absent, unless --overwrite)")
    for name, kind, text in _CONFIG_OPTIONS:
        flags = ["--" + name.replace("_", "-")] + (["--far-field"] if name == "attention_kernel" else [])
        if kind is bool:
            conv.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            conv.add_argument(*flags, dest=name, type=kind, default=None, help=text)
    conv.add_argument(
        "--method",
        choices=sorted(METHODS),
        default=None,
        help=f"attention settings under the options: {' or '.join(sorted(METHODS))} (default {DEFAULT_METHOD}; "
        f"{DEFAULT_IN_PLACE_METHOD} for the decoders converted in place)",
    )
    conv.add_argument(
        "--calibrate", action="store_true", help="fix centres / FAVOR++ A per layer and head from sample text"
    )
    conv.add_argument(
        "--transfer-steps",
        type=int,
        default=0,
        help="Llama & co.: train the attention's feature maps for N steps to match the source's "
        "attention on unlabelled text (default 0: none)",
    )
    conv.add_argument(
        "--transfer-text",
        metavar="FILE",
        help="UTF-8 text for --transfer-steps (default: the Python standard library's docstrings)",
    )
    conv.add_argument("--transfer-length", type=int, default=1024, help="tokens per transfer step (default 1024)")
    conv.add_argument(
        "--set",
        dest="fields",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any other PerformerConfig field, e.g. --set hidden_dropout_prob=0.0",
    )
    conv.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder after success")
    conv.add_argument("--base-model", help="Hub id named in the model card (default: the source's)")
    conv.add_argument("--revision", help="Hub revision of the source")
    conv.add_argument("--no-fidelity", dest="fidelity", action="store_false", help="skip the fidelity report")
    conv.add_argument("-q", "--quiet", action="store_true", help="print only the output folder")

    demo = commands.add_parser("demo", help="convert the real all-MiniLM-L6-v2 and compare it with the source at 8K")
    demo.add_argument("--output-dir", help="keep the converted checkpoint here (default: a temporary folder)")
    demo.add_argument("--overwrite", action="store_true", help="replace a non-empty --output-dir")
    demo.add_argument("--length", type=int, default=8192, help="tokens for the speed / memory comparison")
    demo.add_argument("--sentences", type=int, default=200, help="English sentences for the embedding comparison")
    demo.add_argument("--repeats", type=int, default=3, help="timed forward passes per model")
    demo.add_argument(
        "--method",
        choices=sorted(METHODS),
        help=f"attention method of the conversion (default: {DEFAULT_METHOD}; {DEFAULT_IN_PLACE_METHOD} for the "
        "decoders converted in place)",
    )

    zoo = commands.add_parser("zoo", help="list or build the models of the performer-hf zoo")
    zoo_commands = zoo.add_subparsers(dest="zoo_command", required=True)
    zoo_commands.add_parser("list", help="the zoo's models and what each recipe does")
    zoo_build = zoo_commands.add_parser("build", help="run a model's recipe end to end: convert, finetune, evaluate")
    zoo_build.add_argument("name", help="a model of `performer-hf zoo list`")
    zoo_build.add_argument("output_dir", help="folder to write (must be empty or absent, unless --overwrite)")
    zoo_build.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder after success")
    zoo_build.add_argument("--quick", action="store_true", help="tiny budget: a smoke test in seconds")
    zoo_build.add_argument("-q", "--quiet", action="store_true", help="print only the output folder and warnings")

    push = commands.add_parser("push", help="upload a Performer checkpoint folder to the Hub in one commit")
    push.add_argument("folder", help="a folder written by save_pretrained, convert, the training scripts or zoo build")
    push.add_argument("repo_id", help="Hub repository, e.g. my-org/performer-minilm-l6")
    push.add_argument("--private", action="store_true", default=None, help="create the repository as private")
    push.add_argument("--revision", help="branch to commit to (default: main)")
    push.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    push.add_argument("--message", default="Upload Performer checkpoint", help="commit message")
    return parser


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
        overrides[name.strip()] = _field_value(value)
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


def _setup_logging(quiet: bool) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    package_logger = logging.getLogger("performer_hf")
    package_logger.handlers[:] = [handler]
    package_logger.setLevel(logging.WARNING if quiet else logging.INFO)
    package_logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``performer-hf`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    _setup_logging(getattr(args, "quiet", False))
    try:
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
    except (ConversionError, ZooError, PushError) as error:
        print(f"performer-hf: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
