"""The export with several methods: one panel and map per method for every image, equal to the
method run on its own, and a gallery that shows an image's methods side by side in one row; the
true class taken from an image's class folder; the page printing every label once and fitting a
laptop's window (measured in a headless Chromium when there is one)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.test_explain import _checkpoint
from vit.checkpoint import load_model
from vit.data.transforms import eval_transform
from vit.relevance import rollout_maps
from vit.render import contact_sheet, render_panel
from vit.tools import rollout as export


def test_export_of_several_methods_side_by_side(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "vit.ckpt", num_classes=3)
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(images / f"{name}.png")
    out = tmp_path / "out"
    methods = ["gradcam", "attention", "last_attention"]  # the order given is the order shown
    export.main(["--checkpoint", str(ckpt), "--method", ",".join(methods), str(images), "--out", str(out),
                 "--panel-size", "32"])  # fmt: skip

    model = load_model(ckpt)
    x = torch.stack([eval_transform(16)(image=np.asarray(Image.open(images / f"{n}.png")))["image"] for n in "ab"])
    for method in methods:
        expected = rollout_maps(model, x, method)[0].numpy()
        for i, stem in enumerate(("00000_a", "00001_b")):
            np.testing.assert_allclose(np.load(out / f"{stem}_{method}.npy"), expected[i], rtol=1e-5, atol=1e-6)
            assert Image.open(out / f"{stem}_{method}.png").width == 3 * 32
    gallery = (out / "index.html").read_text()
    rows = gallery.split("<section>")[1:]
    assert len(rows) == 2 and gallery.count("<figure>") == 6
    for row, stem in zip(rows, ("00000_a", "00001_b"), strict=True):
        where = [row.index(f'src="{stem}_{m}.png"') for m in methods]
        assert where == sorted(where) and row.index("GradCAM") < row.index("attention rollout")
    sheet = Image.open(out / "gallery.png")  # both images and all three methods on one page
    assert sheet.width == (1 + 3) * 96 and sheet.height > 2 * 96

    # one method keeps the plain names, and an image path may follow --method
    single = tmp_path / "single"
    export.main(["--checkpoint", str(ckpt), "--method", "gradient", str(images), "--out", str(single)])
    assert sorted(p.name for p in single.glob("*.npy")) == ["00000_a.npy", "00001_b.npy"]
    page = (single / "index.html").read_text()  # a figure an image, the method named once, above them
    assert page.count("<figure>") == 2 and page.count("gradient rollout") == 1
    with pytest.raises(SystemExit):
        export.main(["--checkpoint", str(ckpt), "--method", "attention,chefer", str(images)])
    assert "chefer: choose from attention, gradient, last_attention, gradcam" in capsys.readouterr().err


def _class_folders(root: Path, folders: tuple[str, ...]) -> Path:
    """One random 16x16 image, 0006.png, in each folder (an image-folder layout)."""
    rng = np.random.default_rng(0)
    for folder in folders:
        (root / folder).mkdir(parents=True)
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(root / folder / "0006.png")
    return root


def _sections(page: str) -> list[str]:
    return page.split("<section>")[1:]


def test_the_true_class_is_the_class_folder_an_image_is_in(tmp_path):
    """Beside the predictions, on the page and on gallery.png: the class whose name the image's
    folder has (cifar10/test/cat/0006.jpg is a cat); a folder no class is named after gives none."""
    ckpt = _checkpoint(tmp_path / "vit.ckpt", num_classes=3)
    names = tmp_path / "names.txt"
    names.write_text("cat\ndog\nbird\n")
    argv = ["--checkpoint", str(ckpt), "--class-names", str(names), "--method", "attention,gradient"]
    labelled = _class_folders(tmp_path / "test", ("cat", "dog", "misc"))
    plain = _class_folders(tmp_path / "plain", ("x1", "x2", "x3"))  # the same images, no class folders
    out = export.main([*argv, str(labelled), "--out", str(tmp_path / "out"), "--sheet-size", "48"])
    out_plain = export.main([*argv, str(plain), "--out", str(tmp_path / "out_plain"), "--sheet-size", "48"])

    captions = [section.split("</p>")[0] for section in _sections((out / "index.html").read_text())]
    assert [re.findall(r">true: (\w+) ", caption) for caption in captions] == [["cat"], ["dog"], []]
    assert ">true: " not in (out_plain / "index.html").read_text()
    for caption, true in zip(captions, ("cat", "dog"), strict=False):  # green when it is the top class, red if not
        right = re.search(r"</b> (\w+): ", caption)[1] == true
        assert f'<span class="{"right" if right else "wrong"}">true: {true} &#{10003 if right else 10007};' in caption

    # gallery.png: each row one text line taller (3 predictions + the true class), drawn in black
    sheet, sheet_plain = (np.asarray(Image.open(o / "gallery.png").convert("L")) for o in (out, out_plain))
    blank = np.zeros((8, 8, 3), dtype=np.uint8)
    line = (
        contact_sheet([(blank, [np.zeros((2, 2))], ["x"])], ["a"], 48).height
        - contact_sheet([(blank, [np.zeros((2, 2))], [])], ["a"], 48).height
    )
    assert sheet.shape[0] - sheet_plain.shape[0] == 3 * line  # three rows, one line more each
    row_height = 48 + 5 * line + 6  # the file name, 3 predictions, the true class
    for r, has_true in enumerate((True, True, False)):  # the 5th text line under each row's image
        top = sheet.shape[0] - (3 - r) * row_height + 48 + 3 + 4 * line  # the rows end the sheet
        band = sheet[top : top + line, : 2 * 48]
        assert (band < 128).any() == has_true


def test_the_page_prints_each_label_once_and_the_panels_none(tmp_path):
    """Predictions, the true class and the method names are HTML text, each once per image; the
    panel PNGs are the image, the map and the overlay with no text drawn under them."""
    ckpt = _checkpoint(tmp_path / "vit.ckpt", num_classes=3)
    names = tmp_path / "names.txt"
    names.write_text("cat\ndog\nbird\n")
    images = _class_folders(tmp_path / "test", ("cat", "dog"))
    methods = ["attention", "gradient", "last_attention"]
    out = export.main(["--checkpoint", str(ckpt), "--class-names", str(names), "--method", ",".join(methods),
                       str(images), "--out", str(tmp_path / "out"), "--panel-size", "32"])  # fmt: skip

    page = (out / "index.html").read_text()
    sections = _sections(page)
    assert len(sections) == 2
    assert ["<b>cat/0006</b>" in sections[0], "<b>dog/0006</b>" in sections[1]] == [True, True]  # not 0006 twice
    for section in sections:
        for method in methods:
            assert section.count(export.METHOD_NAMES[method]) == 1
        predicted = re.findall(r"(\w+): \d\.\d\d", section)
        assert sorted(predicted) == ["bird", "cat", "dog"]  # the top 3, each once
        assert section.count("true: ") == 1
    style = page.split("<style>")[1].split("</style>")[0]
    assert not re.search(r"\d\s*px", style)  # no fixed widths: panels scale to the window

    model = load_model(ckpt)
    for i, folder in enumerate(("cat", "dog")):
        image = np.asarray(Image.open(images / folder / "0006.png"))
        for method in methods:
            stem = out / f"0000{i}_0006_{method}"
            expected = np.asarray(render_panel(image, np.load(f"{stem}.npy"), [], 32))
            np.testing.assert_array_equal(np.asarray(Image.open(f"{stem}.png")), expected)
        x = eval_transform(16)(image=image)["image"][None]
        np.testing.assert_allclose(
            np.load(out / f"0000{i}_0006_gradient.npy"), rollout_maps(model, x, "gradient")[0][0].numpy(), atol=1e-6
        )


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
PROBE = """<script>addEventListener("load", () => {
  const p = document.createElement("pre"); p.id = "probe";
  p.textContent = JSON.stringify({scroll: document.documentElement.scrollWidth, window: innerWidth,
    images: [...document.images].map(i => {const r = i.getBoundingClientRect();
      return {left: r.left, right: r.right, top: r.top, natural: i.naturalWidth}; })});
  document.body.append(p); });</script>"""


def _measure(page: Path, width: int, height: int, tmp_path: Path) -> dict:
    """The page's layout in a headless Chromium at a window size: scroll width and image boxes."""
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    run = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
         "--disable-background-networking", "--disable-component-update", f"--user-data-dir={tmp_path / 'profile'}",
         "--hide-scrollbars", f"--window-size={width},{height}", "--virtual-time-budget=5000", "--dump-dom",
         probe.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = re.search(r'<pre id="probe">(.*?)</pre>', run.stdout, re.S)
    assert found, run.stderr[-2000:]
    return json.loads(found[1].replace("&quot;", '"').replace("&amp;", "&"))


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs a Chromium to lay the page out")
def test_the_page_fits_a_laptop_window_with_an_images_methods_side_by_side(tmp_path):
    """At 1366x768 and 1920x1080, three methods' 672-pixel-wide panels (the default --panel-size)
    sit side by side in one row with nothing beyond the window's width; one method's fit too."""
    ckpt = _checkpoint(tmp_path / "vit.ckpt", num_classes=3)
    images = _class_folders(tmp_path / "test", ("cat", "dog"))
    argv = ["--checkpoint", str(ckpt), str(images)]
    several = export.main([*argv, "--method", "attention,gradient,last_attention", "--out", str(tmp_path / "a")])
    single = export.main([*argv, "--out", str(tmp_path / "b")])
    for width, height in ((1366, 768), (1920, 1080)):
        for out, per_row in ((several, 3), (single, None)):
            layout = _measure(out / "index.html", width, height, tmp_path)
            assert layout["window"] == width and layout["scroll"] <= width  # no sideways scrolling
            boxes = layout["images"]
            assert all(b["natural"] == 3 * 224 for b in boxes)  # every panel loaded
            assert all(b["left"] >= 0 and b["right"] <= width for b in boxes)
            if per_row:  # an image's methods share a row
                for row in (boxes[:per_row], boxes[per_row:]):
                    assert len({round(b["top"]) for b in row}) == 1
                    assert [b["left"] for b in row] == sorted(b["left"] for b in row)
