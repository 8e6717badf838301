"""Export attention-rollout maps (PNG panels, .npy maps, an index.html gallery): `vit.tools.rollout`.

Installed (`pip install -e .`, as `make` does), the same command is `vit-rollout`; `--help` lists the options.
"""

from vit.tools.rollout import cli

if __name__ == "__main__":
    cli()
