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
scan never reads it), written before its first file, and there too, last, each source file's size
and modification time when its copy was made. A rerun brings the copy up to date with the source:
a file that is new, or whose size or time changed, is made again; a copy whose source is gone (moved
to another class, removed) is removed, but only one the record lists: a file DST holds that this
command did not write is named and left; the others are kept, so a stopped run goes on where it
stopped. A copy that the record does not list with its source's size and time (one written by a
stopped run after the record, or by an older version of this command, which recorded no files) is
kept when it is newer than its source, made again when older; an older version's copy holding a
file with no source is refused (it may be a moved image's old copy) until that file is deleted.
A rerun with another cap or quality is refused before any work (the kept files would keep the first
cap, and a size that depends on the class is a shortcut a classifier learns), as is a non-empty DST
without the record. `--workers` and `--skip-corrupt` may change. Each file is written to a temporary
name and renamed; one that cannot be written (a full disk) stops the run naming it, its temporary
file removed.
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

# At the copy's root, hidden: how it was made and from what, {"max_side", "quality", "files": {relative
# path: [size, mtime_ns] of the source the copy was made from, or null: a copy a stopped run may have
# written}}; "files" is missing in the records of older versions.
RECORD = ".resize_folder.json"
OUTCOMES = ("copied", "resized", "removed", "kept", "corrupt")  # what the summary counts, in its order

Files = dict[str, list[int] | None]


def source_stat(path: Path) -> list[int]:
    """[size, mtime_ns] of the file `path` (of a broken link: the link's own; reading it names it)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        stat = path.lstat()
    return [stat.st_size, stat.st_mtime_ns]


def resize_file(source: Path, target: Path, max_side: int, quality: int) -> str:
    """Write `target` from `source`, replacing it: "copied" (within the cap, or not an image) or
    "resized". An image is decoded first, within the cap too: CorruptImageError naming it."""
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


def check_copy(target: Path, max_side: int, quality: int) -> Files | None:
    """Refuse, before any work, a copy made with another cap or quality (the files kept would mix
    two) or a folder in the way whose settings are unknown; a new copy gets its record first, so a
    run stopped after any file has left it. The files the record lists (see RECORD), None when it
    lists none (an older version wrote it)."""
    record, asked = target / RECORD, {"max_side": max_side, "quality": quality}
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} is a file, not a folder: write the copy elsewhere")
    if record.is_file():
        try:
            made = json.loads(record.read_text())
            files = made.get("files")
            made = {key: made[key] for key in asked}
            if files is not None and not isinstance(files, dict):
                raise TypeError(f"its files are a {type(files).__name__}, not a mapping")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{record} cannot be read ({e}): delete {target} to make the copy again") from e
        if made != asked:
            raise ValueError(
                f"{target} is a copy made with {options(**made)}, not {options(**asked)}: run with its options, "
                "delete it to make it again with yours, or write the copy elsewhere"
            )
        return files
    if target.is_dir() and any(target.iterdir()):
        raise ValueError(
            f"{target} is not empty and has no {RECORD} recording how it was made (a copy by an older version "
            "of this command, or another folder): delete it, or write the copy elsewhere"
        )
    write_record(target, max_side, quality, {})
    return {}


def write_record(target: Path, max_side: int, quality: int, files: Files) -> None:
    record = {"max_side": max_side, "quality": quality, "files": files}
    replace_with(target / RECORD, lambda tmp: tmp.write_text(json.dumps(record) + "\n"))


def source_files(source: Path) -> tuple[dict[str, tuple[Path, list[int]]], set[str]]:
    """The files under `source` by relative path, each with its [size, mtime_ns] taken before it
    is read (a file changed during the run is made again by the next), and its folders."""
    files, folders = {}, set()
    for directory, subdirs, names in os.walk(source, followlinks=True):
        subdirs.sort()
        folders.update((Path(directory) / d).relative_to(source).as_posix() for d in subdirs)
        for name in sorted(names):
            path = Path(directory) / name
            if name == RECORD and path.parent == source:  # a copy of a copy: the target has its own record
                continue
            files[path.relative_to(source).as_posix()] = (path, source_stat(path))
    return files, folders


def copied_files(target: Path, ours: Callable[[str], bool]) -> set[str]:
    """The files under `target` by relative path, but its record; the temporary files a killed run
    left beside a file that is `ours` are removed."""
    found = set()
    for directory, _, names in os.walk(target):
        for name in names:
            relative = (Path(directory) / name).relative_to(target).as_posix()
            if relative in (RECORD, temporary(Path(RECORD)).as_posix()):
                continue
            if name.startswith(".") and name.endswith(".tmp") and ours((Path(relative).parent / name[1:-4]).as_posix()):
                (Path(directory) / name).unlink(missing_ok=True)
                continue
            found.add(relative)
    return found


def up_to_date(copy: Path, stat: list[int], recorded: list[int] | None) -> bool:
    """Whether `copy` was made from its source as it is now (`stat`): by the record, or, where the
    record has no entry (a stopped run's file, an older version's copy), by the copy being newer."""
    if recorded is not None:
        return recorded == stat
    return copy.stat().st_mtime_ns >= stat[1]


def remove_copy(target: Path, relative: str, folders: set[str]) -> None:
    """Remove the copy `relative` and the folders it leaves empty that the source no longer has
    (an empty class folder is still a class)."""
    path = target / relative
    with writing(str(path)):
        path.unlink()
    parent = Path(relative).parent
    while parent != Path(".") and parent.as_posix() not in folders:
        try:
            (target / parent).rmdir()
        except OSError:  # not empty: it holds other files
            break
        parent = parent.parent


def _job(args: tuple[str, Path, Path, int, int, bool]) -> tuple[str, str, str]:
    relative, source, target, max_side, quality, skip_corrupt = args
    try:
        return relative, resize_file(source, target, max_side, quality), str(source)
    except CorruptImageError as e:
        if not skip_corrupt:
            raise
        return relative, "corrupt", str(e)


def resize_folder(
    source: str | Path, target: str | Path, max_side: int, quality: int = 90, workers: int = 1,
    skip_corrupt: bool = False,
) -> dict[str, list[str]]:  # fmt: skip
    """Copy `source` into `target` with every image's longer side at most `max_side`, or bring such
    a copy up to date; what happened, by outcome: "copied", "resized", "kept" (source files),
    "removed" (copies), "corrupt" (reasons) and "unknown" (files of `target` this command did not
    write, left as they are)."""
    source, target = Path(source), Path(target)
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is not a folder")
    if target.resolve().is_relative_to(source.resolve()):
        raise ValueError(f"{target} is inside {source}: write the copy elsewhere")
    recorded = check_copy(target, max_side, quality)
    sources, folders = source_files(source)
    listed = recorded or {}
    copies = copied_files(target, lambda relative: relative in sources or relative in listed)
    outcomes: dict[str, list[str]] = {outcome: [] for outcome in (*OUTCOMES, "unknown")}
    files: Files = {}  # the record once this run is done
    jobs = []
    for relative, (path, stat) in sources.items():
        if relative in copies and up_to_date(target / relative, stat, listed.get(relative)):
            outcomes["kept"].append(str(path))
            files[relative] = stat
        else:
            jobs.append((relative, path, target / relative, max_side, quality, skip_corrupt))
    gone = sorted(copies - sources.keys())
    if recorded is None and gone:
        raise ValueError(
            f"{target} was made by an older version of this command, which recorded no files, and has {len(gone)} "
            f"file(s) with no source (e.g. {target / gone[0]}): copies of images since moved or removed, or files of "
            "your own; delete or move them, then run again"
        )
    outcomes["unknown"] = [str(target / relative) for relative in gone if relative not in listed]
    # A stopped run leaves its files listed (null: made from an unknown state), so the next run
    # knows them for its own: removes them if their source is gone, judges them by their time.
    started = {**listed, **{job[0]: listed.get(job[0]) for job in jobs}}
    if started != recorded:
        write_record(target, max_side, quality, started)
    for relative in gone:
        if relative in listed:
            remove_copy(target, relative, folders)
            outcomes["removed"].append(str(target / relative))
    for folder in sorted(folders):  # an empty class folder is still a class
        (target / folder).mkdir(parents=True, exist_ok=True)

    def done(relative: str, outcome: str, what: str) -> None:  # a file that no longer reads loses its old copy
        outcomes[outcome].append(what)
        if outcome == "corrupt":
            (target / relative).unlink(missing_ok=True)
        else:
            files[relative] = sources[relative][1]

    try:
        if workers > 1 and jobs:
            with get_context("spawn").Pool(workers) as pool:
                for result in pool.imap_unordered(_job, jobs, chunksize=32):
                    done(*result)
        else:
            for job in jobs:
                done(*_job(job))
    except BaseException:
        for job in jobs:  # the workers stopped mid-file (another's error, Ctrl-C) left their temporary files
            with contextlib.suppress(OSError):
                temporary(job[2]).unlink(missing_ok=True)
        raise
    if files != recorded:  # last: a run stopped before this point left the record it started with
        write_record(target, max_side, quality, dict(sorted(files.items())))
    return outcomes


def main(argv: list[str] | None = None) -> dict[str, list[str]]:
    parser = image_copy_parser(__doc__, "where the copy goes (e.g. data/imagenet-512)", max_side=512)
    args = parser.parse_args(argv)
    outcomes = resize_folder(args.source, args.target, args.max_side, args.quality, args.workers, args.skip_corrupt)
    counts = ", ".join(f"{len(outcomes[k])} {k}" for k in OUTCOMES if outcomes[k]) or "no files"
    print(f"{args.target}: {counts} (longer side at most {args.max_side}, JPEG quality {args.quality})")
    for reason in outcomes["corrupt"]:
        print(f"  left out: {reason}", file=sys.stderr)
    for path in outcomes["unknown"]:
        print(f"  not written by this command, left as it is: {path}", file=sys.stderr)
    return outcomes


def cli() -> None:
    run_command(main)


if __name__ == "__main__":
    cli()
