"""gallery.png of a one-method export reads at a glance: at least four cells wide (an image and three
maps), so its header and captions do not wrap into a narrow column, each row captioned by its file
name first, and the command's last line names the picture beside the page."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageFont

from tests.test_explain import _checkpoint
from vit import render
from vit.tools import rollout as export


def test_a_one_method_sheet_is_four_cells_wide_with_each_row_named_by_its_file(tmp_path, monkeypatch, capsys):
    images = tmp_path / "photos"
    (images / "nested").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for path in (images / "cat.png", images / "nested" / "a_rather_long_file_name_0001.png"):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(path)
    drawn = []
    monkeypatch.setattr(
        export, "contact_sheet", lambda rows, *a, **k: drawn.append(rows) or render.contact_sheet(rows, *a, **k)
    )
    ckpt = _checkpoint(tmp_path / "vit.ckpt", num_classes=3)
    out = export.main(["--checkpoint", str(ckpt), str(images), "--out", str(tmp_path / "out"), "--sheet-size", "48"])

    assert Image.open(out / "gallery.png").width == 4 * 48  # not 2 x 48: the image and its one map
    (rows,) = drawn
    assert [lines[0] for _, _, lines in rows] == ["photos/cat", "nested/a_rather_long_file_name_0001"]
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out / 'index.html'} and {out / 'gallery.png'}"


def test_a_caption_too_wide_for_the_sheet_keeps_its_start_and_end():
    font = ImageFont.load_default(size=10)
    name = "nested/" + "a_rather_long_file_name_" * 4 + "0001"
    short = render.shorten(name, font, 150)
    assert font.getlength(short) <= 150 < font.getlength(name)
    start, end = short.split("...")
    assert name.startswith(start) and name.endswith(end) and end.endswith("_0001") and len(start) >= len(end)
    assert render.shorten("cat", font, 150) == "cat"
