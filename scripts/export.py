"""Export a model to ONNX (dynamic batch and image size) and check it with onnxruntime against PyTorch:

    python scripts/export.py runs/cifar10_vit/checkpoints/last.ckpt --out vit.onnx

The code is `vit.tools.export` (`--help` lists the options); installed, the same command is `vit-export`.
"""

from vit.tools.export import cli

if __name__ == "__main__":
    cli()
