"""Train, validate, test or predict with any model and datamodule, configured by YAML.

    python scripts/train.py fit --config configs/default.yaml
    python scripts/train.py fit --config configs/cifar10_vit.yaml --model.optimizer.lr 3e-4 --trainer.max_epochs 5
    python scripts/train.py fit --config configs/cifar10_vit.yaml --ckpt_path last     # resume
    python scripts/train.py fit --config configs/default.yaml --print_config          # resolved config

A LightningCLI: `model:` and `data:` name a class (class_path) and its arguments (init_args),
`trainer:` holds Trainer arguments, `checkpoint:` the ModelCheckpoint options. The code is
`vit.cli`; installed (`pip install -e .`, as `make` does), the same command is `vit-train`.
"""

from vit.tools.train import cli

if __name__ == "__main__":
    cli()
