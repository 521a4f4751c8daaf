"""Convert a BERT / RoBERTa / GPT-2 checkpoint into a Performer: the same as `performer-hf convert`.

python conversion/convert_checkpoint.py SOURCE OUTPUT_DIR [--nb-features 256] [--max-position-embeddings 4096] ...
"""

import sys

from performer_hf.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
