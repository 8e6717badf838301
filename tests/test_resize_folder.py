"""scripts/resize_folder.py: a training copy of an image folder with the longer side capped."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vit.data.images import CorruptImageError, read_rgb, scan_image_folder
from vit.tools.data_check import synthetic_photo
from vit.tools.resize_folder import main, shrunk


def _tree(root):
    rng = np.random.default_rng(0)
    (root / "train" / "cat").mkdir(parents=True)
    (root / "train" / "dog" / "2024").mkdir(parents=True)
    synthetic_photo(rng, 600, 400).save(root / "train" / "cat" / "big.jpg", quality=90)
    synthetic_photo(rng, 300, 700).convert("L").save(root / "train" / "dog" / "2024" / "tall.JPEG", quality=90)
    synthetic_photo(rng, 800, 500).save(root / "train" / "dog" / "wide.png")
    synthetic_photo(rng, 200, 150).save(root / "train" / "cat" / "small.jpg", quality=90)
    (root / "train" / "cat" / "notes.txt").write_text("kept as it is")


def test_images_over_the_cap_are_resized_and_everything_else_is_copied(tmp_path):
    _tree(tmp_path / "src")
    out = main([str(tmp_path / "src"), str(tmp_path / "dst"), "--max-side", "256", "--workers", "1"])
    assert [len(out[k]) for k in ("copied", "resized", "kept", "removed")] == [2, 3, 0, 0]
    dst = tmp_path / "dst" / "train"
    expected = {"cat/big.jpg": (256, 171, "JPEG"), "dog/2024/tall.JPEG": (110, 256, "JPEG"),
                "dog/wide.png": (256, 160, "PNG"), "cat/small.jpg": (200, 150, "JPEG")}  # fmt: skip
    for name, (width, height, fmt) in expected.items():
        with Image.open(dst / name) as image:
            assert (image.width, image.height, image.format) == (width, height, fmt), name
    assert (dst / "cat" / "small.jpg").read_bytes() == (tmp_path / "src" / "train" / "cat" / "small.jpg").read_bytes()
    assert (dst / "cat" / "notes.txt").read_text() == "kept as it is"
    assert scan_image_folder(dst)[0] == scan_image_folder(tmp_path / "src" / "train")[0]
    again = main([str(tmp_path / "src"), str(tmp_path / "dst"), "--max-side", "256", "--workers", "2"])
    assert len(again["kept"]) == 5 and not again["resized"]  # an interrupted conversion goes on


def test_an_unreadable_image_is_named_or_left_out_and_the_copy_never_goes_inside_the_source(tmp_path, capsys):
    _tree(tmp_path / "src")
    bad = tmp_path / "src" / "train" / "cat" / "cut.jpg"
    bad.write_bytes((tmp_path / "src" / "train" / "cat" / "big.jpg").read_bytes()[:500])
    with pytest.raises(ValueError, match=f"cannot decode image {bad}"):
        main([str(tmp_path / "src"), str(tmp_path / "dst"), "--max-side", "256", "--workers", "1"])
    out = main([str(tmp_path / "src"), str(tmp_path / "dst"), "--max-side", "256", "--workers", "1", "--skip-corrupt"])
    assert len(out["corrupt"]) == 1 and not (tmp_path / "dst" / "train" / "cat" / "cut.jpg").exists()
    assert f"left out: cannot decode image {bad}" in capsys.readouterr().err
    assert not list((tmp_path / "dst").rglob(".*.tmp"))
    with pytest.raises(ValueError, match="inside"):
        main([str(tmp_path / "src"), str(tmp_path / "src" / "small"), "--workers", "1"])


def test_a_copy_records_its_cap_and_quality_and_a_rerun_with_other_ones_is_refused_before_any_work(tmp_path, capsys):
    """A copy stopped part-way and rerun with another cap would keep the files written at the first
    one: the resolution would follow the class, a shortcut a classifier learns. The copy records its
    cap and quality at its root (hidden: the image folder scan never sees it) before its first file;
    a rerun with others is refused naming both, --workers and --skip-corrupt may change."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _tree(src)
    bad = src / "train" / "cat" / "cut.jpg"  # read second, after big.jpg: the run stops part-way
    bad.write_bytes((src / "train" / "cat" / "big.jpg").read_bytes()[:500])
    with pytest.raises(CorruptImageError, match=f"cannot decode image {bad}"):
        main([str(src), str(dst), "--max-side", "256", "--workers", "1"])
    written = sorted(p.relative_to(dst) for p in dst.rglob("*"))
    for other in (["--max-side", "128"], ["--max-side", "256", "--quality", "80"]):
        with pytest.raises(ValueError) as refused:
            main([str(src), str(dst), *other, "--workers", "1", "--skip-corrupt"])
        asked = " ".join(other) if "--quality" in other else f"{' '.join(other)} --quality 90"
        assert str(refused.value) == (
            f"{dst} is a copy made with --max-side 256 --quality 90, not {asked}: run with its options, delete it "
            "to make it again with yours, or write the copy elsewhere"
        )
        assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == written  # nothing done
    capsys.readouterr()
    out = main([str(src), str(dst), "--max-side", "256", "--workers", "2", "--skip-corrupt"])
    assert [len(out[k]) for k in ("copied", "resized", "kept", "corrupt")] == [2, 2, 1, 1]
    assert capsys.readouterr().out == (
        f"{dst}: 2 copied, 2 resized, 1 kept, 1 corrupt (longer side at most 256, JPEG quality 90)\n"
    )
    classes, samples = scan_image_folder(dst / "train")
    assert classes == ["cat", "dog"] and len(samples) == 4  # the record is not taken for a class or an image
    main([str(src / "train"), str(tmp_path / "split"), "--max-side", "256", "--workers", "1", "--skip-corrupt"])
    assert scan_image_folder(tmp_path / "split")[0] == ["cat", "dog"]  # a copy of one split is read as the split


def test_a_folder_in_the_way_that_is_not_a_copy_with_a_record_is_refused(tmp_path):
    """A non-empty target without the record (a copy by an older version, or another folder): its
    settings are unknown, so it is refused, saying so; an empty folder is a new copy."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _tree(src)
    (dst / "train" / "cat").mkdir(parents=True)
    (dst / "train" / "cat" / "big.jpg").write_bytes((src / "train" / "cat" / "big.jpg").read_bytes())
    with pytest.raises(ValueError) as refused:
        main([str(src), str(dst), "--max-side", "256", "--workers", "1"])
    assert str(refused.value) == (
        f"{dst} is not empty and has no .resize_folder.json recording how it was made (a copy by an older "
        "version of this command, or another folder): delete it, or write the copy elsewhere"
    )
    assert sorted(p.name for p in dst.rglob("*")) == ["big.jpg", "cat", "train"]
    shutil.rmtree(dst / "train")
    assert len(main([str(src), str(dst), "--max-side", "256", "--workers", "1"])["resized"]) == 3


def test_an_image_within_the_cap_is_decoded_before_it_is_copied(tmp_path, capsys):
    """A cut JPEG smaller than the cap is named as training would name it (not copied as it is);
    with --skip-corrupt it is left out and listed. Non-image files are copied unread."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _tree(src)
    small = src / "train" / "cat" / "small.jpg"
    small.write_bytes(small.read_bytes()[:-300])
    with pytest.raises(CorruptImageError, match=f"cannot decode image {small}: "):
        main([str(src), str(dst), "--max-side", "1024", "--workers", "1"])
    assert not (dst / "train" / "cat" / "small.jpg").exists()
    out = main([str(src), str(dst), "--max-side", "1024", "--workers", "1", "--skip-corrupt"])
    assert len(out["copied"]) + len(out["kept"]) == 4 and len(out["corrupt"]) == 1
    assert not (dst / "train" / "cat" / "small.jpg").exists()
    assert f"left out: cannot decode image {small}: " in capsys.readouterr().err
    assert (dst / "train" / "cat" / "notes.txt").read_text() == "kept as it is"


def test_a_full_disk_names_the_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _tree(src)

    def disk_full(source, target, *args, **kwargs):
        Path(target).write_bytes(Path(source).read_bytes()[:100])  # what fitted
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copyfile", disk_full)
    with pytest.raises(OSError) as full:
        main([str(src), str(dst), "--max-side", "1024", "--workers", "1"])
    target = dst / "train" / "cat" / "big.jpg"
    assert str(full.value) == f"[Errno 28] cannot write {target}: No space left on device"
    assert full.value.errno == errno.ENOSPC
    assert not [p for p in dst.rglob("*") if p.is_file() and p.name != ".resize_folder.json"]


@pytest.mark.parametrize("option", [["--quality", "200"], ["--quality", "0"], ["--max-side", "0"]])
def test_an_option_out_of_range_is_a_usage_error_naming_it(tmp_path, capsys, option):
    """PIL takes any JPEG quality and silently clamps it to libjpeg's 1-100."""
    _tree(tmp_path / "src")
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "src"), str(tmp_path / "dst"), *option])
    assert stop.value.code == 2 and not (tmp_path / "dst").exists()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    expected = "from 1 to 100 (JPEG quality)" if option[0] == "--quality" else "at least 1"
    assert f"error: argument {option[0]}: " in err
    assert expected in err and option[1] in err


def _photos(root: Path, names: dict[str, int]) -> None:
    """`root/<class>/<name>.jpg`, 90 x 60 photos (over a 64 cap) drawn from each seed."""
    for name, seed in names.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        synthetic_photo(np.random.default_rng(seed), 90, 60).save(root / name, quality=90)


def _copy(src: Path, dst: Path, *options: str) -> dict[str, list[str]]:
    return main([str(src), str(dst), "--max-side", "64", "--workers", "1", *options])


def _state(root: Path) -> dict[str, int]:
    """Every file under `root` (the record too) and its mtime_ns."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_a_rerun_after_an_image_moved_class_and_another_was_rewritten_brings_the_copy_up_to_date(tmp_path, capsys):
    """The copy kept a moved image in both classes and a rewritten image's old pixels ("1 resized,
    N kept"). The record lists each source file's size and mtime_ns when its copy was made: a
    changed file is made again, a copy whose source is gone is removed, the counts say so; a rerun
    of an unchanged source keeps every file and writes nothing."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _photos(src, {"cat/a.jpg": 1, "cat/b.jpg": 2, "cat/c.jpg": 3, "dog/d.jpg": 4, "dog/e.jpg": 5})
    _copy(src, dst)
    capsys.readouterr()
    (src / "cat/a.jpg").rename(src / "dog/a.jpg")  # mv keeps its size and mtime
    _photos(src, {"cat/b.jpg": 99})  # new pixels
    out = _copy(src, dst)
    assert capsys.readouterr().out == f"{dst}: 2 resized, 1 removed, 3 kept (longer side at most 64, JPEG quality 90)\n"
    assert sorted(out["resized"]) == [str(src / "cat/b.jpg"), str(src / "dog/a.jpg")]
    assert out["removed"] == [str(dst / "cat/a.jpg")] and not out["unknown"]
    copies = sorted(str(p.relative_to(dst)) for p in dst.rglob("*.jpg"))
    assert copies == ["cat/b.jpg", "cat/c.jpg", "dog/a.jpg", "dog/d.jpg", "dog/e.jpg"]  # each image in one class
    for name in ("cat/b.jpg", "dog/a.jpg"):  # the source's pixels now, resized
        assert (dst / name).read_bytes() == shrunk(read_rgb(src / name), 64, 90, png=False), name
    recorded = json.loads((dst / ".resize_folder.json").read_text())["files"]
    assert recorded["cat/b.jpg"] == [(src / "cat/b.jpg").stat().st_size, (src / "cat/b.jpg").stat().st_mtime_ns]
    assert sorted(recorded) == copies
    before = _state(dst)
    out = _copy(src, dst)
    assert capsys.readouterr().out == f"{dst}: 5 kept (longer side at most 64, JPEG quality 90)\n"
    assert _state(dst) == before  # nothing rewritten, the record neither


def test_added_and_removed_source_files_are_copied_and_removed_and_files_of_your_own_are_left(tmp_path, capsys):
    """A new image is copied, a removed one's copy and a removed class's folder go (an empty class
    folder would still be a class); a file this command did not write is named and left as it is."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _photos(src, {"cat/a.jpg": 1, "cat/b.jpg": 2, "dog/c.jpg": 3, "bird/d.jpg": 4})
    _copy(src, dst)
    (dst / "cat" / "mine.txt").write_text("my notes")
    _photos(src, {"cat/new.jpg": 5})
    (src / "cat/b.jpg").unlink()
    shutil.rmtree(src / "bird")
    capsys.readouterr()
    out = _copy(src, dst)
    printed = capsys.readouterr()
    assert printed.out == f"{dst}: 1 resized, 2 removed, 2 kept (longer side at most 64, JPEG quality 90)\n"
    assert printed.err == f"  not written by this command, left as it is: {dst / 'cat' / 'mine.txt'}\n"
    assert out["removed"] == [str(dst / "bird/d.jpg"), str(dst / "cat/b.jpg")]
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()) == [
        ".resize_folder.json", "cat/a.jpg", "cat/mine.txt", "cat/new.jpg", "dog/c.jpg",
    ]  # fmt: skip
    assert (dst / "cat" / "mine.txt").read_text() == "my notes"
    assert scan_image_folder(dst)[0] == scan_image_folder(src)[0] == ["cat", "dog"]


def test_a_run_stopped_part_way_leaves_its_copies_known_to_the_next_run(tmp_path):
    """Files written by a stopped run are listed before they are written (without a size and time):
    the next run keeps those newer than their source and removes those whose source has gone since,
    so an image moved meanwhile is not left in its old class."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _photos(src, {"cat/a.jpg": 1, "dog/b.jpg": 2})
    _copy(src, dst)
    _photos(src, {"cat/new1.jpg": 3, "cat/new2.jpg": 4})
    bad = src / "cat" / "zz.jpg"  # read after new1 and new2: the run stops there
    bad.write_bytes((src / "cat/a.jpg").read_bytes()[:300])
    with pytest.raises(CorruptImageError, match=f"cannot decode image {bad}"):
        _copy(src, dst)
    assert (dst / "cat/new1.jpg").is_file() and (dst / "cat/new2.jpg").is_file()
    listed = json.loads((dst / ".resize_folder.json").read_text())["files"]
    assert listed["cat/new1.jpg"] is None and listed["cat/zz.jpg"] is None and listed["cat/a.jpg"] is not None
    (src / "cat/new1.jpg").rename(src / "dog/new1.jpg")
    out = _copy(src, dst, "--skip-corrupt")
    assert [len(out[k]) for k in ("resized", "removed", "kept", "corrupt")] == [1, 1, 3, 1]
    assert out["removed"] == [str(dst / "cat/new1.jpg")] and out["resized"] == [str(src / "dog/new1.jpg")]
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*.jpg")) == [
        "cat/a.jpg", "cat/new2.jpg", "dog/b.jpg", "dog/new1.jpg"
    ]  # fmt: skip
    assert sorted(json.loads((dst / ".resize_folder.json").read_text())["files"]) == [
        "cat/a.jpg", "cat/new2.jpg", "dog/b.jpg", "dog/new1.jpg"
    ]  # fmt: skip


def test_a_copy_by_an_older_version_is_brought_up_to_date_by_time_and_its_sourceless_files_are_refused(tmp_path):
    """An older version recorded no files: a copy older than its source is made again, a newer one
    kept; a copy with no source (a moved image's old copy, or a file of your own) is named and the
    run refused before any work, until it is deleted."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _photos(src, {"cat/a.jpg": 1, "cat/b.jpg": 2, "dog/c.jpg": 3})
    _copy(src, dst)
    record = dst / ".resize_folder.json"
    record.write_text(json.dumps({"max_side": 64, "quality": 90}))  # as older versions wrote it
    (src / "cat/a.jpg").rename(src / "dog/a.jpg")
    _photos(src, {"cat/b.jpg": 99})
    copied = dst / "cat/b.jpg"
    os.utime(copied, ns=(copied.stat().st_atime_ns, (src / "cat/b.jpg").stat().st_mtime_ns - 10**9))
    before = _state(dst)
    with pytest.raises(ValueError) as refused:
        _copy(src, dst)
    assert str(refused.value) == (
        f"{dst} was made by an older version of this command, which recorded no files, and has 1 file(s) with no "
        f"source (e.g. {dst / 'cat/a.jpg'}): copies of images since moved or removed, or files of your own; "
        "delete or move them, then run again"
    )
    assert _state(dst) == before
    (dst / "cat/a.jpg").unlink()
    out = _copy(src, dst)
    assert sorted(out["resized"]) == [str(src / "cat/b.jpg"), str(src / "dog/a.jpg")]
    assert out["kept"] == [str(src / "dog/c.jpg")]
    assert sorted(json.loads(record.read_text())["files"]) == ["cat/b.jpg", "dog/a.jpg", "dog/c.jpg"]
