"""Speed benchmarks: our ViTs against timm's, attention, ResNets, data loading: `vit.tools.benchmark`.

Installed (`pip install -e .`, as `make` does), the same command is `vit-bench`; `--help` lists the options.
"""

from vit.tools.benchmark import cli

if __name__ == "__main__":
    cli()
