"""Argument types for the commands' parsers: a value out of range is a one-line usage error
naming the option, not a traceback from deep inside the run (`--batch-size 0` used to end in
"range() arg 3 must not be zero", `--temperature nan` in a sampling error)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 0, got {text}")
    return value


def jpeg_quality(text: str) -> int:
    """libjpeg's quality scale: PIL takes any number and clamps it, so 200 would be 100, unsaid."""
    value = int(text)
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 100 (JPEG quality), got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def image_files(paths: list[str]) -> list[Path]:
    """A command's IMAGES: files as given, folders searched recursively for images (sorted), in the
    order given. A path that does not exist, or a folder without images, is an error naming it. A
    broken or looping link with an image's name is kept, given or found, so that reading it names it."""
    from vit.data.images import IMAGE_EXTENSIONS  # vit.data loads Lightning: only for the commands that read images

    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if (f.is_file() or (f.is_symlink() and not f.exists())) and f.suffix.lower() in IMAGE_EXTENSIONS
            )
            if not found:
                raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {p}")
            files += found
        elif p.is_file() or p.is_symlink():  # a broken link is read, and reported, as a corrupt image
            files.append(p)
        else:
            raise FileNotFoundError(f"image {p} does not exist")
    return files


def image_copy_parser(doc: str, target_help: str, max_side: int | None) -> argparse.ArgumentParser:
    """The options of the commands that write a copy of an image folder (resize_folder,
    convert_streaming): SOURCE TARGET, the size cap, JPEG quality, workers, skipping corrupt files."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="the image folder (e.g. data/imagenet)")
    parser.add_argument("target", type=Path, help=target_help)
    cap = f" (default {max_side})" if max_side else " (default: no cap)"
    parser.add_argument("--max-side", type=positive_int, default=max_side, help="longest side in pixels" + cap)
    parser.add_argument("--quality", type=jpeg_quality, default=90, help="JPEG quality of resized images, 1-100")
    parser.add_argument("--workers", type=positive_int, default=max(1, (os.cpu_count() or 1) - 1))
    parser.add_argument("--skip-corrupt", action="store_true", help="leave unreadable images out and list them")
    return parser


def run_command(main: Callable[[], Any]) -> None:
    """A command's entry point: what it cannot read or write (a missing folder, a corrupt image)
    ends it with a one-line error and exit status 1."""
    try:
        main()
    except (OSError, ValueError) as e:  # CorruptImageError is a ValueError
        sys.exit(f"error: {e}")
