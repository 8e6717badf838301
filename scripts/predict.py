"""Predict the classes of image files with a checkpoint or its ONNX export (a table, and CSV or JSON):

    python scripts/predict.py runs/default/checkpoints/last.ckpt photos/ --top-k 3 --out preds.csv

The code is `vit.tools.predict` (`--help` lists the options); installed, the same command is `vit-predict`.
"""

from vit.tools.predict import cli

if __name__ == "__main__":
    cli()
