"""What the GPU backend reads, by the granularity of the hybrid's exact support, and the quality each keeps, on the
real all-MiniLM-L6-v2.

On CUDA the exact part of hybrid attention is a FlexAttention call over a block mask of 128 x 128 tiles
(``performer_hf.modeling.hybrid_flex``): its cost grows with the tiles that hold any of a query's support, whatever
fraction of a tile that is. The converter's default routes blocks of 8 keys to blocks of 16 queries (tuned for the
CPU kernels), so the 8 query blocks of one tile route into many tiles. Supports cut to the tiles (a window as wide
as the tiles it touches, key blocks routed to a whole tile of queries) read fewer tiles; this study measures how
many, and what they keep.

Arms (every one the default conversion, ``exact_max_length=0``, with these fields changed):

    default              window 17, 1 global token, 24 blocks of 8 keys per 16 queries (groups of 16 blocks)
    default, routed per 64 / 128 queries   the same blocks chosen for blocks of 64 / 128 queries (a tile: 2 / 1)
    window only          the default without routing
    tile window          a window of 257 (128 each side: the three tiles a window of 17 touches already), no routing
    tile routing 4 x 64  the tile window, and 4 blocks of 64 keys routed to each block of 128 queries
    tile routing 8 x 64  ... 8 blocks of 64 keys
    tile routing 2 x 128 ... 2 blocks of 128 keys (4 x 128, 8 x 128, 16 x 64: more of them)

Figures:

    tiles      the fraction of (query tile, key tile) pairs the block mask reads, mean over layers, heads and
               ``--tile-docs`` documents, at each of ``--tile-lengths`` (a support that reads every tile costs
               FlexAttention what dense attention with a mask costs)
    cosine     the mean cosine between each arm's mean-pooled embeddings and the source's (exact SDPA attention on
               the same position table, ``extended_source_model``), over documents of each ``--lengths``

Documents: non-overlapping windows of ``pydoc_data.topics`` (approximation_quality.document_batches).

    python benchmarks/routing_granularity.py                      # 4 documents at 2K and 8K; tiles up to 32K
    python benchmarks/routing_granularity.py --quick --out-dir /tmp/rg
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from pathlib import Path

import harness
import torch
from approximation_quality import document_batches, embed

logger = logging.getLogger("benchmarks.routing_granularity")

TILE_WINDOW = dict(local_window=257, routed_blocks=0)
TILE_ROUTING = dict(local_window=257, query_block_size=128, route_group_size=0)
ARMS = {
    "default": {},
    "default, routed per 64 queries": dict(query_block_size=64),
    "default, routed per 128 queries": dict(query_block_size=128),
    "window only": dict(routed_blocks=0),
    "tile window": TILE_WINDOW,
    "tile routing 4 x 64": dict(TILE_ROUTING, routed_blocks=4, route_block_size=64),
    "tile routing 8 x 64": dict(TILE_ROUTING, routed_blocks=8, route_block_size=64),
    "tile routing 2 x 128": dict(TILE_ROUTING, routed_blocks=2, route_block_size=128),
    "tile routing 4 x 128": dict(TILE_ROUTING, routed_blocks=4, route_block_size=128),
    "tile routing 8 x 128": dict(TILE_ROUTING, routed_blocks=8, route_block_size=128),
    "tile routing 16 x 64": dict(TILE_ROUTING, routed_blocks=16, route_block_size=64),
}


class TileCount:
    """Records, for every bidirectional hybrid call, the fraction of tiles its FlexAttention block mask reads; the
    call itself runs on the backend it would have had."""

    def __init__(self):
        self.fractions: list[float] = []

    def __enter__(self) -> TileCount:
        from performer_hf.modeling import favor_hybrid, hybrid_flex

        chosen = self._chosen = favor_hybrid.choose_backend
        fractions = self.fractions

        class Counting:
            def __init__(self, inner):
                self.inner, self.polynomial = inner, inner.polynomial

            def support_sums(self, selection, far, quadratic):
                tiles = hybrid_flex.support_mask(selection).kv_num_blocks  # (B, H, query tiles)
                fractions.append(float(tiles.float().mean()) / tiles.shape[-1])
                return self.inner.support_sums(selection, far, quadratic)

        favor_hybrid.choose_backend = lambda call, causal: Counting(chosen(call, causal))
        return self

    def __exit__(self, *exc_info) -> None:
        from performer_hf.modeling import favor_hybrid

        favor_hybrid.choose_backend = self._chosen


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())


def measure(args) -> dict:
    from transformers import AutoModel, AutoTokenizer

    import performer_hf
    from performer_hf.conversion.demo import extended_source_model, minilm_folder

    lengths, tile_lengths, docs, tile_docs = args.lengths, args.tile_lengths, args.docs, args.tile_docs
    positions = max(lengths + tile_lengths)
    source_folder = minilm_folder()
    tokenizer = AutoTokenizer.from_pretrained(source_folder)
    texts = {length: document_batches(tokenizer, docs, length) for length in lengths}
    tile_texts = {length: document_batches(tokenizer, tile_docs, length) for length in tile_lengths}
    source = extended_source_model(source_folder, positions)
    reference = {length: embed(source, texts[length]) for length in lengths}
    del source
    arms = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.arms:
            settings = ARMS[name]
            folder = performer_hf.convert(
                source_folder,
                Path(workdir) / "model",
                fidelity=False,
                overwrite=True,
                max_position_embeddings=positions,
                exact_max_length=0,
                **settings,
            )
            model = AutoModel.from_pretrained(folder).eval()
            record = {"settings": settings, "cosine": {}, "tiles": {}}
            for length in lengths:
                record["cosine"][str(length)] = _cosine(embed(model, texts[length]), reference[length])
            for length in tile_lengths:
                with TileCount() as count, torch.no_grad():
                    for _, input_ids in tile_texts[length]:
                        model(input_ids=input_ids)
                record["tiles"][str(length)] = statistics.fmean(count.fractions)
            logger.info("%s: %s", name, record)
            arms[name] = record
    return {"arms": arms, "lengths": lengths, "tile_lengths": tile_lengths, "docs": docs, "tile_docs": tile_docs}


def markdown(result: dict) -> str:
    lengths, tile_lengths = result["lengths"], result["tile_lengths"]
    lines = [
        "# The hybrid's exact support by granularity: FlexAttention tiles read, and quality kept",
        "",
        f"The real all-MiniLM-L6-v2 on `pydoc_data.topics`. Tiles ({result['tile_docs']} documents per length): the "
        "fraction of 128 x 128 (query, key) tiles the block mask reads, mean over layers and heads (FlexAttention's "
        f"cost grows with it). Cosine ({result['docs']} documents per length): mean-pooled embeddings against the "
        "source's (exact attention).",
        "",
        "| arm | "
        + " | ".join(f"tiles at {n}" for n in tile_lengths)
        + " | "
        + " | ".join(f"cosine at {n}" for n in lengths)
        + " |",
        "|---|" + "---|" * (len(tile_lengths) + len(lengths)),
    ]
    for name, record in result["arms"].items():
        tiles = [f"{record['tiles'][str(n)]:.1%}" for n in tile_lengths]
        cosines = [f"{record['cosine'][str(n)]:.4f}" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(tiles + cosines) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict):
    plt = harness.pyplot()
    figure, (tiles, quality) = plt.subplots(1, 2, figsize=(11, 4))
    for name, record in result["arms"].items():
        tiles.plot(result["tile_lengths"], [record["tiles"][str(n)] for n in result["tile_lengths"]], "o-", label=name)
        quality.plot(result["lengths"], [record["cosine"][str(n)] for n in result["lengths"]], "o-", label=name)
    for axes, lengths in ((tiles, result["tile_lengths"]), (quality, result["lengths"])):
        axes.set_xscale("log")
        axes.set_xticks(lengths, [f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths])
        axes.minorticks_off()
    tiles.set(xlabel="tokens", ylabel="fraction of tiles read", title="FlexAttention tiles")
    quality.set(xlabel="tokens", ylabel="cosine to the source", title="embedding quality")
    tiles.legend(fontsize=8)
    figure.tight_layout()
    return figure


def main(argv=None) -> dict:
    positive = harness.at_least(1)
    parser = harness.parser(
        __doc__,
        threads=2,
        quick="1 document at 256 and 512 tokens",
        quick_flags={"lengths": [256, 512], "tile_lengths": [256, 512], "docs": 1, "tile_docs": 1},
    )
    parser.add_argument(
        "--lengths", type=positive, nargs="+", default=[2048, 8192], help="lengths of the quality figures"
    )
    parser.add_argument("--tile-lengths", type=positive, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--docs", type=positive, default=4, help="documents per length of the quality figures")
    parser.add_argument("--tile-docs", type=positive, default=2, help="documents per length of the tile figures")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="the arms measured")
    return harness.main("routing_granularity", parser, measure, markdown, plot, argv=argv)


if __name__ == "__main__":
    main()
