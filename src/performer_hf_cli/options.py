# ruff: noqa: E501 (written by performer_hf.cli.write_options(): one line per option)
"""What the command line's front (``performer_hf_cli``) knows of performer_hf without importing it. Written
by ``performer_hf.cli.write_options()``; do not edit."""

METHODS = ("favor", "hybrid", "sparse")
DEFAULT_METHOD = "hybrid"
DEFAULT_IN_PLACE_METHOD = "sparse"
SUPPORTED_ARCHITECTURES = (
    "BertModel",
    "BertForMaskedLM",
    "BertForPreTraining",
    "BertForSequenceClassification",
    "RobertaModel",
    "RobertaForMaskedLM",
    "RobertaForSequenceClassification",
    "GPT2Model",
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
# (PerformerConfig field, option type, help) of each field with an option of its own
CONFIG_OPTIONS = [
    (
        "attention_kernel",
        "str",
        "FAVOR+ kernel, hybrid far field (softmax_opt = FAVOR++, poly2, ...) or exact (default softmax; hybrid poly2; causal softmax_opt)",
    ),
    ("nb_features", "int", "random features per head (default 256)"),
    ("feature_coupling", "str", "orthogonal, simplex or iid (default orthogonal)"),
    ("feature_row_norms", "str", "chi (unbiased) or sqrt_d (default chi)"),
    ("projection_seed", "int", "seed of the random features (default 0)"),
    ("feature_redraw_interval", "int", "optimizer steps between feature redraws in training (None: never)"),
    ("causal_chunk_size", "int", "positions per chunk of the causal scan (default 128)"),
    (
        "exact_max_length",
        "int",
        "bidirectional: inputs of at most this many tokens keep exact attention; causal: the first this many positions attend exactly; 0: never (default 0; hybrid 2048; causal 4096)",
    ),
    (
        "local_window",
        "int",
        "hybrid, sparse: keys around (sparse: before) each query computed exactly (default 0; hybrid 17; causal 64; sparse (Llama & co.) 512)",
    ),
    (
        "num_global_tokens",
        "int",
        "hybrid, sparse: first tokens attended exactly by every query (default 0; hybrid 1; sparse (Llama & co.) 4)",
    ),
    (
        "routed_blocks",
        "int",
        "hybrid, bidirectional: key blocks per query block chosen by content (default 0; hybrid 24; causal 0)",
    ),
    ("route_block_size", "int", "hybrid: keys per routed block (default 8)"),
    (
        "route_group_size",
        "int",
        "hybrid: key blocks per routing group, scored together first (0: every block) (default 0; hybrid 16; causal 0)",
    ),
    ("query_block_size", "int", "hybrid: queries per routing block (default 16)"),
    ("center_features", "bool", "hybrid: centre queries and keys before the far field (default False; hybrid True)"),
    ("far_field_parameter", "float", "hybrid: FAVOR++'s A for attention_kernel softmax_opt (None: closed form)"),
    ("far_field_gain", "float", "hybrid: a factor on the far-field kernel against the exact support"),
    ("select_block_size", "int", "sparse: keys per selectable block (default 64)"),
    (
        "select_blocks",
        "int",
        "sparse: earlier key blocks each query selects and reads exactly (default 0; sparse (Llama & co.) 8)",
    ),
    (
        "select_budget",
        "int",
        "sparse: key blocks kept once they leave the window (0: every block) (default 0; sparse (Llama & co.) 16)",
    ),
    (
        "select_ranking",
        "str",
        "sparse, with select_budget: keep the blocks of most attention in the window (window, causal) or from each call's last queries (latest: the prompt's end chooses, as SnapKV) (default window; sparse (Llama & co.) latest)",
    ),
    ("max_position_embeddings", "int", "tokens the model reads; the pretrained position table is tiled to fill it"),
]
