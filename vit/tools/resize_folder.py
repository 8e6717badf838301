"""The `vit-resize-folder` command (`scripts/resize_folder.py`): a training copy of an image folder
with each image's longer side capped, so that there are fewer pixels to decode per image.

    python scripts/resize_folder.py data/imagenet data/imagenet-512 --max-side 512

Decoding costs about in proportion to the pixels, and a random resized crop to 224 rarely needs more
than ~512 of them a side (FFCV stores ImageNet at a max side of 256-512 for the same reason). Every
image is decoded as training decodes it (vit.data.images.read_rgb); those within the cap are then
copied byte for byte, larger ones resized (Lanczos) and saved as JPEG at `--quality` (PNGs stay
PNGs). Every other file and the folder layout are copied as they are, so the copy is read as the
original is (`--data.root` the copy). A file that is not a readable image stops the run naming it,
or, with `--skip-corrupt`, is left out and listed at the end.

The copy records its `--max-side` and `--quality` in DST/.resize_folder.json (hidden: the image folder
scan never reads it), written before its first file. Files already in the copy are kept, so a
stopped run goes on where it stopped; a rerun with another cap or quality is refused before any
work (the kept files would keep the first cap, and a size that depends on the class is a shortcut a
classifier learns), as is a non-empty DST without the record. `--workers` and `--skip-corrupt` may
change. Each file is written to a temporary name and renamed; one that cannot be written (a full
disk) stops the run naming it, its temporary file removed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from PIL import Image

from vit.data.images import DECODE_ERRORS, IMAGE_EXTENSIONS, CorruptImageError, read_rgb, undecodable
from vit.tools.args import image_copy_parser, run_command

RECORD = ".resize_folder.json"  # at the copy's root, hidden: how it was made ({"max_side", "quality"})


def resize_file(source: Path, target: Path, max_side: int, quality: int) -> str:
    """Write `target` from `source`: "copied" (within the cap, or not an image), "resized" or "kept"
    (there already). An image is decoded first, within the cap too: CorruptImageError naming it."""
    if target.exists():
        return "kept"
    resized = None
    # Training never reads a hidden file (e.g. macOS's "._x.jpg" resource forks): copied as it is.
    if source.name.lower().endswith(IMAGE_EXTENSIONS) and not source.name.startswith("."):
        resized = shrunk(read_rgb(source), max_side, quality, png=source.suffix.lower() == ".png")
    if resized is None:
        replace_with(target, lambda tmp: shutil.copyfile(source, tmp))  # the original bytes
    else:
        replace_with(target, lambda tmp: tmp.write_bytes(resized))
    return "copied" if resized is None else "resized"


def capped(source: Path, max_side: int, quality: int) -> bytes | None:
    """The image file `source` re-encoded with its longer side at `max_side` (Lanczos; PNGs stay PNGs,
    others become JPEGs at `quality`), or None when its header says it is within the cap (then it is
    not decoded here). CorruptImageError naming the file if it cannot be read."""
    try:
        with Image.open(source) as image:
            width, height = image.size
    except DECODE_ERRORS as e:
        raise undecodable(str(source), e) from e
    if max(width, height) <= max_side:
        return None
    # RGB uint8, any mode converted as training reads it; raises CorruptImageError
    return shrunk(read_rgb(source), max_side, quality, png=source.suffix.lower() == ".png")


def shrunk(pixels: np.ndarray, max_side: int, quality: int, png: bool) -> bytes | None:
    """`pixels` (H, W, 3) resized to a longer side of `max_side` (Lanczos) and encoded as PNG or as
    JPEG at `quality`, or None when they are within the cap."""
    height, width = pixels.shape[:2]
    if max(width, height) <= max_side:
        return None
    scale = max_side / max(width, height)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    resized = Image.fromarray(pixels).resize(size, Image.LANCZOS, reducing_gap=3.0)
    buffer = io.BytesIO()
    if png:
        resized.save(buffer, "PNG")
    else:
        resized.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def temporary(target: Path) -> Path:
    return target.with_name(f".{target.name}.tmp")


def replace_with(target: Path, write: Callable[[Path], object]) -> None:
    """`write` a temporary file, then rename it to `target`: a stopped run leaves no half-written
    target, a failed write no temporary file, and its error names `target`."""
    tmp = temporary(target)
    try:
        with writing(str(target)):
            target.parent.mkdir(parents=True, exist_ok=True)
            write(tmp)
            os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def writing(what: str) -> Iterator[None]:
    """An OSError inside names `what` (a full disk said only "[Errno 28] No space left on device")."""
    try:
        yield
    except OSError as e:
        if e.errno is None:
            raise OSError(f"cannot write {what}: {e}") from e
        raise OSError(e.errno, f"cannot write {what}: {e.strerror or e}") from e


def options(max_side: int, quality: int) -> str:
    return f"--max-side {max_side} --quality {quality}"


def check_copy(target: Path, max_side: int, quality: int) -> None:
    """Refuse, before any work, a copy made with another cap or quality (the files kept would mix
    two) or a folder in the way whose settings are unknown; a new copy gets its record first, so a
    run stopped after any file has left it."""
    record, asked = target / RECORD, {"max_side": max_side, "quality": quality}
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} is a file, not a folder: write the copy elsewhere")
    if record.is_file():
        try:
            made = json.loads(record.read_text())
            made = {key: made[key] for key in asked}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{record} cannot be read ({e}): delete {target} to make the copy again") from e
        if made != asked:
            raise ValueError(
                f"{target} is a copy made with {options(**made)}, not {options(**asked)}: run with its options, "
                "delete it to make it again with yours, or write the copy elsewhere"
            )
        return
    if target.is_dir() and any(target.iterdir()):
        raise ValueError(
            f"{target} is not empty and has no {RECORD} recording how it was made (a copy by an older version "
            "of this command, or another folder): delete it, or write the copy elsewhere"
        )
    replace_with(record, lambda tmp: tmp.write_text(json.dumps(asked) + "\n"))


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
    check_copy(target, max_side, quality)
    jobs = []
    for directory, subdirs, names in os.walk(source, followlinks=True):
        subdirs.sort()
        for name in sorted(names):
            path = Path(directory) / name
            if name == RECORD and path.parent == source:  # a copy of a copy: the target has its own record
                continue
            jobs.append((path, target / path.relative_to(source), max_side, quality, skip_corrupt))
    outcomes: dict[str, list[str]] = {"copied": [], "resized": [], "kept": [], "corrupt": []}
    try:
        if workers > 1:
            with get_context("spawn").Pool(workers) as pool:
                results = pool.imap_unordered(_job, jobs, chunksize=32)
                for outcome, what in results:
                    outcomes[outcome].append(what)
        else:
            for job in jobs:
                outcome, what = _job(job)
                outcomes[outcome].append(what)
    except BaseException:
        for job in jobs:  # the workers stopped mid-file (another's error, Ctrl-C) left their temporary files
            with contextlib.suppress(OSError):
                temporary(job[1]).unlink(missing_ok=True)
        raise
    return outcomes


def main(argv: list[str] | None = None) -> dict[str, list[str]]:
    parser = image_copy_parser(__doc__, "where the copy goes (e.g. data/imagenet-512)", max_side=512)
    args = parser.parse_args(argv)
    outcomes = resize_folder(args.source, args.target, args.max_side, args.quality, args.workers, args.skip_corrupt)
    counts = ", ".join(f"{len(v)} {k}" for k, v in outcomes.items() if v) or "no files"
    print(f"{args.target}: {counts} (longer side at most {args.max_side}, JPEG quality {args.quality})")
    for reason in outcomes["corrupt"]:
        print(f"  left out: {reason}", file=sys.stderr)
    return outcomes


def cli() -> None:
    run_command(main)


if __name__ == "__main__":
    cli()
