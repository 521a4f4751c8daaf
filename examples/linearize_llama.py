"""Give a Llama-family checkpoint (Llama, Mistral, Qwen2 / Qwen3, Gemma3) Performer attention, keep its class and
weights, and generate beside the source: the sparse method (the default) with plain ``generate()``, the hybrid and
FAVOR+ with their constant-size ``PerformerCache``.

    python examples/linearize_llama.py path/to/llama-folder out/llama-performer --prompt "The Python language is"

The three lines that matter are the three after ``# the conversion``.
"""

import argparse
import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import performer_hf
from performer_hf import PerformerCache
from performer_hf.integrations import CACHE_KEYWORD

logger = logging.getLogger("linearize_llama")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a transformers checkpoint folder of a supported architecture")
    parser.add_argument("output_dir")
    parser.add_argument("--method", choices=["sparse", "hybrid", "favor"], default="sparse")
    parser.add_argument("--prompt", default="The Python programming language is")
    parser.add_argument("--max-new-tokens", type=int, default=30)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    # the conversion
    performer_hf.convert(args.source, args.output_dir, method=args.method, overwrite=args.overwrite)
    model = AutoModelForCausalLM.from_pretrained(args.output_dir)  # the source class, Performer attention
    # the sparse method reads generate()'s own cache in place; the others keep a constant-size state
    options = {} if args.method == "sparse" else {CACHE_KEYWORD: PerformerCache(model.config)}

    tokenizer = AutoTokenizer.from_pretrained(args.source)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    source = AutoModelForCausalLM.from_pretrained(args.source)
    arms = (("source", source, {}), (model.config._attn_implementation, model, options))
    for name, candidate, options in arms:
        with torch.no_grad():
            generated = candidate.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **options)
        logger.info("%s: %r", name, tokenizer.decode(generated[0, inputs.input_ids.shape[1] :]))


if __name__ == "__main__":
    main()
