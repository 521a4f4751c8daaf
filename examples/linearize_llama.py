"""Give a Llama-family checkpoint (Llama, Mistral, Qwen2 / Qwen3, Gemma3) Performer attention, keep its class and
weights, and generate beside the source with plain ``generate()``: each method decodes from its own state (the sparse
default's window and 16 kept key blocks; the hybrid's and FAVOR+'s constant-size state), which takes the key/value
cache's place after the prompt.

    python examples/linearize_llama.py path/to/llama-folder out/llama-performer --prompt "The Python language is"

The three lines that matter are the three after ``# the conversion``.
"""

import argparse
import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import performer_hf

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

    tokenizer = AutoTokenizer.from_pretrained(args.source)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    source = AutoModelForCausalLM.from_pretrained(args.source)
    for name, candidate in (("source", source), (model.config._attn_implementation, model)):
        with torch.no_grad():
            generated = candidate.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        logger.info("%s: %r", name, tokenizer.decode(generated[0, inputs.input_ids.shape[1] :]))


if __name__ == "__main__":
    main()
