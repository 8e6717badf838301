"""The `vit-train` command: `vit.cli`'s LightningCLI (fit, validate, test, predict from YAML
configs). `vit-train fit --config configs/default.yaml` is `python scripts/train.py fit --config ...`.
"""

from __future__ import annotations

from vit.cli import main


def cli() -> None:
    """Entry point; `main` returns the LightningCLI, which must not become the exit status."""
    main()


if __name__ == "__main__":
    cli()
