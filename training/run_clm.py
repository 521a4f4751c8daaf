#!/usr/bin/env python
"""Causal language modeling with a Performer, driven by Accelerate.

    python training/run_clm.py --train_file corpus.txt --model_name_or_path PERFORMER_DIR --output_dir out
    accelerate launch --multi_gpu --num_processes 2 training/run_clm.py ...

Arguments follow transformers' run_clm_no_trainer.py; see training/README.md and --help.
"""

from performer_hf.training.language_modeling import main
from performer_hf.training.trainer import configure_script_logging

if __name__ == "__main__":
    configure_script_logging()
    main("clm")
