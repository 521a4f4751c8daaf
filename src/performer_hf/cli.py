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
import json
import logging
import sys

from .conversion import SUPPORTED_ARCHITECTURES, ConversionError, convert
from .conversion.convert import DEFAULT_METHOD, METHODS
from .hub import PushError
from .modeling.configuration_performer import PerformerConfig
from .zoo.errors import ZooError

_HYBRID = METHODS[DEFAULT_METHOD]["bidirectional"]
_HYBRID_CAUSAL = METHODS[DEFAULT_METHOD]["causal"]
# PerformerConfig fields with their own option; any other field goes through --set FIELD=VALUE. The defaults
# named in the help are the PerformerConfig defaults and the converter's default method's presets.
_CONFIG_OPTIONS = (
    ("attention_kernel", str, "FAVOR+ kernel, hybrid far field (softmax_opt = FAVOR++, taylor2, poly2) or exact"),
    ("nb_features", int, f"random features per head (default {PerformerConfig.nb_features})"),
    ("feature_coupling", str, f"orthogonal, simplex or iid (default {PerformerConfig.feature_coupling})"),
    ("feature_row_norms", str, f"chi (unbiased) or sqrt_d (default {PerformerConfig.feature_row_norms})"),
    ("projection_seed", int, f"seed of the random features (default {PerformerConfig.projection_seed})"),
    ("feature_redraw_interval", int, "optimizer steps between feature redraws in training (default: never)"),
    ("causal_chunk_size", int, "positions per chunk of the causal scan"),
    ("max_position_embeddings", int, "tokens the model reads; the pretrained position table is tiled to fill it"),
    ("local_window", int, f"hybrid: keys around each query computed exactly (default {_HYBRID['local_window']}; "
                          f"causal {_HYBRID_CAUSAL['local_window']}; 0: none)"),
    ("num_global_tokens", int, f"hybrid: first tokens attended exactly by every query "
                               f"(default {_HYBRID['num_global_tokens']})"),
    ("routed_blocks", int, f"hybrid, bidirectional: key blocks per query block chosen by content "
                           f"(default {_HYBRID['routed_blocks']})"),
    ("route_block_size", int, f"hybrid: keys per routed block (default {_HYBRID['route_block_size']})"),
    ("route_group_size", int, f"hybrid: key blocks per routing group, scored together first "
                              f"(default {_HYBRID['route_group_size']}; 0: score every block)"),
    ("query_block_size", int, f"hybrid: queries per routing block (default {_HYBRID['query_block_size']})"),
    ("far_field_parameter", float, "FAVOR++'s A for --attention-kernel softmax_opt (default: closed form)"),
    ("exact_max_length", int, f"bidirectional: inputs of at most this many tokens keep exact attention "
                              f"(default {_HYBRID['exact_max_length']}); causal: the first this many positions "
                              f"attend exactly (default {_HYBRID_CAUSAL['exact_max_length']}); 0: never"),
)  # fmt: skip


def _field_value(text: str):
    """``--set`` values: JSON (numbers, true/false/null, lists) or else a plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="performer-hf", description="Performers (FAVOR+) for Hugging Face models.")
    commands = parser.add_subparsers(dest="command", required=True)

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
        conv.add_argument(*flags, dest=name, type=kind, default=None, help=text)
    conv.add_argument("--center-features", action=argparse.BooleanOptionalAction, default=None,
                      help="hybrid: centre queries and keys before the far field (default: on)")  # fmt: skip
    conv.add_argument("--method", choices=sorted(METHODS), default=None,
                      help=f"attention settings under the options: {' or '.join(sorted(METHODS))} "
                           f"(default {DEFAULT_METHOD})")  # fmt: skip
    conv.add_argument("--calibrate", action="store_true",
                      help="fix centres / FAVOR++ A per layer and head from sample text")  # fmt: skip
    conv.add_argument("--transfer-steps", type=int, default=0,
                      help="Llama & co.: train the attention's feature maps for N steps to match the source's "
                           "attention on unlabelled text (default 0: none)")  # fmt: skip
    conv.add_argument(
        "--transfer-text",
        metavar="FILE",
        help="UTF-8 text for --transfer-steps (default: the Python standard library's docstrings)",
    )
    conv.add_argument("--transfer-length", type=int, default=1024, help="tokens per transfer step (default 1024)")
    conv.add_argument("--set", dest="fields", action="append", default=[], metavar="FIELD=VALUE",
                      help="any other PerformerConfig field, e.g. --set hidden_dropout_prob=0.0")  # fmt: skip
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
    demo.add_argument("--method", choices=sorted(METHODS),
                      help=f"attention method of the conversion (default: {DEFAULT_METHOD})")  # fmt: skip

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
    if args.center_features is not None:
        overrides["center_features"] = args.center_features
    for item in args.fields:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConversionError(f"--set expects FIELD=VALUE, got {item!r}.")
        overrides[name.strip()] = _field_value(value)
    return overrides


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
            output = convert(args.source, args.output_dir, overwrite=args.overwrite, base_model=args.base_model,
                             revision=args.revision, fidelity=args.fidelity, method=args.method,
                             calibrate=args.calibrate, transfer_steps=args.transfer_steps,
                             transfer_text=args.transfer_text, transfer_length=args.transfer_length,
                             **_overrides(args))  # fmt: skip
            print(output)
        elif args.command == "zoo":
            _zoo(args)
        elif args.command == "push":
            from .hub import push_to_hub

            commit = push_to_hub(args.folder, args.repo_id, private=args.private, revision=args.revision,
                                 commit_message=args.message, create_pr=args.create_pr)  # fmt: skip
            print(commit.commit_url)
        else:
            from .conversion.demo import format_demo, run_demo

            result = run_demo(args.output_dir, length=args.length, num_sentences=args.sentences,
                              repeats=args.repeats, overwrite=args.overwrite, method=args.method)  # fmt: skip
            print(format_demo(result))
    except (ConversionError, ZooError, PushError) as error:
        print(f"performer-hf: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
