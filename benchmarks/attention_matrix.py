"""The attention matrix a converted model implies, next to its source's (the paper's Appendix C.4): the real
all-MiniLM-L6-v2 on a passage of Python's documentation, ``output_attentions=True``.

Arms: ``source`` (the checkpoint with eager attention: the softmax matrix itself); ``hybrid`` (the default
conversion, with ``exact_max_length=0`` so that the approximation runs at this length: otherwise inputs of at most
2,048 tokens get exact attention, and the matrix is the source's); ``favor`` (plain FAVOR+, 256 features). A linear
method's matrix is its output for identity values (``performer_hf/modeling/implied_attention.py``).

Per arm and layer, against the source's matrix (every head and query): the relative Frobenius error, the mean total
variation distance between a query's two rows of weights (0: the same, 1: disjoint), and how often a query's most
weighted key is the source's.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import harness
import torch
from transformers import AutoModel, AutoTokenizer

import performer_hf
from performer_hf.conversion.demo import minilm_folder
from performer_hf.data_assets import python_docs

ARMS = {"source": None, "hybrid": {"exact_max_length": 0}, "favor": {"method": "favor"}}
SHOWN_HEAD = 0


def _arguments():
    arguments = harness.parser(__doc__, quick="64 tokens", quick_flags={"tokens": 64}, threads=2)
    arguments.add_argument("--tokens", type=harness.at_least(1), default=256, help="passage length (at most 1,024)")
    return arguments


def _attentions(folder: Path, batch: dict, eager: bool) -> list[torch.Tensor]:
    """Every layer's attention matrix (H, L, L) of the model in ``folder`` on ``batch`` (one passage)."""
    options = {"attn_implementation": "eager"} if eager else {}
    model = AutoModel.from_pretrained(folder, **options).eval()
    with torch.no_grad():
        return [weights[0].float() for weights in model(**batch, output_attentions=True).attentions]


def _agreement(candidate: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """candidate, reference (H, L, L) -> the three figures of the docstring."""
    return {
        "relative_error": float((candidate - reference).norm() / reference.norm()),
        "total_variation": float(0.5 * (candidate - reference).abs().sum(-1).mean()),
        "top1_agreement": float((candidate.argmax(-1) == reference.argmax(-1)).float().mean()),
    }


def measure(args) -> dict:
    source = minilm_folder()
    tokenizer = AutoTokenizer.from_pretrained(source)
    text = "\n\n".join(python_docs()[:5])
    batch = tokenizer(text, return_tensors="pt", truncation=True, max_length=args.tokens)
    workdir = Path(tempfile.mkdtemp(prefix="attention-matrix-"))
    try:
        matrices = {}
        for arm, options in ARMS.items():
            if options is None:
                matrices[arm] = _attentions(source, batch, eager=True)
            else:
                folder = performer_hf.convert(source, workdir / arm, fidelity=False, **options)
                matrices[arm] = _attentions(folder, batch, eager=False)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    reference = matrices["source"]
    arms = {
        arm: {
            "settings": ARMS[arm],
            "layers": [_agreement(m, r) for m, r in zip(layers, reference, strict=True)],
            "shown": [layers[index][SHOWN_HEAD].tolist() for index in (0, len(layers) - 1)],
        }
        for arm, layers in matrices.items()
    }
    return {"model": "all-MiniLM-L6-v2", "tokens": batch["input_ids"].shape[1], "shown_head": SHOWN_HEAD, "arms": arms}


def markdown(payload: dict) -> str:
    lines = [
        f"# The attention matrix a conversion implies: {payload['model']}, {payload['tokens']} tokens",
        "",
        "Against the source's softmax matrix, every head and query, per layer: relative Frobenius error / mean total "
        "variation distance of a query's weights / top-1 key agreement.",
        "",
        "| arm | settings | "
        + " | ".join(f"layer {i}" for i in range(len(payload["arms"]["source"]["layers"])))
        + " |",
        "|---|---|" + "---|" * len(payload["arms"]["source"]["layers"]),
    ]
    for arm, result in payload["arms"].items():
        if arm == "source":
            continue
        cells = [
            f"{r['relative_error']:.3f} / {r['total_variation']:.3f} / {r['top1_agreement']:.2f}"
            for r in result["layers"]
        ]
        lines.append(f"| {arm} | `{result['settings']}` | " + " | ".join(cells) + " |")
    lines += ["", f"The figure shows head {payload['shown_head']} of the first and the last layer."]
    return "\n".join(lines) + "\n"


def plot(payload: dict):
    plt = harness.pyplot()
    arms = payload["arms"]
    figure, axes = plt.subplots(2, len(arms), figsize=(2.8 * len(arms), 5.4), squeeze=False)
    layers = len(arms["source"]["layers"])
    for column, (arm, result) in enumerate(arms.items()):
        for row, (layer, matrix) in enumerate(zip((0, layers - 1), result["shown"], strict=True)):
            ax = axes[row][column]
            ax.imshow(torch.tensor(matrix).clamp_min(1e-4).log10(), cmap="viridis", vmin=-4, vmax=0)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"{arm}, layer {layer}", fontsize=8)
    figure.suptitle(
        f"{payload['model']}: attention of head {payload['shown_head']} (log10 weight), {payload['tokens']} tokens",
        fontsize=9,
    )
    return figure


if __name__ == "__main__":
    harness.main("attention_matrix", _arguments(), measure, markdown, plot)
