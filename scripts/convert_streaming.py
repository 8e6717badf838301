"""An image folder written as litdata chunks, for `--data vit.data.StreamingDataModule`:

    python scripts/convert_streaming.py data/imagenet data/imagenet-streaming --max-side 512

The code is `vit.tools.convert_streaming`; installed (`pip install -e .`), the same command is `vit-convert-streaming`.
"""

from vit.tools.convert_streaming import cli

if __name__ == "__main__":
    cli()
