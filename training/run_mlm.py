#!/usr/bin/env python
"""Masked language modeling with a Performer, driven by Accelerate.

    python training/run_mlm.py --train_file corpus.txt --tokenizer_name TOKENIZER \
        --config_overrides num_hidden_layers=6,hidden_size=384 --output_dir out
    accelerate launch --multi_gpu --num_processes 2 training/run_mlm.py ...

Arguments follow transformers' run_mlm_no_trainer.py; see training/README.md and --help.
"""

from performer_hf.training.language_modeling import main
from performer_hf.training.trainer import configure_script_logging

if __name__ == "__main__":
    configure_script_logging()
    main("mlm")
