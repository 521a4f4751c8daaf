"""The remote-code bundle: the files saved checkpoints ship, so that ``from_pretrained(folder,
trust_remote_code=True)`` works where performer_hf is not installed. A Performer-family checkpoint ships
``modeling_performer.py`` and the modules it imports; a model converted in place ships ``modeling_in_place.py`` and
the modules it imports (``tests/modeling/test_remote_code_bundle.py`` checks that, between them, they ship every
``.py`` file here).

Flat on purpose: transformers' remote-code loader follows only ``from .x import y`` imports of sibling
files, so these modules import only each other (and torch / transformers), never the rest of the package.

- ``configuration_performer.py`` / ``modeling_performer.py``: the config and the model classes, built from
  ``layers_performer.py`` (embeddings, attention, layers, heads' parts);
- ``modeling_in_place.py``: the classes of models converted in place (the source's, by name), and for them
  ``attention_interface.py`` (the attention implementations ``"performer"``, ``"performer_hybrid"`` and
  ``"performer_sparse"`` for any transformers model class), ``attention_settings.py`` (where their settings live)
  and ``interface_cache.py`` (``PerformerCache``, and plain ``generate()``'s adoption of the methods' state);
- ``attention_methods.py``: the attention-method registry (exact, FAVOR+, hybrid, sparse): each method's function
  (in ``method_exact.py``, ``method_favor.py``, ``method_hybrid.py``, ``method_sparse.py``), config fields, kernels,
  cache layer, card text and conversion presets;
- FAVOR+: ``favor_projection.py`` (random projections), ``favor_features.py`` (the feature-map registry),
  ``favor_attention.py`` (bidirectional and causal FAVOR+), ``favor_exp.py`` (its slabbed autograd functions for
  exponential features; ``favor_exp_triton.py``, the causal scan's Triton kernels for CUDA), ``favor_optimal.py``
  (FAVOR++);
- ``causal_scan.py``: the one chunked causal scan (FAVOR+ and the hybrid's far field);
- hybrid attention, ``favor_hybrid.py`` (the entry point) and its parts: ``hybrid_spec.py`` (settings and decoding
  state), ``hybrid_keys.py`` (key sets, the far field's feature context), ``hybrid_selection.py`` and
  ``hybrid_routing.py`` (each query block's exact support; ``hybrid_routing_triton.py``, routing's Triton kernel for
  CUDA), ``hybrid_exact.py`` (the exact part and the merge),
  ``hybrid_far_field.py`` (the far field), ``hybrid_causal.py`` (causal lagging and decoding), ``far_fields.py`` (the
  far-field kernel registry) with ``far_field_polynomial.py`` (and ``far_field_triton.py``, its Triton kernels for
  CUDA), ``hybrid_backends.py`` (PyTorch or compiled, one choice), ``slabs.py`` (slab sizing);
- sparse attention (causal): ``sparse_spec.py`` (settings and decoding state), ``sparse_attention.py`` (window,
  first tokens and the key blocks each query selects, exact softmax);
- ``cache_performer.py``: the methods' decoding caches; ``cpu_kernels.py`` + ``csrc/``: the compiled CPU kernels
  of hybrid attention (built on first use; not shipped, so remote code takes the PyTorch path), and
  ``hybrid_compiled.py``, their autograd functions.
"""
