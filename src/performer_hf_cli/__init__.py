"""The front of the ``performer-hf`` command line: it parses the command line and checks what it can without torch or
transformers, whose import takes seconds, so that a mistyped command ends at once with one line; then
``performer_hf.cli.run`` does the work. A package of its own because importing ``performer_hf`` registers the
model classes, which imports both.

The options that mirror ``PerformerConfig`` fields come from :mod:`.options`, written by
``performer_hf.cli.write_options()`` (``tests/test_cli.py`` checks that it matches the package).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .options import (
    CONFIG_FIELDS,
    CONFIG_OPTIONS,
    DEFAULT_IN_PLACE_METHOD,
    DEFAULT_METHOD,
    FIXED_BY_SOURCE,
    METHODS,
    SUPPORTED_ARCHITECTURES,
)

_KINDS = {"bool": bool, "int": int, "float": float, "str": str}
_DEMO_METHODS = ("favor", "hybrid")  # the methods of an encoder, which the demo converts (not the causal-only sparse)


class _OneLineErrors(argparse.ArgumentParser):
    """Bad command-line input ends with one line that names it and where the options are listed, not the usage
    block (exit status 2, as argparse's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def at_least(minimum: int):
    """The ``type=`` of a count option (here and in ``benchmarks/``): a whole number of at least ``minimum``, else a
    usage error that says so."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {value}")
        return value

    return whole_number


def parser() -> argparse.ArgumentParser:
    """The command line of ``performer-hf`` (``convert``, ``demo``, ``zoo``, ``push``)."""
    command_line = _OneLineErrors(prog="performer-hf", description="Performers (FAVOR+) for Hugging Face models.")
    commands = command_line.add_subparsers(dest="command", required=True, parser_class=_OneLineErrors)

    conv = commands.add_parser(
        "convert",
        help="convert a BERT / RoBERTa / GPT-2 checkpoint into a Performer, or give a Llama / Mistral / Qwen2 / "
        "Qwen3 / Gemma3 one Performer attention",
        description=f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}.",
    )
    conv.add_argument("source", help="checkpoint folder or Hub id")
    conv.add_argument("output_dir", help="folder to write (must be empty or absent, unless --overwrite)")
    for name, kind_name, text in CONFIG_OPTIONS:
        kind = _KINDS[kind_name]
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
    demo.add_argument(
        "--length",
        type=at_least(2),
        default=8192,
        help="tokens for the speed / memory comparison (at least 2: [CLS] and [SEP])",
    )
    demo.add_argument(
        "--sentences",
        type=at_least(3),
        default=200,
        help="English sentences for the embedding comparison (at least 3: the pairwise-similarity Spearman's least)",
    )
    demo.add_argument("--repeats", type=at_least(1), default=3, help="timed forward passes per model")
    demo.add_argument(
        "--method",
        choices=_DEMO_METHODS,
        help=f"attention method of the conversion (default: {DEFAULT_METHOD})",
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
    return command_line


def output_replaces_source(output_dir: Path, source: Path) -> str | None:
    """Why writing ``output_dir`` would replace the ``source`` folder (it is the source, or holds it: a conversion
    replaces its output folder whole, even with ``--overwrite``), as one line; None where it would not."""
    if not source.is_dir():
        return None
    source, output = source.resolve(), output_dir.expanduser().resolve()
    if output != source and output not in source.parents:
        return None
    return (
        f"output folder {output_dir} {'is' if output == source else 'holds'} the source {source}: writing it would "
        f"replace the source. Choose another output folder, e.g. {source}-performer."
    )


def in_place_of_link(output_dir: Path) -> Path:
    """The folder a symbolic link ``output_dir`` names (a link to a larger disk: written there, the link kept), or
    ``output_dir`` itself."""
    return output_dir.resolve() if output_dir.is_symlink() else output_dir


def staging_prefix(output_dir: Path) -> str:
    """How the names of the staging folders a conversion to ``output_dir`` writes in begin (named after the folder a
    symbolic link names: the conversion writes there)."""
    return f".{in_place_of_link(output_dir).name}.tmp-"


def output_entries(output_dir: Path) -> list[Path]:
    """The entries of the folder ``output_dir``, less the staging folders of conversions to it (inside it for a mount
    point: one left by a killed run does not make the volume look taken; the next conversion deletes it)."""
    return [entry for entry in output_dir.iterdir() if not entry.name.startswith(staging_prefix(output_dir))]


def precheck(args: argparse.Namespace) -> str | None:
    """A problem with the command line that shows without loading anything (a missing folder, a folder in the way, an
    option that needs another), as the one line to print; None when there is none to see here."""
    if args.command == "convert":
        output_dir = Path(args.output_dir)
        if output_dir.exists() and not output_dir.is_dir():
            return f"output {output_dir} exists and is not a folder."
        if replaced := output_replaces_source(output_dir, Path(args.source).expanduser()):
            return replaced
        if output_dir.is_dir() and output_entries(output_dir) and not args.overwrite:
            return f"output folder {output_dir} exists and is not empty; pass --overwrite to replace it."
        if args.transfer_text is not None and not args.transfer_steps:
            return "a transfer text was given without transfer steps: set --transfer-steps too."
        bad_sets = [item for item in args.fields if "=" not in item]
        if bad_sets:
            return f"--set expects FIELD=VALUE, got {bad_sets[0]!r}."
        names = {item.partition("=")[0].strip() for item in args.fields}
        unknown, fixed = sorted(names - set(CONFIG_FIELDS)), sorted(names & set(FIXED_BY_SOURCE))
        if unknown:
            settable = sorted(set(CONFIG_FIELDS) - set(FIXED_BY_SOURCE))
            return f"unknown PerformerConfig field(s) {unknown}; choose from {settable}."
        if fixed:
            return f"{fixed} are fixed by the source weights and cannot be overridden."
        source = Path(args.source).expanduser()
        if args.revision is not None and source.is_dir():
            return (
                f"source {args.source} is a local folder: "
                "--revision applies to Hub ids; check out that revision in the folder, or pass the Hub id."
            )
        looks_like_a_path = args.source.startswith((".", "/", "~")) or args.source.count("/") > 1
        if looks_like_a_path and not source.exists():
            return f"source {args.source!r} is neither an existing folder nor a valid Hub id."
    if args.command == "push":
        folder = Path(args.folder)
        if not folder.is_dir():
            return f"{folder} is not a folder; pass the folder a Performer checkpoint was saved to."
        if not (folder / "config.json").is_file():
            return f"{folder} has no config.json; save the model with save_pretrained first."
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``performer-hf`` console script; returns the exit status."""
    args = parser().parse_args(argv)
    problem = precheck(args)
    if problem is not None:
        print(f"performer-hf: error: {problem}", file=sys.stderr)
        return 1
    from performer_hf.cli import run

    return run(args)
