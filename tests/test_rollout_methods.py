"""The export with several methods: one panel and map per method for every image, equal to the
method run on its own, and a gallery that shows an image's methods side by side in one row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.test_explain import _checkpoint
from vit.checkpoint import load_model
from vit.data.transforms import eval_transform
from vit.rollout import rollout_maps
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
    assert "<section>" not in (single / "index.html").read_text()
    with pytest.raises(SystemExit):
        export.main(["--checkpoint", str(ckpt), "--method", "attention,chefer", str(images)])
    assert "chefer: choose from attention, gradient, last_attention, gradcam" in capsys.readouterr().err
