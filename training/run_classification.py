#!/usr/bin/env python
"""Sequence classification finetuning of a Performer, driven by Accelerate.

    python training/run_classification.py --train_file train.csv --validation_file dev.csv \
        --text_column_name sentence --label_column_name label --model_name_or_path PERFORMER_DIR --output_dir out
    accelerate launch --multi_gpu --num_processes 2 training/run_classification.py ...

Arguments follow transformers' run_glue_no_trainer.py; see training/README.md and --help.
"""

from performer_hf.training.classification import main
from performer_hf.training.trainer import configure_script_logging

if __name__ == "__main__":
    configure_script_logging()
    main()
