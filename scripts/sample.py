"""Generate text from a trained character GPT: `vit.tools.sample`.

Installed (`pip install -e .`, as `make` does), the same command is `vit-sample`; `--help` lists the options.
"""

from vit.tools.sample import cli

if __name__ == "__main__":
    cli()
