"""How much of all-MiniLM-L6-v2 survives the swap to FAVOR+ without finetuning: ours vs performer-pytorch.

The real sentence-transformers/all-MiniLM-L6-v2 (6 layers, 12 heads of 32 dims) embeds N real English
sentences (from Python's documentation, ``pydoc_data.topics``) by mean pooling, four ways:

    source             HF BertModel, exact softmax attention (sdpa): the reference
    performer-hf default   ``performer_hf.convert`` with its default settings (the hybrid method, see
                       ``performer_hf.conversion.convert.METHODS``; recorded in the JSON), but
                       ``exact_max_length=0``: sentences would otherwise keep exact attention
    performer-hf favor+    ``performer_hf.convert(method="favor")``: plain FAVOR+ (softmax kernel, 256
                       orthogonal features with chi norms), the like-for-like peer of performer-pytorch
                       other seeds (both performer-hf rows) via ``model.redraw_projections(seed)``
    performer-pytorch  the same BertModel and weights with its attention function replaced by
                       ``performer_pytorch.FastAttention(dim_heads=32, nb_features=256, causal=False)``
                       (one per layer, seeded by ``torch.manual_seed(seed)``), fed q, k, v after BERT's
                       projections

Scaling: performer-pytorch's ``softmax_kernel`` multiplies q and k by d^-1/4 itself (``data_normalizer``),
so ``FastAttention(q, k, v)`` estimates softmax(q k^T / sqrt(d)) v, which is exactly BERT's scaling
(``module.scaling = d^-1/2``). The wrapper passes q and k unchanged in that case and, for any other
scaling s, multiplies each by sqrt(s * sqrt(d)) first.

Padding: FastAttention takes no mask (performer-pytorch's own SelfAttention only zeroes padded
values, which leaves padded keys in the normaliser), so sentences are batched by token length and
no batch holds padding: all three models see identical inputs.

Figures per seed: ``mean_cosine`` (mean over sentences of the cosine between the source's and the
candidate's embedding) and ``pairwise_spearman`` (Spearman correlation of the two N x N
pairwise-similarity matrices' upper triangles). Summaries are medians over seeds.

Writes conversion_fidelity.{json,png,md} to --out-dir.

    python benchmarks/conversion_fidelity.py                    # 200 sentences, 5 seeds
    python benchmarks/conversion_fidelity.py --quick --out-dir /tmp/fidelity   # smoke test: 50 sentences, 2 seeds
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import harness
import performer_pytorch
import torch
from transformers import AttentionInterface, AutoTokenizer, BertModel

from performer_hf import PerformerModel, convert
from performer_hf.conversion.demo import minilm_folder
from performer_hf.conversion.fidelity import embedding_agreement, english_sentences

logger = logging.getLogger("benchmarks.conversion_fidelity")
# performer-hf rows: the keyword arguments of ``convert`` behind each
# the default's approximation: sentences are shorter than its exact_max_length, which would keep them exact
CONVERSIONS = {"performer-hf default": {"exact_max_length": 0}, "performer-hf favor+": {"method": "favor"}}
METHODS = (*CONVERSIONS, "performer-pytorch")
METRICS = ("mean_cosine", "pairwise_spearman")
ATTENTION_FIELDS = (
    "attention_kernel",
    "nb_features",
    "feature_coupling",
    "local_window",
    "num_global_tokens",
    "routed_blocks",
    "route_block_size",
    "query_block_size",
    "center_features",
)


def length_buckets(tokenizer, sentences: list[str], batch_size: int) -> list[list[int]]:
    """Sentence indices grouped so that every batch has one token length (no padding)."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, ids in enumerate(tokenizer(sentences)["input_ids"]):
        by_length[len(ids)].append(index)
    return [group[i : i + batch_size] for group in by_length.values() for i in range(0, len(group), batch_size)]


@torch.no_grad()
def embed(model, tokenizer, sentences: list[str], buckets: list[list[int]]) -> torch.Tensor:
    """Mean-pooled last hidden states (N, H), computed bucket by bucket, in sentence order."""
    out = torch.empty(len(sentences), model.config.hidden_size, dtype=torch.float64)
    for bucket in buckets:
        batch = tokenizer([sentences[i] for i in bucket], return_tensors="pt")
        assert bool(batch["attention_mask"].all()), "buckets must hold no padding"
        out[bucket] = model(**batch).last_hidden_state.mean(dim=1).double()  # (b, H)
    return out


def performer_pytorch_attention(layers: dict[int, performer_pytorch.FastAttention]):
    """An HF attention function that runs each layer's FastAttention on BERT's q, k, v (B, H, L, D)."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        head_dim = query.shape[-1]
        scaling = head_dim**-0.5 if scaling is None else scaling
        # FastAttention scales q and k by head_dim^-1/4 each; rescale so the logits are q.k * scaling
        factor = (scaling * head_dim**0.5) ** 0.5
        out = layers[id(module)](query * factor, key * factor, value)  # (B, H, L, D)
        return out.transpose(1, 2), None  # (B, L, H, D), no weights

    return attention


def measure(args) -> dict:
    """Embedding agreement with the source per method and seed, and the medians over seeds."""
    num_sentences, seeds, batch_size = args.sentences, args.seeds, args.batch_size
    torch.manual_seed(0)
    folder = minilm_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sentences = english_sentences(num_sentences)
    buckets = length_buckets(tokenizer, sentences, batch_size)
    source = BertModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    reference = embed(source, tokenizer, sentences, buckets)

    records, settings = [], {}
    for method, options in CONVERSIONS.items():
        with tempfile.TemporaryDirectory() as scratch:
            out = convert(folder, Path(scratch) / "out", fidelity=False, **options)
            ours = PerformerModel.from_pretrained(out).eval()
            settings[method] = {key: getattr(ours.config, key) for key in ATTENTION_FIELDS}
            for seed in range(seeds):
                if seed > 0:  # seed 0: the projections exactly as converted
                    ours.redraw_projections(seed)
                figures = embedding_agreement(reference, embed(ours, tokenizer, sentences, buckets))
                records.append({"method": method, "seed": seed, **figures})
                logger.info("%s", records[-1])

    attention_modules = [layer.attention.self for layer in source.encoder.layer]
    for seed in range(seeds):
        torch.manual_seed(seed)
        layers = {
            id(module): performer_pytorch.FastAttention(dim_heads=32, nb_features=256, causal=False)
            for module in attention_modules
        }
        AttentionInterface.register("performer_pytorch", performer_pytorch_attention(layers))
        source.set_attn_implementation("performer_pytorch")
        figures = embedding_agreement(reference, embed(source, tokenizer, sentences, buckets))
        source.set_attn_implementation("sdpa")
        records.append({"method": "performer-pytorch", "seed": seed, **figures})
        logger.info("%s", records[-1])

    summary = {
        method: {metric: statistics.median(r[metric] for r in records if r["method"] == method) for metric in METRICS}
        for method in METHODS
    }
    return {
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "sentences": len(sentences),
        "text": "plain English sentences from Python's documentation (pydoc_data.topics)",
        "seeds": seeds,
        "settings": {**settings, "performer-pytorch": {"nb_features": 256, "kernel": "softmax", "orthogonal": True}},
        "records": records,
        "median": summary,
        "ours_at_least_as_good": {
            method: all(summary[method][m] >= summary["performer-pytorch"][m] for m in METRICS)
            for method in CONVERSIONS
        },
    }


def plot(result: dict):
    """Mean cosine and pairwise Spearman per method, every seed as a point over its box."""
    fig, axes = harness.pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, METRICS, strict=True):
        values = [[r[metric] for r in result["records"] if r["method"] == m] for m in METHODS]
        ax.boxplot(values, showmeans=False)
        for i, points in enumerate(values, start=1):
            ax.scatter([i] * len(points), points, s=14, alpha=0.7, zorder=3)
        ax.set_xticks(range(1, len(METHODS) + 1), METHODS, fontsize=8)
        ax.set_title(metric.replace("_", " "))
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"all-MiniLM-L6-v2 -> Performer (no finetuning), {result['sentences']} sentences, {result['seeds']} seeds",
        fontsize=10,
    )
    return fig


def markdown(result: dict) -> str:
    """The settings of every method and the medians over seeds."""
    lines = [
        "# Conversion fidelity: all-MiniLM-L6-v2 converted to a Performer, without finetuning",
        "",
        f"{result['sentences']} {result['text']}; mean-pooled embeddings vs the exact-attention source; "
        f"median over {result['seeds']} random-feature seeds (see benchmarks/conversion_fidelity.py).",
        "",
        *(f"- {method}: {result['settings'][method]}" for method in METHODS),
        "",
        "| method | mean cosine | pairwise-similarity Spearman |",
        "| --- | --- | --- |",
    ]
    for method in METHODS:
        figures = result["median"][method]
        lines.append(f"| {method} | {figures['mean_cosine']:.4f} | {figures['pairwise_spearman']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = harness.parser(__doc__, quick="50 sentences, 2 seeds", quick_flags={"sentences": 50, "seeds": 2})
    parser.add_argument(
        "--sentences", type=harness.at_least(3), default=200, help="at least 3: the pairwise Spearman's least"
    )
    parser.add_argument("--seeds", type=harness.at_least(1), default=5)
    parser.add_argument("--batch-size", type=harness.at_least(1), default=32)
    return harness.main("conversion_fidelity", parser, measure, markdown, plot, argv=argv)


if __name__ == "__main__":
    main()
