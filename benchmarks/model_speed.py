"""Whole-model speed: a converted Performer against its source with SDPA, training step and inference.

What a user feels after ``performer_hf.convert``: one optimizer step (forward, backward, AdamW) and one
inference forward of the whole model at sequence length L, against the same architecture with
transformers' SDPA attention, on CPU or CUDA.

Models (random weights: speed does not depend on them), each converted with ``performer_hf.convert``
from a source folder written here, positions set to the longest L:

    encoder   BertForMaskedLM shaped like all-MiniLM-L6-v2 (6 layers, hidden 384, 12 heads of 32,
              vocabulary 30,522) -> PerformerForMaskedLM, loss = masked-LM cross-entropy on every token
    decoder   GPT2LMHeadModel, 6 layers x 384, 12 heads -> PerformerForCausalLM, loss = next-token
    llama     LlamaForCausalLM shaped like SmolLM2-135M but 6 layers (hidden 576, 9 query heads of 64 on 3
              key/value heads, vocabulary 49,152) -> the same class with Performer attention (converted in
              place: ``attn_implementation`` "performer_hybrid" / "performer"), loss = next-token

Arms (``--arms``):

    sdpa      the source, ``attn_implementation="sdpa"`` (torch picks the backend: flash on CUDA where it can)
    sdpa_fused  the source with its attention dropout set to 0: SDPA's fused kernels on a CPU too (the
              converted models have no attention dropout either; at long lengths the ``sdpa`` arm's unfused
              path runs out of memory on a CPU)
    flash     the source with SDPA held to its flash backend (CUDA only; an arm it cannot run says why)
    hybrid    the default conversion of the encoder and decoder (``method="hybrid"``)
    tiled     the encoder's hybrid with a support that FlexAttention's 128 x 128 tiles hold whole: a window of 257, the
              first token and 16 routed blocks of 64 keys per 128 queries (``routing_granularity.py``: the default's
              quality on the real MiniLM); encoder only
    sparse    the sparse method (``method="sparse"``), the default of models converted in place (llama); causal only
    favor     plain FAVOR+ (``method="favor"``)
    exact     the default conversion with ``exact_max_length`` (on accelerators too) above every L: what its exact
              dispatch computes (SDPA, no attention dropout; causal: every position in the exact prefix)
    approximation  the default conversion with exact dispatch off (``exact_max_length=0``, on accelerators too): the
              hybrid's own approximation at every length; against ``exact`` it gives the crossover length
    bound     the same model with attention that costs nothing (each layer's attention returns its values):
              the speed-up over the source that no attention method can exceed on this model

The source trains with its configured attention dropout (0.1): on a CPU, SDPA then takes its unfused
path. The converted models have no attention dropout (FAVOR+ and the hybrid cannot apply it).

``--part attention`` times the attention call alone (layer 0's, through the same registry function the
model calls) on (batch, 12, L, 32) tensors, forward + backward and forward, against SDPA.

``--part decode`` times decoding (the decoder and llama models): one token's forward with the cache after a prompt of
L random tokens (batch 1, the cache the model returns, as ``generate()`` keeps it), seconds per token; each arm first
decodes a few tokens untimed (where calls compile: its graphs), then the rounds below, each a token.

Timing: for every L, each arm's model is built once; a warm-up run, then ``--reps`` runs interleaved
(arm after arm, round after round, the order reversed every other round) so that a change of load, or a cost
left by the arm before, hits every arm alike; the median is
reported, with ratios source / Performer (> 1: the Performer is faster). CUDA runs are synchronised
before the clock is read. Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` over the timed steps
(weights and optimizer state included); on a CPU, the extra resident memory at the peak of one more step after the
timed ones (``harness.PeakMemory``: ``VmHWM - VmRSS`` after resetting the high-water mark), untimed, with the heap's
free memory first given back to the system (``malloc_trim``): without that, a step reused what an earlier arm had
freed and its figure depended on the arms before it (encoder training at 2K: the hybrid's 258 MB alone, 83 MB
after the unfused source; with it 471 and 446 MB). An arm whose median passes ``--time-cap`` seconds, or that runs
out of memory, is skipped at longer lengths, and says so. Each result is written as it comes (``harness.checkpoint``:
the JSON and the Markdown, marked partial until the run ends), so that a run stopped by a time limit or the OOM
killer leaves what it measured.

Every timed configuration's output (the logits, or the training loss) is checked once, in its warm-up run, for NaN and
inf. ``--check`` first compares every arm's outputs at 6,144 tokens (past the conversions' exact dispatch) with the same
model in float32 on the CPU (relative L2 errors of the logits and of the attention modules' outputs, the largest
over the layers): the CUDA path and the reduced precision, measured.

``--baseline DIR`` times a change against another checkout in the same process: for every Performer arm of the
encoder and decoder, an arm ``baseline:<arm>`` runs the same converted folder (the same weights) with the modeling
code of ``DIR`` (a checkout's ``src/performer_hf/modeling``, imported under a name of its own, C++ kernels
included), interleaved with the others; the table adds the ratio ``baseline:<arm> / <arm>`` (> 1: this checkout
is faster).

    python benchmarks/model_speed.py                                    # CPU, fp32, 2 threads, 512 .. 16K
    python benchmarks/model_speed.py --device cuda --dtype bfloat16 --batch-tokens 16384 --check
    python benchmarks/model_speed.py --part decode --models decoder --device cuda --dtype bfloat16 --reps 16
    python benchmarks/model_speed.py --quick --out-dir /tmp/ms          # smoke test: 128 tokens
    git worktree add /tmp/main main && python benchmarks/model_speed.py --models encoder decoder \
        --arms hybrid --baseline /tmp/main/src/performer_hf/modeling --out-dir /tmp/vs-main
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import harness
import torch

logger = logging.getLogger("benchmarks.model_speed")

MODELS = ("encoder", "decoder", "llama")
ARMS = ("sdpa", "sdpa_fused", "flash", "hybrid", "tiled", "favor", "sparse", "exact", "approximation", "bound")
SOURCE_ARMS = ("sdpa", "sdpa_fused", "flash")
FAMILY_ARMS = ("exact", "approximation", "bound")  # the Performer family's exact dispatch: not for in-place models
MODES = ("train", "inference")
PART_MODES = {"model": MODES, "attention": ("forward_backward", "forward"), "decode": ("decode",)}
WARM_TOKENS = 3  # decoded before the timing: a compiled step's first graph, then its graph with dynamic sizes
LAYERS, HIDDEN, HEADS = 6, 384, 12
TILED = dict(local_window=257, routed_blocks=16, route_block_size=64, query_block_size=128, route_group_size=0)
VOCABULARIES = {"encoder": 30522, "decoder": 50257, "llama": 49152}  # the source models' (their tokenizers')
# the model each part cannot run, and why (a usage error where --models names it; left out of its default)
PART_EXCLUDES = {
    "decode": ("encoder", "the encoder does not decode: pass --models decoder llama"),
    "attention": (
        "llama",
        "--part attention times the Performer family's attention call, which the llama model (converted in place) "
        "has not: pass --models encoder decoder",
    ),
}
QUICK_VOCABULARY = 1024  # a quick run's models: with the tokenizers' vocabularies its smoke run took 66 s, not 26


# ---- models --------------------------------------------------------------------------------------


def source_model(kind: str, positions: int, attention_dropout: float = 0.1, vocabulary: int | None = None):
    """A source model of ``kind`` with random weights (seeded) and ``positions`` positions, SDPA attention; its
    tokenizer's vocabulary size unless ``vocabulary`` is given."""
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":  # no attention dropout in Llama: the sdpa arms are the same model
        config = LlamaConfig(
            num_hidden_layers=LAYERS,
            hidden_size=576,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=vocabulary or VOCABULARIES[kind],
            max_position_embeddings=positions,
            tie_word_embeddings=True,
        )
        return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    if kind == "encoder":
        config = BertConfig(
            num_hidden_layers=LAYERS,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            intermediate_size=4 * HIDDEN,
            max_position_embeddings=positions,
            attention_probs_dropout_prob=attention_dropout,
            vocab_size=vocabulary or VOCABULARIES[kind],
        )
        return BertForMaskedLM._from_config(config, attn_implementation="sdpa")
    config = GPT2Config(
        n_layer=LAYERS,
        n_embd=HIDDEN,
        n_head=HEADS,
        n_positions=positions,
        attn_pdrop=attention_dropout,
        vocab_size=vocabulary or VOCABULARIES[kind],
    )
    return GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")


def baseline_modeling(folder: str):
    """The ``modeling_performer`` module of another checkout's flat modeling package ``folder``, imported under a
    name of its own (it uses sibling imports only, as the Hub's remote code does)."""
    import importlib
    import importlib.util
    import sys

    name = "performer_baseline_modeling"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(folder) / "__init__.py", submodule_search_locations=[str(folder)]
        )
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return importlib.import_module(f"{name}.modeling_performer")


def baseline_model(folder: str, class_name: str, checkpoint: Path):
    """The converted ``checkpoint`` loaded by the baseline's model class ``class_name``; config entries that the
    baseline's config computes itself (properties of its class: fields added since) are left out."""
    import json

    model_class = getattr(baseline_modeling(folder), class_name)
    settings = json.loads((checkpoint / "config.json").read_text())
    known = {
        key: value
        for key, value in settings.items()
        if not isinstance(getattr(model_class.config_class, key, None), property)
    }
    return model_class.from_pretrained(checkpoint, config=model_class.config_class.from_dict(known))


def build_models(
    kind: str,
    positions: int,
    arms: list[str],
    workdir: Path,
    baseline: str | None = None,
    vocabulary: int | None = None,
) -> dict:
    """Every arm's model of ``kind`` (float32, CPU, train mode): the source, and its conversions (and, with
    ``baseline``, each conversion run by the baseline's modeling code as ``baseline:<arm>``); ``vocabulary``: see
    :func:`source_model`."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    from performer_hf import convert

    source = source_model(kind, positions, vocabulary=vocabulary)
    folder = workdir / f"{kind}-source"
    source.save_pretrained(folder)
    models = {}
    for arm in arms:
        if why := not_run(kind, arm):
            logger.info("%s", why)
            continue
        if arm in SOURCE_ARMS:
            dropout = 0.0 if arm == "sdpa_fused" else 0.1
            models[arm] = source_model(kind, positions, attention_dropout=dropout, vocabulary=vocabulary)
            continue
        settings = {
            "exact": {"method": "hybrid", "exact_max_length": 1 << 30, "accelerator_exact_max_length": 1 << 30},
            "approximation": {"method": "hybrid", "exact_max_length": 0, "accelerator_exact_max_length": 0},
            "bound": {"method": "favor"},
            "tiled": {"method": "hybrid", **TILED},
        }
        arm_settings = settings.get(arm, {"method": arm})
        if kind != "encoder":  # causal models have one exact prefix on every device: the setting is refused there
            arm_settings.pop("accelerator_exact_max_length", None)
        out = convert(folder, workdir / f"{kind}-{arm}", fidelity=False, overwrite=True, **arm_settings)
        auto = AutoModelForMaskedLM if kind == "encoder" else AutoModelForCausalLM
        models[arm] = auto.from_pretrained(out)
        if baseline and kind != "llama" and arm != "bound":
            models[f"baseline:{arm}"] = baseline_model(baseline, type(models[arm]).__name__, out)
        if arm == "bound":
            for module in models[arm].modules():
                if hasattr(module, "attend"):
                    module.attend = _free_attention
    return models


def not_run(kind: str, arm: str) -> str | None:
    """Why ``arm`` is not run on the ``kind`` model (None: it is)."""
    if kind == "llama" and arm in FAMILY_ARMS:
        return f"the {arm!r} arm is for the Performer family: not run on the llama model"
    if kind == "encoder" and arm == "sparse":
        return "the sparse method is causal only: not run on the encoder"
    if kind != "encoder" and arm == "tiled":
        return "the tiled support routes key blocks, which causal models cannot: run on the encoder only"
    return None


def _free_attention(module, q, k, v, *args, **kwargs):
    """The bound arm's attention: no work at all (the context is the values)."""
    return v, None


def backend(arm: str, device: str):
    """The context an arm runs in: SDPA held to flash for ``flash``, nothing otherwise."""
    if arm != "flash":
        return contextlib.nullcontext()
    if device != "cuda":
        raise RuntimeError("the flash arm runs on CUDA only")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


# ---- one step ------------------------------------------------------------------------------------


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_batch(kind: str, vocab: int, batch: int, length: int, device: str) -> dict:
    """Random token ids (seeded by the length) and their labels."""
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, vocab, (batch, length), generator=g).to(device)  # (B, L)
    return {"input_ids": ids, "labels": ids.clone()}


class Step:
    """One arm's unit of work on ``device``, timed: ``work()`` runs it once (and may set ``finite``: whether its
    output was, checked once)."""

    def __init__(self, work, device: str):
        self.work, self.device, self.finite = work, device, None

    def timed(self) -> tuple[float, float | None]:
        """Seconds of one run, and on CUDA its peak allocated memory in MB (None on a CPU: :meth:`peak_resident`)."""
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        synchronize(self.device)
        start = time.perf_counter()
        self.work()
        synchronize(self.device)
        seconds = time.perf_counter() - start
        return seconds, torch.cuda.max_memory_allocated() / 2**20 if self.device == "cuda" else None

    def peak_resident(self) -> float:
        """One more run, untimed, on a CPU: the extra resident memory at its peak in MB, with the heap's free memory
        first given back to the system, so that no part of it hides in what an earlier arm freed."""
        with harness.PeakMemory(release_freed=True) as memory:
            self.work()
        return memory.extra / 2**20


def model_step(arm: str, model, mode: str, inputs: dict, device: str) -> Step:
    """A training step (``train``: forward, backward, AdamW) or an inference forward (eval mode, no dropout,
    as users serve models) of ``model`` on ``inputs``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5) if mode == "train" else None

    def work() -> None:
        model.train(mode == "train")
        with backend(arm, device):
            if mode == "inference":
                with torch.no_grad():
                    output = model(input_ids=inputs["input_ids"]).logits
            else:
                output = model(**inputs).loss
                output.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if step.finite is None:  # once, in the warm-up run (a check waits for the device)
            step.finite = bool(torch.isfinite(output).all())

    step = Step(work, device)
    return step


@torch.no_grad()
def decode_step(arm: str, model, prompt, device: str) -> Step:
    """Decoding after ``prompt`` (1, L): the prompt's forward fills the cache the model returns, a few tokens are
    decoded (compiled calls compile), then each run is one more token's forward with that cache."""
    from performer_hf.integrations import CACHE_KEYWORD

    model.eval()
    with backend(arm, device):
        cache = model(input_ids=prompt, use_cache=True)[CACHE_KEYWORD]
    token = prompt[:, -1:]  # (1, 1)

    def work() -> None:
        with torch.no_grad(), backend(arm, device):
            logits = model(input_ids=token, use_cache=True, **{CACHE_KEYWORD: cache}).logits
        if step.finite is None:
            step.finite = bool(torch.isfinite(logits).all())

    step = Step(work, device)
    for _ in range(WARM_TOKENS):
        work()
    return step


def attention_step(arm: str, call, qkv: list, mode: str, device: str) -> Step:
    """One attention call on ``qkv``: forward (no gradients) or forward + backward."""

    def work() -> None:
        with backend(arm, device):
            if mode == "forward":
                with torch.no_grad():
                    call(*qkv)
                return
            for t in qkv:
                t.grad = None
            call(*qkv).float().sum().backward()

    return Step(work, device)


def _out_of_memory(error: BaseException) -> bool:
    message = str(error)
    return isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or any(
        words in message for words in ("out of memory", "can't allocate memory")
    )


# ---- the two parts -------------------------------------------------------------------------------


def time_arms(steps: dict[str, Step], reps: int) -> dict[str, dict]:
    """Warm-up, then ``reps`` interleaved runs of every step: ``{arm: record}``."""
    records = {arm: {"times_s": [], "peak_mb": None} for arm in steps}
    live = dict(steps)
    for round_ in range(reps + 1):
        order = list(live.items())
        for arm, step in order if round_ % 2 else order[::-1]:  # the order alternates: no arm always goes first
            try:
                seconds, peak = step.timed()
            except (RuntimeError, MemoryError) as error:
                records[arm] = {
                    "skipped": ("out of memory" if _out_of_memory(error) else "error")
                    + f": {str(error).splitlines()[0][:160]}"
                }
                del live[arm]
                if step.device == "cuda":
                    torch.cuda.empty_cache()
                continue
            if round_:  # the first round is the warm-up
                records[arm]["times_s"].append(seconds)
            else:  # where a time limit stops the run, the log still says which arm took the time (compilation)
                logger.info("warm-up of %s: %.1f s", arm, seconds)
            if peak is not None:
                records[arm]["peak_mb"] = max(records[arm]["peak_mb"] or 0.0, peak)
    for arm, step in live.items():
        records[arm]["median_s"] = statistics.median(records[arm]["times_s"])
        records[arm]["finite"] = step.finite
        if step.device != "cuda":
            try:
                records[arm]["peak_mb"] = step.peak_resident()
            except (RuntimeError, MemoryError) as error:  # the times stand; the table shows no peak
                logger.info("memory step of %s failed: %s", arm, str(error).splitlines()[0][:160])
    return records


def _vocabulary(args) -> int | None:
    return QUICK_VOCABULARY if args.quick else None


def _vocabulary_size(kind: str, args) -> int:
    """The vocabulary of the ``kind`` models this run builds (the token ids' range)."""
    return _vocabulary(args) or VOCABULARIES[kind]


def measure_models(args, workdir: Path, record: Callable[[dict], None]) -> None:
    dtype = getattr(torch, args.dtype)
    for kind in args.models:
        models = build_models(kind, max(args.lengths), args.arms, workdir, args.baseline, _vocabulary(args))
        for model in models.values():
            model.to(device=args.device, dtype=dtype)
        start = time.monotonic()
        stopped: dict[tuple[str, str], str] = {}
        for length in args.lengths:
            if args.budget and time.monotonic() - start > args.budget:
                # (the results so far are written as they come; this ends the run inside a time limit around it)
                stopped.update({(a, m): f"past the run's {args.budget:g} s budget" for a in args.arms for m in MODES})
            batch = max(1, args.batch_tokens // length) if args.batch_tokens else 1
            inputs = make_batch(kind, _vocabulary_size(kind, args), batch, length, args.device)
            for mode in MODES:
                steps = {}
                for arm, model in models.items():
                    if (arm, mode) in stopped:
                        record(
                            {
                                "model": kind,
                                "arm": arm,
                                "mode": mode,
                                "length": length,
                                "batch": batch,
                                "skipped": stopped[(arm, mode)],
                            }
                        )
                        continue
                    steps[arm] = model_step(arm, model, mode, inputs, args.device)
                records = time_arms(steps, args.reps)
                for arm, rec in records.items():
                    rec.update(model=kind, arm=arm, mode=mode, length=length, batch=batch)
                    record(rec)
                    if "skipped" in rec:
                        stopped[(arm, mode)] = f"skipped at a shorter length ({rec['skipped'][:60]})"
                    elif rec["median_s"] > args.time_cap:
                        stopped[(arm, mode)] = f"a shorter length took over {args.time_cap:g} s"
                    shown = rec.get("skipped") or f"{rec['median_s']:.4f} s, peak {rec.get('peak_mb') or 0:.0f} MB" + (
                        ", NOT FINITE (NaN or inf in the output)" if rec.get("finite") is False else ""
                    )
                    logger.info("%-8s %-6s %-9s L=%-6d B=%-3d %s", kind, arm, mode, length, batch, shown)
        del models


def measure_decode(args, workdir: Path, record: Callable[[dict], None]) -> None:
    dtype = getattr(torch, args.dtype)
    for kind in args.models:
        positions = max(args.lengths) + WARM_TOKENS + args.reps + 2  # the prompt and every decoded token
        models = build_models(kind, positions, args.arms, workdir, args.baseline, _vocabulary(args))
        for model in models.values():
            model.to(device=args.device, dtype=dtype)
        for length in args.lengths:
            prompt = make_batch(kind, _vocabulary_size(kind, args), 1, length, args.device)
            steps = {arm: decode_step(arm, model, prompt["input_ids"], args.device) for arm, model in models.items()}
            for arm, rec in time_arms(steps, args.reps).items():
                rec.update(model=kind, arm=arm, mode="decode", length=length, batch=1)
                record(rec)
                logger.info(
                    "decode %-8s %-6s L=%-6d %s", kind, arm, length, rec.get("skipped") or f"{rec['median_s']:.5f} s"
                )
            del steps
        del models


class AttentionCall:
    """Layer 0's attention function of a converted model, called on (B, H, L, D) tensors."""

    def __init__(self, module, causal: bool):
        self.module, self.causal = module, causal

    def __call__(self, q, k, v):
        return self.module.attend(self.module, q, k, v, None, self.causal)[0]


def measure_attention(args, workdir: Path, record: Callable[[dict], None]) -> None:
    import torch.nn.functional as F

    dtype = getattr(torch, args.dtype)
    for kind in args.models:
        causal = kind == "decoder"
        models = build_models(kind, 64, [a for a in args.arms if a not in SOURCE_ARMS], workdir, args.baseline)
        calls = {arm: AttentionCall(first_attention(m).to(args.device), causal) for arm, m in models.items()}
        # the step's backend context holds "flash" to its kernel; a bare SDPA call has no dropout, so
        # sdpa_fused would time the same call as sdpa
        for arm in ("sdpa", "flash"):
            if arm in args.arms:
                calls[arm] = lambda q, k, v, causal=causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        for length in args.lengths:
            batch = max(1, args.batch_tokens // length) if args.batch_tokens else 1
            g = torch.Generator().manual_seed(length)
            qkv = [
                torch.randn(batch, HEADS, length, HIDDEN // HEADS, generator=g).to(args.device, dtype).requires_grad_()
                for _ in range(3)
            ]
            for mode in ("forward_backward", "forward"):
                steps = {arm: attention_step(arm, call, qkv, mode, args.device) for arm, call in calls.items()}
                for arm, rec in time_arms(steps, args.reps).items():
                    rec.update(model=kind, arm=arm, mode=mode, length=length, batch=batch)
                    record(rec)
                    logger.info(
                        "attention %-8s %-6s %-16s L=%-6d %s",
                        kind,
                        arm,
                        mode,
                        length,
                        rec.get("skipped") or f"{rec['median_s']:.4f} s",
                    )


def first_attention(model):
    """The model's first attention module (layer 0's)."""
    return next(m for m in model.modules() if hasattr(m, "attend"))


# ---- agreement with float32 on the CPU -------------------------------------------------------------


# past both conversions' exact dispatch (encoder: 2,048 tokens, decoder: the first 4,096 positions), so that the
# check reads the approximations' device paths, not SDPA's
CHECK_LENGTH = 6144


def measure_agreement(args, workdir: Path, length: int = CHECK_LENGTH) -> list[dict]:
    """Each arm's logits on ``--device`` in ``--dtype`` against the same model in float32 on the CPU, and its
    attention modules' outputs (the largest error over them): with random weights the logits' error is mostly the
    embeddings' and the head's rounding, the same for every arm, while the attention's says what its path costs."""
    rows = []
    for kind in args.models:
        models = build_models(kind, length, [a for a in args.arms if a != "flash"], workdir)
        inputs = make_batch(kind, VOCABULARIES[kind], 2, length, "cpu")
        for arm, model in models.items():
            model.eval()
            with torch.no_grad(), _attention_outputs(model) as reference_attention:
                reference = model(input_ids=inputs["input_ids"]).logits.double()
            model.to(args.device, getattr(torch, args.dtype))
            with torch.no_grad(), _attention_outputs(model) as attention:
                logits = model(input_ids=inputs["input_ids"].to(args.device)).logits.double().cpu()
            error = _relative_error(logits, reference)
            pairs = zip(attention, reference_attention, strict=True)
            attention_error = max(_relative_error(got, want) for got, want in pairs)
            rows.append(
                {
                    "model": kind,
                    "arm": arm,
                    "length": length,
                    "relative_error": error,
                    "attention_error": attention_error,
                    "finite": bool(torch.isfinite(logits).all()),
                }
            )
            logger.info("agreement %-8s %-6s relative error %.2e, attention %.2e", kind, arm, error, attention_error)
    return rows


def _relative_error(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


@contextlib.contextmanager
def _attention_outputs(model):
    """The outputs of the model's attention modules (classes named ``...Attention``) during the block, in float64
    on the CPU, in call order."""
    outputs = []

    def keep(module, args, output):
        outputs.append((output[0] if isinstance(output, tuple) else output).detach().double().cpu())

    handles = [m.register_forward_hook(keep) for m in model.modules() if type(m).__name__.endswith("Attention")]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def check(parser, args) -> None:
    """Flags that cannot run together end in a usage error before any model is built (they ended in tracebacks: a
    KeyError after the models were built, a plot of no rows after an empty Markdown, CUDA's missing driver); the
    default ``--models`` of a part are the models it runs."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch finds no CUDA device here; run on a GPU machine, or pass --device cpu")
    excluded, why = PART_EXCLUDES.get(args.part, (None, None))
    if args.models is None:
        args.models = [kind for kind in MODELS if kind != excluded]
    elif excluded in args.models:
        parser.error(f"--part {args.part} --models {' '.join(args.models)}: {why}")
    for kind in args.models:
        if not any(_runs(kind, arm, args) for arm in args.arms):
            parser.error(
                f"--arms {' '.join(args.arms)}: none of them runs on the {kind} model on {args.device} "
                "(sparse: causal models; tiled: the encoder; exact, approximation, bound: not llama; flash: CUDA; "
                "sdpa_fused: not --part attention, whose bare SDPA call is sdpa's); add an arm that does, e.g. sdpa"
            )


def _runs(kind: str, arm: str, args) -> bool:
    """Whether ``arm`` is timed on the ``kind`` model by this command line."""
    if arm == "flash" and args.device != "cuda":
        return False
    if arm == "sdpa_fused" and args.part == "attention":  # the same bare call as sdpa: not timed twice
        return False
    return not_run(kind, arm) is None


def measure(args) -> dict:
    if args.device == "cpu" and "flash" in args.arms:
        args.arms = [a for a in args.arms if a != "flash"]
    payload = {"settings": {k: v for k, v in vars(args).items() if k != "out_dir"}}
    if args.device == "cpu":  # how the CPU peaks were taken (results written before say nothing: in one process)
        payload["settings"]["memory_probe"] = "released"
    if args.device == "cuda":
        payload["settings"]["gpu"] = torch.cuda.get_device_name()
        payload["settings"]["cuda"] = torch.version.cuda
    payload["results"] = []

    def record(rec: dict) -> None:  # each result written as it comes: a run stopped later keeps it
        payload["results"].append(rec)
        harness.checkpoint(payload)

    with tempfile.TemporaryDirectory() as workdir:
        if args.check:
            payload["agreement"] = measure_agreement(args, Path(workdir))
            harness.checkpoint(payload)
        part = {"model": measure_models, "attention": measure_attention, "decode": measure_decode}[args.part]
        part(args, Path(workdir), record)
    return payload


# ---- reporting -----------------------------------------------------------------------------------


def _median(results, **key) -> float | None:
    rec = next((r for r in results if all(r.get(k) == v for k, v in key.items())), None)
    return None if rec is None else rec.get("median_s")


def markdown(payload: dict) -> str:
    s, results = payload["settings"], payload["results"]
    environment = harness.environment(payload)
    machine, load = environment["machine"], environment["load_average"]
    where = s.get("gpu") or f"{machine.get('cpu', '?')}, {machine['torch_threads']} threads"
    modes = PART_MODES[s["part"]]
    title = {"model": "Whole-model speed", "attention": "Attention-call speed", "decode": "Decoding speed"}[s["part"]]
    lines = [
        f"# {title}: converted Performer vs its source with SDPA ({s['device']}, {s['dtype']})",
        "",
        f"{where}; torch {machine['torch']}, transformers {machine.get('transformers', '?')}. Median of "
        f"{s['reps']} interleaved runs after a warm-up. "
        + (f"Batch = max(1, {s['batch_tokens']} // L) sequences. " if s["batch_tokens"] else "Batch 1. ")
        + f"Load average {load['before']} -> {load['after']}."
        + (f" Memory allocator: {environment['allocator']}." if "allocator" in environment else ""),
        "",
    ]
    arms = list(s["arms"]) + sorted({r["arm"] for r in results if r["arm"].startswith("baseline:")})
    performer_arms = [a for a in arms if a not in SOURCE_ARMS]
    source_arms = [a for a in arms if a in SOURCE_ARMS]
    compared = [a for a in performer_arms if f"baseline:{a}" in arms]  # (this checkout, the baseline) pairs
    for kind in s["models"]:
        for mode in modes:
            lines += [f"## {kind}, {mode.replace('_', ' + ')}", ""]
            header = [f"{a} (s)" for a in arms] + [f"{b} / {a}" for a in performer_arms for b in source_arms]
            header += [f"baseline:{a} / {a}" for a in compared]
            lines += ["| L | batch | " + " | ".join(header) + " |", "|---|---|" + "---|" * len(header)]
            for length in s["lengths"]:
                times = {a: _median(results, model=kind, arm=a, mode=mode, length=length) for a in arms}
                batch = next((r["batch"] for r in results if r["length"] == length), "-")
                cells = ["-" if times[a] is None else f"{times[a]:.4f}" for a in arms]
                pairs = [(a, b) for a in performer_arms for b in source_arms] + [(a, f"baseline:{a}") for a in compared]
                for a, b in pairs:
                    ok = times[a] and times[b]
                    cells.append(f"**{times[b] / times[a]:.2f}x**" if ok else "-")
                lines.append(f"| {length} | {batch} | " + " | ".join(cells) + " |")
            lines.append("")
    if any(r.get("peak_mb") for r in results):
        lines += [
            "## Peak GPU memory (MB, weights and optimizer state included)"
            if s["device"] == "cuda"
            else "## Peak extra resident memory (MB: what a step needed beyond the resident set at its start)",
            "",
        ]
        if s["device"] != "cuda":
            lines += [
                "One more step after the timed ones, untimed, with the heap's free memory first given back to the "
                "system (`malloc_trim`), so that no arm's peak hides in what an arm before it freed."
                if s.get("memory_probe") == "released"
                else "Every arm ran in this one process, so an arm's peak can hide in the heap an earlier arm left: "
                "these figures are not comparable between arms (`speed.py` and `long_context.py` measure each arm "
                "alone).",
                "",
            ]
        for kind in s["models"]:
            for mode in modes:
                lines += [
                    f"{kind}, {mode}:",
                    "",
                    "| L | " + " | ".join(arms) + " |",
                    "|---|" + "---|" * len(arms),
                ]
                for length in s["lengths"]:
                    peaks = [
                        next(
                            (
                                r.get("peak_mb")
                                for r in results
                                if (r["model"], r["arm"], r["mode"], r["length"]) == (kind, a, mode, length)
                            ),
                            None,
                        )
                        for a in arms
                    ]
                    lines.append(f"| {length} | " + " | ".join("-" if p is None else f"{p:.0f}" for p in peaks) + " |")
                lines.append("")
    checked = [r for r in results if r.get("finite") is not None]
    if checked:
        bad = [f"{r['model']} {r['arm']} {r['mode']} L={r['length']}" for r in checked if not r["finite"]]
        lines += [
            f"Outputs (logits, or the training loss) checked for NaN and inf once per timed configuration: "
            f"{len(checked)} checked, " + (f"**not finite: {', '.join(bad)}**" if bad else "all finite") + ".",
            "",
        ]
    skipped = sorted({(r["model"], r["arm"], r["mode"], r["skipped"]) for r in results if "skipped" in r})
    if skipped:
        lines += ["## Skipped", ""] + [f"- {k} {a} {m}: {why}" for k, a, m, why in skipped] + [""]
    if payload.get("agreement"):
        lines += [
            f"## Agreement with float32 on the CPU (relative L2 errors, L = "
            f"{payload['agreement'][0]['length']}, batch 2)",
            "",
            "| model | arm | logits | attention outputs (largest) | finite |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['model']} | {r['arm']} | {r['relative_error']:.2e} | "
            f"{'-' if r.get('attention_error') is None else format(r['attention_error'], '.2e')} | {r['finite']} |"
            for r in payload["agreement"]
        ]
        lines.append("")
    return "\n".join(lines)


def plot(payload: dict):
    s, results = payload["settings"], payload["results"]
    modes = PART_MODES[s["part"]]
    fig, axes = harness.pyplot().subplots(
        len(s["models"]), len(modes), figsize=(12, 4.5 * len(s["models"])), squeeze=False
    )
    for row, kind in enumerate(s["models"]):
        for col, mode in enumerate(modes):
            ax = axes[row][col]
            for arm in s["arms"]:
                pts = [(L, _median(results, model=kind, arm=arm, mode=mode, length=L)) for L in s["lengths"]]
                pts = [(L, t) for L, t in pts if t]
                if pts:
                    ax.plot(*zip(*pts, strict=True), "--" if arm in SOURCE_ARMS else "-", marker="o", label=arm)
            ax.set(
                xscale="log",
                yscale="log",
                xlabel="sequence length L",
                ylabel="seconds per token" if mode == "decode" else "seconds per step",
                title=f"{kind}: {mode.replace('_', ' + ')} ({s['device']}, {s['dtype']})",
            )
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    return fig


def main(argv=None) -> dict:
    # the smoke test runs each path once: its arms leave out other settings of paths it runs (and the tiled support,
    # which would compile a CPU kernel of its own, a minute)
    quick_arms = [arm for arm in ARMS if arm not in ("sdpa_fused", "exact", "approximation", "tiled")]
    parser = harness.parser(
        __doc__,
        quick="L = 128, 1 run each, the three models, arms sdpa hybrid favor sparse (causal models) bound (and "
        "flash on CUDA), vocabularies of 1,024",
        quick_flags={"lengths": [128], "reps": 1, "arms": quick_arms},
        threads=2,
    )
    parser.add_argument("--part", choices=tuple(PART_MODES), default="model")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODELS,
        help="default: every model the part runs (--part decode: decoder llama; --part attention: encoder decoder)",
    )
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--lengths", type=harness.at_least(1), nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument(
        "--batch-tokens", type=harness.at_least(0), default=0, help="tokens per batch (batch = this // L); 0: batch 1"
    )
    parser.add_argument(
        "--reps", type=harness.at_least(1), default=3, help="timed runs per configuration (median reported)"
    )
    parser.add_argument("--time-cap", type=float, default=60.0, help="skip longer lengths past this median (s)")
    parser.add_argument(
        "--budget", type=float, default=0.0, help="per model: start no new length past this many seconds (0: no limit)"
    )
    parser.add_argument("--check", action="store_true", help="first compare outputs with float32 on the CPU")
    parser.add_argument("--baseline", help="another checkout's src/performer_hf/modeling: its arms baseline:<arm>")
    args, _ = parser.parse_known_args(argv)
    name = "model_speed" + ("" if args.part == "model" else f"_{args.part}")
    if (args.device, args.dtype) != ("cpu", "float32"):
        name += f"_{args.device}_{args.dtype}"
    return harness.main(name, parser, measure, markdown, plot, check=check, argv=argv)


if __name__ == "__main__":
    main()
