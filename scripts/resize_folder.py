"""A training copy of an image folder with each image's longer side capped (fewer pixels to decode):

    python scripts/resize_folder.py data/imagenet data/imagenet-512 --max-side 512

The code is `vit.tools.resize_folder`; installed (`pip install -e .`), the same command is `vit-resize-folder`.
"""

from vit.tools.resize_folder import cli

if __name__ == "__main__":
    cli()
