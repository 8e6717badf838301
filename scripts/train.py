"""Train, validate, test or predict with any model and datamodule, configured by YAML.

    python scripts/train.py fit --config configs/default.yaml
    python scripts/train.py fit --config configs/cifar10_vit.yaml --model.lr 3e-4 --trainer.max_epochs 5
    python scripts/train.py fit --config configs/cifar10_vit.yaml --ckpt_path last     # resume
    python scripts/train.py fit --config configs/default.yaml --print_config          # resolved config

A LightningCLI: `model:` and `data:` name a class (class_path) and its arguments (init_args),
`trainer:` holds Trainer arguments, `checkpoint:` the ModelCheckpoint options.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from vit.cli import main

if __name__ == "__main__":
    main()
