"""Datasets for the training scripts: loading, column checks, cached tokenization, grouping, labels.

Tokenization goes through ``Dataset.map``, so ``datasets`` caches it (keyed by the data files, the
tokenizer and the arguments) and a second run with the same inputs skips it. Language-modeling
texts are then concatenated and cut into blocks of exactly ``max_seq_length`` tokens over the whole
split, so blocks of tens of thousands of tokens lose at most one partial block at the end.
"""

from __future__ import annotations

import argparse
import logging
from contextlib import contextmanager

import datasets as hf_datasets
import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Value, load_dataset
from datasets.exceptions import DatasetGenerationError, DatasetNotFoundError
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from .arguments import DATA_FILE_BUILDERS, TrainingInputError
from .collators import EXAMPLE_INDEX

logger = logging.getLogger(__name__)

STRING_DTYPES = ("string", "large_string")


def _describe_source(args: argparse.Namespace) -> str:
    return f"--dataset_name {args.dataset_name!r}" if args.dataset_name else f"--train_file {args.train_file!r}"


@contextmanager
def _progress_bars_as_transformers():
    """datasets' progress bars (reading, tokenizing) off while transformers' are (``transformers.utils.logging.
    disable_progress_bar()``, as `performer-hf` commands turn them off), and as they were after."""
    hide = not hf_logging.is_progress_bar_enabled() and hf_datasets.is_progress_bar_enabled()
    if hide:
        hf_datasets.disable_progress_bars()
    try:
        yield
    finally:
        if hide:
            hf_datasets.enable_progress_bars()


def load_raw_datasets(args: argparse.Namespace) -> DatasetDict:
    """``train`` and ``validation`` splits from local files or a Hub dataset.

    Without a validation set, the first ``--validation_split_percentage`` % of the training data is
    held out. Raises :class:`TrainingInputError` when a split is empty or a file cannot be read.
    """
    with _progress_bars_as_transformers():
        raw = _read_splits(args)
    if "train" not in raw:
        raise TrainingInputError(f"{_describe_source(args)} has no 'train' split (its splits: {sorted(raw)}).")
    if len(raw["train"]) == 0:
        raise TrainingInputError(f"The training data ({_describe_source(args)}) has no examples.")
    if "validation" not in raw:
        return _hold_out(raw["train"], args.validation_split_percentage)
    if len(raw["validation"]) == 0:
        raise TrainingInputError(
            "The validation set is empty: pass a --validation_file with examples, or raise "
            f"--validation_split_percentage (now {args.validation_split_percentage})."
        )
    return DatasetDict(train=raw["train"], validation=raw["validation"])


def _read_splits(args: argparse.Namespace) -> DatasetDict:
    """The splits of the Hub dataset or of the local files, as ``datasets`` reads them."""
    try:
        if args.dataset_name is not None:
            return load_dataset(args.dataset_name, args.dataset_config_name)
        builder = DATA_FILE_BUILDERS[args.train_file.rsplit(".", 1)[-1].lower()]
        options = {"keep_linebreaks": True} if builder == "text" else {}
        data_files = {"train": args.train_file}
        if args.validation_file is not None:
            data_files["validation"] = args.validation_file
        return load_dataset(builder, data_files=data_files, **options)
    except (DatasetGenerationError, DatasetNotFoundError, ConnectionError) as error:
        cause = error.__cause__ or error
        raise TrainingInputError(f"Could not read the data of {_describe_source(args)}: {cause}") from error
    except ValueError as error:  # a split of no data (a header-only CSV): datasets refuses to read it
        if "corresponds to no data" not in str(error):
            raise
        if '"validation"' in str(error):
            raise TrainingInputError(
                f"The validation data (--validation_file {args.validation_file!r}) has no examples."
            ) from error
        raise TrainingInputError(f"The training data ({_describe_source(args)}) has no examples.") from error


def _hold_out(train: Dataset, percent: int) -> DatasetDict:
    """The first ``percent`` % of ``train``'s rows as the validation split, the rest as the training split: the rows
    ``datasets``' ``train[:percent%]`` / ``train[percent%:]`` slices name (their count rounded to the nearest, as
    ``datasets`` rounds), without its refusal of a slice of no rows, which a file of a few rows gets."""
    held_out = round(len(train) * percent / 100)
    if held_out == 0:
        raise TrainingInputError(
            f"The validation set is empty: {percent}% of the {len(train)} training examples rounds to none. Pass a "
            f"--validation_file with examples, or raise --validation_split_percentage (now {percent})."
        )
    if held_out == len(train):
        raise TrainingInputError(
            f"No training data is left: {percent}% of the {len(train)} training examples rounds to all of them. "
            f"Pass a --validation_file, or lower --validation_split_percentage (now {percent})."
        )
    return DatasetDict(train=train.select(range(held_out, len(train))), validation=train.select(range(held_out)))


def check_column(dataset: Dataset, name: str, flag: str) -> None:
    """Raise :class:`TrainingInputError` unless ``name`` is a column of ``dataset``."""
    if name not in dataset.column_names:
        raise TrainingInputError(
            f"{flag} {name!r} is not a column of the data; its columns are {dataset.column_names}."
        )


def select_text_column(dataset: Dataset, requested: str | None, exclude: tuple[str, ...] = ()) -> str:
    """``requested`` (checked), else ``'text'``, else the first column not in ``exclude``; must hold strings."""
    if requested is not None:
        check_column(dataset, requested, "--text_column_name")
        name = requested
    elif "text" in dataset.column_names:
        name = "text"
    else:
        candidates = [column for column in dataset.column_names if column not in exclude]
        if not candidates:
            raise TrainingInputError(f"The data has no text column (columns: {dataset.column_names}).")
        name = candidates[0]
    feature = dataset.features[name]
    if not (isinstance(feature, Value) and feature.dtype in STRING_DTYPES):
        raise TrainingInputError(
            f"Column {name!r} holds {feature}, not text; choose the text column with --text_column_name."
        )
    return name


class _QuietLengthWarning:
    """Silence the tokenizer's 'sequence longer than model_max_length' warning: texts are grouped or
    truncated afterwards, so long raw texts are expected."""

    def __enter__(self):
        self._logger = hf_logging.get_logger("transformers.tokenization_utils_base")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self._logger.setLevel(self._level)


def _tokenize_splits(raw: DatasetDict, fn, args, accelerator) -> DatasetDict:
    """``fn`` mapped (batched) over every split, replacing the raw columns; the main process tokenizes
    first, so the other processes read its cache."""
    with accelerator.main_process_first(), _progress_bars_as_transformers():
        return DatasetDict(
            {
                split: dataset.map(
                    fn,
                    batched=True,
                    num_proc=args.preprocessing_num_workers,
                    remove_columns=dataset.column_names,
                    load_from_cache_file=not args.overwrite_cache,
                    desc=f"Tokenizing {split}",
                )
                for split, dataset in raw.items()
            }
        )


def tokenize_texts(
    raw: DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    text_column: str,
    args: argparse.Namespace,
    accelerator,
    special_tokens_mask: bool,
) -> DatasetDict:
    """Tokenize every non-blank text (cached by ``datasets``); keeps ``input_ids`` (and
    ``special_tokens_mask`` for MLM, so special tokens are never masked)."""

    def tokenize(batch):
        texts = [text for text in batch[text_column] if text and not text.isspace()]
        if not texts:
            return {"input_ids": [], **({"special_tokens_mask": []} if special_tokens_mask else {})}
        with _QuietLengthWarning():
            return tokenizer(
                texts,
                return_attention_mask=False,
                return_token_type_ids=False,
                return_special_tokens_mask=special_tokens_mask,
            )

    return _tokenize_splits(raw, tokenize, args, accelerator)


def group_into_blocks(tokenized: Dataset, block_size: int, split: str) -> Dataset:
    """Concatenate all token columns of ``tokenized`` and cut them into rows of ``block_size`` tokens,
    numbered in ``"example_index"``.

    The partial block at the end is dropped. Raises :class:`TrainingInputError` if not even one
    block fits.
    """
    if tokenized._indices is not None:
        tokenized = tokenized.flatten_indices()
    blocks = {}
    total = 0
    for name in tokenized.column_names:
        chunks = tokenized.data.column(name).chunks
        flat = np.concatenate([chunk.flatten().to_numpy(zero_copy_only=False) for chunk in chunks]) if chunks else []
        total = len(flat)
        count = total // block_size
        blocks[name] = np.asarray(flat[: count * block_size]).reshape(count, block_size)  # (blocks, block_size)
    if total < block_size:
        raise TrainingInputError(
            f"The {split} data has {total} tokens, fewer than one block of --max_seq_length {block_size}; "
            "lower --max_seq_length or add text."
        )
    logger.info("%s: %d tokens -> %d blocks of %d", split, total, total // block_size, block_size)
    blocks[EXAMPLE_INDEX] = np.arange(total // block_size)  # lets the MLM collator seed each block's mask
    return Dataset.from_dict(blocks)


def language_modeling_datasets(
    raw: DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    args: argparse.Namespace,
    accelerator,
    block_size: int,
    special_tokens_mask: bool,
) -> DatasetDict:
    """Blocks of ``block_size`` token ids for MLM / causal LM, in torch format."""
    text_column = select_text_column(raw["train"], args.text_column_name)
    tokenized = tokenize_texts(raw, tokenizer, text_column, args, accelerator, special_tokens_mask)
    grouped = DatasetDict({split: group_into_blocks(data, block_size, split) for split, data in tokenized.items()})
    return _limit_samples(grouped, args).with_format("torch")


def _limit_samples(datasets: DatasetDict, args: argparse.Namespace) -> DatasetDict:
    limits = {"train": args.max_train_samples, "validation": args.max_eval_samples}
    return DatasetDict(
        {
            split: data.select(range(min(len(data), limits[split]))) if limits[split] is not None else data
            for split, data in datasets.items()
        }
    )


def label_values(dataset: Dataset, label_column: str) -> list:
    """The label column's values, checked to be class labels (strings, integers or booleans)."""
    check_column(dataset, label_column, "--label_column_name")
    feature = dataset.features[label_column]
    if isinstance(feature, ClassLabel):
        return [feature.int2str(value) for value in dataset[label_column]]
    if not isinstance(feature, Value) or feature.dtype.startswith("float"):
        raise TrainingInputError(
            f"Column {label_column!r} holds {feature}; run_classification.py needs class labels "
            "(strings or integers), not regression targets."
        )
    values = dataset[label_column]
    if any(value is None for value in values):
        raise TrainingInputError(f"Column {label_column!r} has missing labels; fill or drop those rows.")
    return values


def build_label_mapping(train_labels: list, existing: dict | None = None) -> dict[str, int]:
    """``label2id`` keyed by the label's string form: ``existing`` (a loaded model's mapping) when it
    covers exactly these labels, else the labels in sorted order."""
    names = sorted(set(train_labels), key=lambda value: (str(type(value)), value))
    keys = [str(name) for name in names]
    if existing and set(existing) == set(keys):
        return dict(existing)
    return {key: index for index, key in enumerate(keys)}


def classification_datasets(
    raw: DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    args: argparse.Namespace,
    accelerator,
    label2id: dict[str, int],
    max_length: int,
) -> DatasetDict:
    """Tokenized (truncated, unpadded) texts with integer ``labels``."""
    label_column = args.label_column_name
    text_column = select_text_column(raw["train"], args.text_column_name, exclude=(label_column,))
    pair_column = args.text_pair_column_name
    if pair_column is not None:
        check_column(raw["train"], pair_column, "--text_pair_column_name")
    for split, dataset in raw.items():
        check_column(dataset, text_column, "--text_column_name")
        for column in (text_column, pair_column) if pair_column else (text_column,):
            missing = [row for row, text in enumerate(dataset[column]) if not isinstance(text, str)]
            if missing:
                rows = ", ".join(str(row) for row in missing[:5]) + (" ..." if len(missing) > 5 else "")
                raise TrainingInputError(
                    f"Column {column!r} of the {split} data has {len(missing)} empty or non-text cell(s) (rows "
                    f"{rows}); fill or drop those rows."
                )
        unseen = {str(value) for value in label_values(dataset, label_column)} - set(label2id)
        if unseen:
            raise TrainingInputError(
                f"The {split} data has labels the training data lacks: {sorted(unseen)}; the model's labels are "
                f"{sorted(label2id)}."
            )
    label_feature = raw["train"].features[label_column]

    def preprocess(batch):
        pairs = (batch[text_column], batch[pair_column]) if pair_column else (batch[text_column],)
        with _QuietLengthWarning():
            encoded = tokenizer(*pairs, truncation=True, max_length=max_length)
        labels = batch[label_column]
        if isinstance(label_feature, ClassLabel):
            labels = [label_feature.int2str(value) for value in labels]
        encoded["labels"] = [label2id[str(value)] for value in labels]
        return encoded

    return _limit_samples(_tokenize_splits(raw, preprocess, args, accelerator), args)
