"""The `vit-convert-streaming` command (`scripts/convert_streaming.py`): an image folder written as
litdata chunks, for `--data vit.data.StreamingDataModule` (vit.data.streaming).

    python scripts/convert_streaming.py data/imagenet data/imagenet-streaming --max-side 512
    aws s3 sync data/imagenet-streaming s3://bucket/imagenet-streaming   # for --data.root s3://...

Each split (`--splits`, default train and val) of `SOURCE/<split>/<class>/*` becomes
`TARGET/<split>/` (chunks of about `--chunk-bytes`, and an index with the class folder names and the
labels). The training split is written in a shuffled order (fixed seed), so every chunk holds a mix
of classes. Images are stored as their files' bytes or, with `--max-side`, re-encoded with the longer
side capped (as scripts/resize_folder.py does). A file that is not a readable image (`encoded`)
stops the run naming it, or, with `--skip-corrupt`, is left out and listed. A split is written to a
temporary folder (`TARGET/.<split>.tmp`) and renamed when complete, so a finished split is never half
written; the temporary folder of a split that fails (a full disk: named with the split) is removed.
A split already converted is kept; its index records `--max-side` and `--quality`, and a rerun with
others is refused before any work, as the splits would then hold images of other sizes. A split
written before these were recorded is refused beside a split converted now (delete it and convert
both in one run). A split's chunks cannot be brought up to date file by file (the training split is
shuffled across them), so a kept split whose source changed since it was written is refused before
any work, naming what changed: each split records its source images' sizes and modification times
(`TARGET/<split>/sources.json`; a split written before that is compared by time, its index against
the source's files and folders), and its class folders. `--overwrite` converts such a split again,
replacing it once the new one is complete; a split whose source is unchanged is kept. TARGET is a
local folder: copy it to object storage after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
from collections.abc import Collection
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from vit.data.images import (
    DECODE_ERRORS,
    JPEG_MAGIC,
    CorruptImageError,
    image_size,
    read_file,
    read_rgb,
    readable_class_names,
    scan_image_folder,
    undecodable,
)
from vit.data.streaming import INDEX
from vit.tools.args import image_copy_parser, run_command
from vit.tools.resize_folder import capped, source_stat, writing
from vit.wording import counted

SOURCES = "sources.json"  # in each split: {relative path of each source image: [size, mtime_ns]}


def encoded(path: Path, max_side: int | None, quality: int) -> bytes:
    """The bytes to store for the image file `path`; CorruptImageError naming it if it is not
    readable: a damaged JPEG (vit.data.images.jpeg_damage) or one whose header does not parse
    (vit.data.images.read_header: its compressed data is first decoded in training), any other
    file that does not decode (decoded here: few files are not JPEGs)."""
    data = read_file(path)  # first: a broken link named as one, a missing file not taken for a corrupt one
    if max_side is not None:
        resized = capped(path, max_side, quality)
        if resized is not None:
            return resized
    if not data.startswith(JPEG_MAGIC):
        read_rgb(data, str(path))
        return data
    try:
        image_size(data)
    except DECODE_ERRORS as e:
        raise undecodable(str(path), e) from e
    return data


def _job(args: tuple[Path, int | None, int, bool]) -> tuple[bytes | None, str]:
    path, max_side, quality, skip_corrupt = args
    try:
        return encoded(path, max_side, quality), str(path)
    except CorruptImageError as e:
        if not skip_corrupt:
            raise
        return None, str(e)


def convert_image_folder(
    source: str | Path,
    target: str | Path,
    max_side: int | None = None,
    quality: int = 90,
    workers: int = 1,
    skip_corrupt: bool = False,
    chunk_bytes: int | str = "64MB",
    splits: tuple[str, ...] = ("train", "val"),
    seed: int = 0,
    overwrite: bool = False,
) -> dict[str, dict[str, int | list[str]]]:
    """Write each split of the image folder `source` as litdata chunks under `target/<split>`; per
    split, the images written and the files left out, and "changed": what changed in the source of
    a split converted again (`overwrite`); or "kept": the images of a split already converted, and
    "options": those it was converted with, None if not recorded."""
    from litdata.streaming.writer import BinaryWriter

    if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:/", str(target)):  # s3://... (a Path has made it s3:/...)
        raise ValueError(
            f"{target} is not a local folder: convert into one, then copy it (e.g. aws s3 sync) and train "
            "with --data.root s3://..."
        )
    source, target = Path(source), Path(target)
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is not a folder")
    if target.resolve().is_relative_to(source.resolve()):
        raise ValueError(f"{target} is inside {source}: write the copy elsewhere")
    asked = stored_options(max_side, quality)
    kept = {split: converted_split(target / split) for split in splits}
    classes, _ = scan_image_folder(source / splits[0])
    changed = {split: source_changes(source, split, target / split, classes) for split in splits if kept[split]}
    changed = {split: what for split, what in changed.items() if what}
    check_kept(target, kept, asked, again=set(changed) if overwrite else set())
    if changed and not overwrite:
        split, what = next(iter(changed.items()))
        shown = ", ".join(what[:3]) + (", ..." if len(what) > 3 else "")
        raise ValueError(
            f"{len(what)} change(s) in {source / split} since {target / split} was written ({shown}): "
            f"delete {target / split} or pass --overwrite to convert it again"
        )
    names = readable_class_names(classes, source)
    report: dict[str, dict[str, int | list[str]]] = {}
    for number, split in enumerate(splits):
        if kept[split] is not None and split not in changed:
            report[split] = {"kept": kept[split][0], "options": kept[split][1]}
            continue
        _, samples = scan_image_folder(source / split, classes=classes)
        if number == 0:  # the training split, shuffled once so that each chunk mixes the classes
            samples = [samples[i] for i in np.random.default_rng(seed).permutation(len(samples))]
        # taken before the files are read: a file changed during the run is a change to the next
        sources = {stored_path(Path(s.path), source): source_stat(Path(s.path)) for s in samples}
        tmp, out, old = target / f".{split}.tmp", target / split, target / f".{split}.old"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)  # a replaced split a killed run left
        what = f"the {split} split into {tmp}"  # an OSError while writing names it (a full disk)
        try:
            with writing(what):
                tmp.mkdir(parents=True)
                writer = BinaryWriter(str(tmp), chunk_bytes=chunk_bytes)
            labels: list[int] = []
            left_out: list[str] = []
            jobs = [(Path(s.path), max_side, quality, skip_corrupt) for s in samples]
            with contextlib.ExitStack() as stack:  # in order, from a pool of `workers` processes, or here
                pool = stack.enter_context(get_context("spawn").Pool(workers)) if workers > 1 else None
                results = pool.imap(_job, jobs, chunksize=16) if pool else map(_job, jobs)
                for sample, (data, reason) in zip(samples, results, strict=True):
                    if data is None:
                        left_out.append(reason)
                        continue
                    relative = stored_path(Path(sample.path), source)
                    with writing(what):
                        writer.add_item(len(labels), {"image": data, "label": sample.label, "path": relative})
                    labels.append(sample.label)
            if not labels:
                raise ValueError(f"{source / split} has no readable images")
            with writing(what):
                writer.done()
                writer.merge()
                index = json.loads((tmp / INDEX).read_text())
                index["vit"] = {"classes": classes, "class_names": names, "labels": labels,
                                "max_side": max_side, "quality": quality}  # fmt: skip
                (tmp / INDEX).write_text(json.dumps(index))
                (tmp / SOURCES).write_text(json.dumps(dict(sorted(sources.items()))))
                if out.exists():  # converted again: the old split goes once the new one is complete
                    os.replace(out, old)
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:  # a split that failed (a full disk, Ctrl-C) starts again from nothing
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        report[split] = {"written": len(labels), "left out": left_out}
        if split in changed:
            report[split]["changed"] = changed[split]
    return report


def stored_path(path: Path, source: Path) -> str:
    """How a sample's source file is named in the chunks and in SOURCES: relative to `source`, a
    name that is not UTF-8 readable."""
    return os.fsencode(path.relative_to(source)).decode("utf-8", "backslashreplace")


def source_changes(source: Path, split: str, out: Path, classes: list[str]) -> list[str]:
    """What changed in the source of the split converted at `out` since it was written: its class
    folders, then its images moved, rewritten, added and removed, by the sizes and times its SOURCES
    recorded; a split without SOURCES (an older version wrote it): the source's files and folders
    changed after its index. Nothing to compare when the source has no such split."""
    if not (source / split).is_dir():
        return []
    before = json.loads((out / INDEX).read_text())["vit"]["classes"]
    if before != classes:  # sorted folder names: the same names give the same list
        return [f"class folder {c} added" for c in classes if c not in before] + [
            f"class folder {c} removed" for c in before if c not in classes
        ]
    _, samples = scan_image_folder(source / split, classes=classes)
    if not (out / SOURCES).is_file():
        written = (out / INDEX).stat().st_mtime_ns
        paths = {Path(s.path) for s in samples}  # and the folders: a file moved or removed changes its folder's time
        paths |= (
            {p.parent for p in paths} | {source / split} | {p for c in classes if (p := source / split / c).is_dir()}
        )
        return [f"{stored_path(p, source)} modified" for p in sorted(paths) if p.stat().st_mtime_ns > written]
    recorded: dict[str, list[int]] = json.loads((out / SOURCES).read_text())
    now = {stored_path(Path(s.path), source): source_stat(Path(s.path)) for s in samples}
    added = {path: None for path in sorted(now.keys() - recorded.keys())}
    by_file = {(Path(path).name, *now[path]): path for path in added}
    changes, removed = [], []
    for path in sorted(recorded.keys() - now.keys()):
        moved = by_file.pop((Path(path).name, *recorded[path]), None)  # the same file in another folder
        if moved is None:
            removed.append(f"{path} removed")
        else:
            changes.append(f"{path} moved to {Path(moved).parent.as_posix()}/")
            del added[moved]
    changes += [f"{path} rewritten" for path in sorted(now.keys() & recorded.keys()) if now[path] != recorded[path]]
    return changes + [f"{path} added" for path in added] + removed


def stored_options(max_side: int | None, quality: int) -> str:
    """The options that shape the stored images: without a cap the files' bytes are stored, so the
    quality is no matter."""
    return "no --max-side" if max_side is None else f"--max-side {max_side} --quality {quality}"


def converted_split(out: Path) -> tuple[int, str | None] | None:
    """The images of the split already converted at `out` and the options that it was converted
    with (None: not recorded, an older version wrote it), or None if there is none (nothing there,
    or an empty folder); ValueError for anything else there, before any work is done."""
    if (out / INDEX).is_file():
        index = json.loads((out / INDEX).read_text())
        if "vit" not in index:
            raise ValueError(
                f"{out / INDEX} has no class names and labels (a litdata dataset written otherwise): "
                "delete it or convert into another folder"
            )
        vit = index["vit"]
        made = stored_options(vit["max_side"], vit["quality"]) if "max_side" in vit and "quality" in vit else None
        return len(vit["labels"]), made
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not a converted split (no {INDEX}): delete it or convert elsewhere")
    return None


def check_kept(
    target: Path, kept: dict[str, tuple[int, str | None] | None], asked: str, again: Collection[str] = ()
) -> None:
    """Refuse, before any work, a split in `target` converted with other options than this run's
    (train and val would hold images of other sizes), or one whose options were not recorded beside
    a split converted now (those not in `kept`, and those converted `again`); `kept` (the splits
    asked for) kept alone is said (main), not refused."""
    splits = dict(kept)
    for folder in sorted(target.iterdir()) if target.is_dir() else []:  # the splits not asked for too
        if folder.name not in splits and not folder.name.startswith(".") and (folder / INDEX).is_file():
            with contextlib.suppress(ValueError):  # a litdata dataset written otherwise is no split of ours
                splits[folder.name] = converted_split(folder)
    for split, found in splits.items():
        if found is not None and found[1] is not None and found[1] != asked:
            raise ValueError(
                f"{target / split} was converted with {found[1]}, not {asked}: run with its options, "
                f"or delete {target / split} to convert it again with yours"
            )
    new = [split for split, found in kept.items() if found is None or split in again]
    for split, found in splits.items():
        if found is not None and found[1] is None and split not in again and new:
            raise ValueError(
                f"{target / split} does not record the --max-side and --quality it was converted with (an older "
                f"version of this command wrote it), so {', '.join(new)} might be written with other ones: delete "
                f"{target / split} to convert the splits again in one run, or convert into another folder"
            )


def chunk_size(value: str) -> int:
    """--chunk-bytes in bytes: a number of bytes, or one with a unit as litdata reads it (64MB,
    500kb: powers of 1000); at least 1 (litdata takes 0 as no limit: the whole split in one chunk)."""
    size = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)b?", value.strip().lower())
    if size is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a size: bytes, or a number with a unit (64MB, 500kb)")
    number = int(float(size.group(1)) * 1000 ** " kmgt".index(size.group(2) or " "))  # as litdata rounds it
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a size of at least 1 byte, got {value!r}")
    return number


def main(argv: list[str] | None = None) -> dict[str, dict[str, int | list[str]]]:
    parser = image_copy_parser(__doc__, "where the chunks go (e.g. data/imagenet-streaming)", max_side=None)
    parser.add_argument(
        "--chunk-bytes", type=chunk_size, default="64MB", help="chunk size: bytes, or with a unit (default 64MB)"
    )
    parser.add_argument("--splits", nargs="+", default=["train", "val"], help="the training split first")
    parser.add_argument(
        "--overwrite", action="store_true", help="convert again a split whose source changed since it was written"
    )
    args = parser.parse_args(argv)
    report = convert_image_folder(args.source, args.target, args.max_side, args.quality, args.workers,
                                  args.skip_corrupt, args.chunk_bytes, tuple(args.splits),
                                  overwrite=args.overwrite)  # fmt: skip
    for split, outcome in report.items():
        if "kept" in outcome:
            made = outcome["options"] or "its --max-side and --quality not recorded"
            print(f"{args.target / split}: already converted ({counted(outcome['kept'], 'image')}, {made}), kept")
            continue
        left_out, changed = outcome["left out"], outcome.get("changed")
        print(
            f"{args.target / split}: {counted(outcome['written'], 'image')}"
            + (f", {len(left_out)} left out" if left_out else "")
            + (f", converted again ({len(changed)} change(s) in its source)" if changed else "")
        )
        for reason in left_out:  # type: ignore[union-attr]
            print(f"  left out: {reason}", file=sys.stderr)
    return report


def cli() -> None:
    run_command(main)


if __name__ == "__main__":
    cli()
