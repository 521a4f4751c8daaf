"""The remote-code bundle: exactly the files a saved Performer checkpoint ships, so that
``from_pretrained(folder, trust_remote_code=True)`` works where performer_hf is not installed
(``tests/modeling/test_remote_code_bundle.py`` checks that a checkpoint carries every ``.py`` file here, and
nothing else).

Flat on purpose: transformers' remote-code loader follows only ``from .x import y`` imports of sibling
files, so these modules import only each other (and torch / transformers), never the rest of the package.

- ``configuration_performer.py`` / ``modeling_performer.py``: the config and the model classes;
- ``attention_methods.py``: the attention-method registry (exact, FAVOR+, hybrid);
- ``favor_*.py``, ``causal_scan.py``: the tensor kernels (projections, feature maps, FAVOR+, hybrid);
- ``cache_performer.py``: the constant-size decoding caches; ``cpu_kernels.py`` + ``csrc/``: the compiled
  CPU kernel of hybrid attention (built on first use; not shipped, so remote code takes the PyTorch path).
"""
