"""The `vit-resize-folder` command (`scripts/resize_folder.py`): a training copy of an image folder
with each image's longer side capped, so that there are fewer pixels to decode per image.

    python scripts/resize_folder.py data/imagenet data/imagenet-512 --max-side 512

Decoding costs about in proportion to the pixels, and a random resized crop to 224 rarely needs more
than ~512 of them a side (FFCV stores ImageNet at a max side of 256-512 for the same reason). Images
within the cap are copied byte for byte; larger ones are resized (Lanczos) and saved as JPEG at
`--quality` (PNGs stay PNGs). Every other file and the folder layout are copied as they are, so the
copy is read as the original is (`--data.root` the copy). Files already in the copy are kept, so an
interrupted conversion goes on where it stopped; each file is written to a temporary name and
renamed. A file that is not a readable image stops the run naming it, or, with `--skip-corrupt`, is
left out and listed at the end.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from multiprocessing import get_context
from pathlib import Path

from PIL import Image

from vit.data.images import IMAGE_EXTENSIONS, CorruptImageError, read_rgb
from vit.tools.args import image_copy_parser, run_command


def resize_file(source: Path, target: Path, max_side: int, quality: int) -> str:
    """Write `target` from `source`: "copied" (within the cap, or not an image), "resized" or "kept" (there already)."""
    if target.exists():
        return "kept"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    resized = capped(source, max_side, quality) if source.name.lower().endswith(IMAGE_EXTENSIONS) else None
    if resized is None:
        shutil.copyfile(source, tmp)
    else:
        tmp.write_bytes(resized)
    os.replace(tmp, target)
    return "copied" if resized is None else "resized"


def capped(source: Path, max_side: int, quality: int) -> bytes | None:
    """The image file `source` re-encoded with its longer side at `max_side` (Lanczos; PNGs stay PNGs,
    others become JPEGs at `quality`), or None when it is within the cap. CorruptImageError naming
    the file if it cannot be read."""
    try:
        with Image.open(source) as image:
            width, height = image.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise CorruptImageError(f"cannot decode image {source}: {e}") from e
    if max(width, height) <= max_side:
        return None
    pixels = read_rgb(source)  # RGB uint8, any mode converted as training reads it; raises CorruptImageError
    scale = max_side / max(width, height)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    resized = Image.fromarray(pixels).resize(size, Image.LANCZOS, reducing_gap=3.0)
    buffer = io.BytesIO()
    if source.suffix.lower() == ".png":
        resized.save(buffer, "PNG")
    else:
        resized.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _job(args: tuple[Path, Path, int, int, bool]) -> tuple[str, str]:
    source, target, max_side, quality, skip_corrupt = args
    try:
        return resize_file(source, target, max_side, quality), str(source)
    except CorruptImageError as e:
        if not skip_corrupt:
            raise
        return "corrupt", str(e)


def resize_folder(
    source: str | Path, target: str | Path, max_side: int, quality: int = 90, workers: int = 1,
    skip_corrupt: bool = False,
) -> dict[str, list[str]]:  # fmt: skip
    """Copy `source` into `target` with every image's longer side at most `max_side`; what happened
    to each file, by outcome ("copied", "resized", "kept", "corrupt")."""
    source, target = Path(source), Path(target)
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is not a folder")
    if target.resolve().is_relative_to(source.resolve()):
        raise ValueError(f"{target} is inside {source}: write the copy elsewhere")
    jobs = []
    for directory, subdirs, names in os.walk(source, followlinks=True):
        subdirs.sort()
        for name in sorted(names):
            path = Path(directory) / name
            jobs.append((path, target / path.relative_to(source), max_side, quality, skip_corrupt))
    outcomes: dict[str, list[str]] = {"copied": [], "resized": [], "kept": [], "corrupt": []}
    if workers > 1:
        with get_context("spawn").Pool(workers) as pool:
            results = pool.imap_unordered(_job, jobs, chunksize=32)
            for outcome, what in results:
                outcomes[outcome].append(what)
    else:
        for job in jobs:
            outcome, what = _job(job)
            outcomes[outcome].append(what)
    return outcomes


def main(argv: list[str] | None = None) -> dict[str, list[str]]:
    parser = image_copy_parser(__doc__, "where the copy goes (e.g. data/imagenet-512)", max_side=512)
    args = parser.parse_args(argv)
    outcomes = resize_folder(args.source, args.target, args.max_side, args.quality, args.workers, args.skip_corrupt)
    counts = ", ".join(f"{len(v)} {k}" for k, v in outcomes.items() if v)
    print(f"{args.target}: {counts} (longer side at most {args.max_side})")
    for reason in outcomes["corrupt"]:
        print(f"  left out: {reason}", file=sys.stderr)
    return outcomes


def cli() -> None:
    run_command(main)


if __name__ == "__main__":
    cli()
