"""Image files decoded and augmented on the training device (`data.pipeline device`, vit.data.device):
the same pixels as the per-sample path's decoder, the same crop distribution, corrupt files named,
and runs that resume bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import stats

import vit.data.device as device_module
from tests.conftest import ROOT, SHARED, write_image_folder
from tests.test_fault_tolerance import QUIET, assert_bit_identical, signal_at, weights
from vit.cli import main
from vit.data.augment import (
    RA_OPS,
    TOGETHER_SIDE,
    Augment,
    center_crop_box,
    crop_resize_flip,
    rand_augment,
    random_resized_crop_box,
    resize_crops_together,
    resize_weights,
)
from vit.data.device import (
    EncodedFiles,
    augment_decoded,
    collate_encoded,
    decode_and_augment,
    decode_batch,
    decode_encoded,
)
from vit.data.geometry import eval_pixels
from vit.data.images import MISSING, CorruptImageError, ImageFiles, Sample, read_header, read_rgb
from vit.tools.data_check import synthetic_photo


def _bytes(path: Path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


def _photos(folder: Path) -> list[Path]:
    """Synthetic photos in each format the decoder meets: RGB and greyscale JPEG, PNG, RGBA PNG."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (fmt, mode) in enumerate([("JPEG", "RGB"), ("JPEG", "L"), ("PNG", "RGB"), ("PNG", "RGBA")]):
        path = folder / f"{i}.{fmt.lower()}"
        synthetic_photo(rng, 120 + 10 * i, 90).convert(mode).save(
            path, fmt, **({"quality": 90} if fmt == "JPEG" else {})
        )
        paths.append(path)
    return paths


def test_device_decoding_gives_the_per_sample_decoders_pixels(tmp_path):
    """decode_jpeg (libjpeg on the CPU) and the CPU fallback for PNG give what PIL gives, on real
    CIFAR-10 and Tiny-ImageNet JPEGs where ../shared has them and on each format's synthetic photo."""
    files = _photos(tmp_path)
    for pattern in ("cifar10/test/cat/*.jpg", "tiny-imagenet-200/val/images/*.JPEG"):
        files += sorted((SHARED / "data").glob(pattern))[:50]
    decoded = decode_batch([_bytes(p) for p in files], "cpu")
    for path, image in zip(files, decoded, strict=True):
        reference = torch.from_numpy(read_rgb(path)).permute(2, 0, 1)
        assert image.dtype == torch.uint8 and image.shape == reference.shape, path
        assert (image.int() - reference.int()).abs().max() <= 1, path  # 0 here; JPEG decoders may round apart


def test_a_worker_hands_over_the_jpegs_as_one_block_of_bytes_and_decodes_the_rest(tmp_path):
    """A tensor per file made the hand-over from the workers cost more than decoding on a GPU node:
    a batch crosses as the JPEGs' bytes end to end in one shared-memory tensor; a PNG is decoded in
    the worker by PIL (the per-sample path's decoder), not in the training process. The device then
    decodes the batch to the pixels PIL gives."""
    files = _photos(tmp_path)  # RGB and greyscale JPEG, PNG, RGBA PNG
    dataset = EncodedFiles([Sample(str(p), i) for i, p in enumerate(files)], train=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=1, collate_fn=collate_encoded)
    (batch,) = list(loader)
    jpegs = [p.read_bytes() for p in files[:2]]
    assert batch.data.is_shared() and bytes(batch.data.numpy()) == b"".join(jpegs)
    assert batch.lengths.tolist() == [len(jpegs[0]), len(jpegs[1]), 0, 0] and batch.labels.tolist() == [0, 1, 2, 3]
    pixels = [torch.from_numpy(read_rgb(p)).permute(2, 0, 1) for p in files]
    assert batch.pixels.is_shared() and batch.sizes.tolist() == [[90, 140], [90, 150]]  # the PNGs, end to end
    assert [torch.equal(image, expected) for image, expected in zip(batch.decoded(), pixels[2:], strict=True)] == [1, 1]
    for image, expected in zip(decode_batch(batch.images(), "cpu"), pixels, strict=True):
        assert image.shape == expected.shape and (image.int() - expected.int()).abs().max() <= 1


def test_worker_decode_has_that_share_of_the_jpegs_decoded_in_the_workers_the_same_ones_each_time(tmp_path):
    """Decoding on a GPU takes its cores from the model: `worker_decode` moves a share of the JPEGs
    to the loader workers (PIL, the per-sample path's decoder), spread evenly over the files and the
    same ones every epoch; they cross as one block of pixels, and the batch decodes as before."""
    rng = np.random.default_rng(0)
    for i in range(40):
        synthetic_photo(rng, 24 + i % 5, 16).save(tmp_path / f"{i}.jpg", quality=90)
    samples = [Sample(str(tmp_path / f"{i}.jpg"), i) for i in range(40)]
    pixels = [torch.from_numpy(read_rgb(s.path)).permute(2, 0, 1) for s in samples]
    chosen = []
    for share in (0.0, 0.25, 0.5, 1.0):
        dataset = EncodedFiles(samples, train=False, worker_decode=share)
        here = [i for i in range(40) if dataset[i][0].dim() == 3]
        chosen.append(set(here))
        assert here == [i for i in range(40) if dataset.decoded_here(i)] and abs(len(here) - 40 * share) <= 1
        assert all(torch.equal(dataset[i][0], pixels[i]) for i in here)
        assert max(np.diff([-1, *here, 40]), default=0) <= {0.0: 41, 0.25: 8, 0.5: 3, 1.0: 1}[share]  # spread out
    assert chosen[0] < chosen[1] < chosen[2] < chosen[3]  # a larger share adds files to the smaller's
    loader = torch.utils.data.DataLoader(EncodedFiles(samples, False, worker_decode=0.5), batch_size=20,
                                         num_workers=1, collate_fn=collate_encoded)  # fmt: skip
    for k, batch in enumerate(loader):
        assert batch.pixels.is_shared() and len(batch.sizes) == int((batch.lengths == 0).sum()) > 5
        for image, expected in zip(decode_batch(batch.images("cpu"), "cpu"), pixels[20 * k : 20 * k + 20], strict=True):
            assert image.shape == expected.shape and (image.int() - expected.int()).abs().max() <= 1


def test_formats_the_device_decoder_does_not_take_decode_as_the_per_sample_path_decodes_them(tmp_path):
    """BMP, TIFF and 16-bit greyscale PNG (scaled to 8 bits) give PIL's pixels, as in the per-sample
    path: the worker decodes them with the same reader (torchvision's decoder refuses BMP and TIFF)."""
    files = {"bmp": 77, "tif": 33}
    for ext, grey in files.items():
        Image.fromarray(np.full((9, 11, 3), grey, np.uint8)).save(tmp_path / f"a.{ext}")
    Image.fromarray((np.ones((9, 11)) * 257 * 50).astype(np.uint16)).save(tmp_path / "a16.png")
    paths = [tmp_path / "a.bmp", tmp_path / "a.tif", tmp_path / "a16.png"]
    dataset = EncodedFiles([Sample(str(p), i) for i, p in enumerate(paths)], train=False)
    batch = collate_encoded([dataset[i] for i in range(3)])
    assert batch.lengths.tolist() == [0, 0, 0]  # all three decoded in the worker
    for image, path, grey in zip(batch.decoded(), paths, (77, 33, 50), strict=True):
        assert torch.equal(image, torch.from_numpy(read_rgb(path)).permute(2, 0, 1))
        assert image.shape == (3, 9, 11) and image.unique().tolist() == [grey]


def test_progressive_and_cmyk_jpegs_are_decoded_in_the_worker_as_the_per_sample_path_decodes_them(tmp_path):
    """The device takes baseline JPEGs in colour or grey. A progressive JPEG (which nvJPEG's batched
    hardware decoder refuses: torchvision would decode it alone, in the thread feeding the model)
    and a CMYK one (converted as PIL converts it) are decoded in the worker, to PIL's pixels."""
    photo = Image.open(_photos(tmp_path)[0])
    photo.save(tmp_path / "progressive.jpg", quality=90, progressive=True)
    photo.convert("CMYK").save(tmp_path / "cmyk.jpg", quality=90)
    photo.convert("L").save(tmp_path / "grey.jpg", quality=90)
    paths = [tmp_path / name for name in ("progressive.jpg", "cmyk.jpg", "grey.jpg")]
    dataset = EncodedFiles([Sample(str(p), i) for i, p in enumerate(paths)], train=False)
    batch = collate_encoded([dataset[i] for i in range(3)])
    assert batch.lengths.tolist() == [0, 0, len(paths[2].read_bytes())]  # the grey baseline JPEG goes as bytes
    for image, path in zip(batch.decoded(), paths[:2], strict=True):
        assert torch.equal(image, torch.from_numpy(read_rgb(path)).permute(2, 0, 1))
    assert [tuple(image.shape) for image in batch.images()] == [(3, 90, 120)] * 2 + [(len(paths[2].read_bytes()),)]


def test_the_frame_header_gives_pils_size_and_kind_for_every_jpeg(tmp_path, monkeypatch):
    """A worker reads each JPEG's size and kind (baseline YCbCr or grey: the device's) from its frame
    header alone, not through PIL: the same answer as PIL's for JPEGs written every which way and for
    real ones where ../shared has them; PIL still reads the rest, and refuses what it refused."""
    photo = synthetic_photo(np.random.default_rng(0), 61, 47)
    exif = Image.Exif()
    exif[0x0112] = 6  # an orientation tag: an APP1 segment before the frame
    variants = {
        "plain": {}, "q50 4:4:4": {"quality": 50, "subsampling": 0}, "optimized": {"optimize": True},
        "exif": {"exif": exif.tobytes()}, "icc": {"icc_profile": b"\0" * 3000}, "progressive": {"progressive": True},
        "restart markers": {"restart_marker_blocks": 1},
    }  # fmt: skip
    files = []
    for name, options in variants.items():
        for mode in ("RGB", "L", "CMYK"):
            path = tmp_path / f"{name} {mode}.jpg"
            photo.convert(mode).save(path, "JPEG", **options)
            files.append(path)
    padded = tmp_path / "fill bytes.jpg"  # a marker may follow any number of 0xFF fill bytes
    data = (tmp_path / "exif RGB.jpg").read_bytes()
    padded.write_bytes(data[:2] + b"\xff\xff" + data[2:])
    files.append(padded)
    for pattern in ("cifar10/test/cat/*.jpg", "tiny-imagenet-200/val/images/*.JPEG"):
        files += sorted((SHARED / "data").glob(pattern))[:50]
    for path in files:
        data = path.read_bytes()
        with Image.open(path) as image:  # what PIL's header says
            device = image.mode in ("RGB", "L") and not image.info.get("progressive")
            assert read_header(data) == (image.height, image.width, device), path
    assert [read_header((tmp_path / f"plain {m}.jpg").read_bytes())[2] for m in ("RGB", "L", "CMYK")] == [1, 1, 0]
    assert not read_header((tmp_path / "progressive RGB.jpg").read_bytes())[2]
    monkeypatch.setattr(Image, "open", lambda *_: pytest.fail("PIL opened a baseline JPEG"))
    assert read_header((tmp_path / "exif RGB.jpg").read_bytes()) == (47, 61, True)
    with pytest.raises(Image.DecompressionBombError):  # a frame header claiming 65535 x 65535 pixels
        data = (tmp_path / "plain RGB.jpg").read_bytes()
        at = data.index(b"\xff\xc0")
        read_header(data[: at + 5] + b"\xff\xff\xff\xff" + data[at + 9 :])


def test_the_cuda_decoder_runs_only_after_the_callers_stream_is_drained(tmp_path, monkeypatch):
    """torchvision's CUDA decoder writes from a private stream that does not wait for the caller's
    stream (pytorch/vision#9606): decode_batch drains the caller's stream before it decodes the
    batch in one call, and after a call the decoder refuses waits for the work it left queued
    before decoding each file alone. The GPU check measures the race itself (vit.tools.data_check)."""
    calls = []

    class Stream:
        def synchronize(self):
            calls.append("drain")

    refuse = False

    def decode_jpeg(data, mode, device):
        if isinstance(data, torch.Tensor):  # one file
            calls.append(f"decode one on {device}")
            return torch.zeros(3, 2, 2, dtype=torch.uint8)
        calls.append(f"decode {len(data)} on {device}")
        if refuse:
            raise RuntimeError("a file the batch decoder refuses")
        return [torch.zeros(3, 2, 2, dtype=torch.uint8) for _ in data]

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("wait for every stream"))
    monkeypatch.setattr(device_module, "decode_jpeg", decode_jpeg)
    jpegs = [_bytes(p) for p in _photos(tmp_path)[:2]]
    decode_batch(jpegs, "cuda:1")
    assert calls == ["drain", "decode 2 on cuda:1"]
    calls.clear()
    refuse = True  # the refused call's work on the decoder's own stream ends before each file is decoded alone
    decode_batch(jpegs, "cuda:1")
    assert calls == [
        "drain",
        "decode 2 on cuda:1",
        "wait for every stream",
        "decode one on cuda:1",
        "decode one on cuda:1",
    ]
    calls.clear()
    refuse = False
    decode_batch(jpegs, "cpu")  # libjpeg on the CPU: nothing to drain
    assert calls == ["decode 2 on cpu"]


def test_random_resized_crop_boxes_follow_the_per_sample_paths_distribution():
    """Area fraction and aspect ratio of 3000 boxes against albumentations' RandomResizedCrop (the
    per-sample path) on a 500x375 photo and a square one: the same distributions (KS test)."""
    import albumentations as A

    for height, width in ((375, 500), (64, 64)):
        reference = A.RandomResizedCrop(size=(32, 32), scale=(0.08, 1.0), p=1.0)
        reference.set_random_seed(0)  # a fixed draw: the test passes or fails the same way each run
        image = np.zeros((height, width, 3), np.uint8)
        theirs = []
        for _ in range(3000):
            x0, y0, x1, y1 = reference.get_params_dependent_on_data({"shape": image.shape}, {"image": image})[
                "crop_coords"
            ]
            theirs.append(((x1 - x0) * (y1 - y0) / (height * width), (x1 - x0) / (y1 - y0)))
        rng = np.random.default_rng(0)
        ours = []
        for _ in range(3000):
            top, left, h, w = random_resized_crop_box(rng, height, width)
            assert top >= 0 and top + h <= height and left >= 0 and left + w <= width
            ours.append((h * w / (height * width), w / h))
        for column in (0, 1):
            a, b = [x[column] for x in ours], [x[column] for x in theirs]
            assert stats.ks_2samp(a, b).pvalue > 0.001, (height, width, column)


def test_evaluation_crops_the_centred_square_and_resizes_it_as_every_path_does(tmp_path):
    """The centred square of crop_pct x the shorter side, resized bicubic: on a smooth image whose
    colour gives the position (red: x, green: y), the per-sample path's pixels to a rounding (it
    works in whole levels), where a box 2 pixels off is 4.9 levels out, one 2 pixels smaller 1.8."""
    yy, xx = np.mgrid[0:90, 0:120]
    pixels = np.stack([255 * xx / 119, 255 * yy / 89, 128 + 60 * np.sin(xx / 15)], axis=-1).astype(np.uint8)
    path = tmp_path / "smooth.png"
    Image.fromarray(pixels).save(path)
    assert center_crop_box(90, 120, 0.875) == (5, 20, 79, 79)
    dataset = EncodedFiles([Sample(str(path), 3)], train=False, crop_pct=0.875)
    x, y = decode_and_augment(collate_encoded([dataset[0]]), "cpu", 48, dataset)
    expected = torch.from_numpy(eval_pixels(read_rgb(path), 48, 0.875)).permute(2, 0, 1).float()
    assert y.tolist() == [3] and x.shape == (1, 3, 48, 48)
    assert (x[0] - expected).abs().mean() < 0.5 and (x[0] - expected).abs().max() <= 1.5


def test_training_crops_and_flips_are_drawn_from_the_sample_seed(tmp_path):
    (path,) = _photos(tmp_path)[:1]
    dataset = EncodedFiles([Sample(str(path), 0)], train=True, augment=Augment(crop_scale=(0.3, 1.0)))
    a, b, c = (dataset[item][2] for item in [(0, 7), (0, 7), (0, 8)])
    assert torch.equal(a.rand_augment.isnan(), torch.ones(len(a.rand_augment), dtype=torch.bool))  # none drawn
    same, other = ([d.box.tolist(), bool(d.flip), int(d.index)] for d in (b, c))
    assert [a.box.tolist(), bool(a.flip), int(a.index)] == same != other
    assert dataset[(0, np.int64(7))][2].box.tolist() == a.box.tolist()  # a numpy seed draws as its int does
    flips = [bool(dataset[(0, seed)][2].flip) for seed in range(400)]
    assert 160 < sum(flips) < 240  # a flip with probability 1/2
    x, _ = decode_and_augment(collate_encoded([dataset[(0, 7)]]), "cpu", 32, dataset)
    (top, left, h, w), flip = a.box.tolist(), bool(a.flip)
    crop = torch.from_numpy(read_rgb(path)).permute(2, 0, 1)[None, :, top : top + h, left : left + w].float()
    expected = torch.nn.functional.interpolate(crop, size=(32, 32), mode="bilinear", antialias=True)
    expected = expected.flip(-1) if flip else expected
    torch.testing.assert_close(x, expected)

    # RandAugment: two ops drawn from the same seed, applied to the cropped image
    with_ra = Augment(crop_scale=(0.3, 1.0), randaugment_ops=2)
    augmented = EncodedFiles([Sample(str(path), 0)], train=True, augment=with_ra)
    drawn = augmented[(0, 7)][2]
    assert drawn.box.tolist() == a.box.tolist() and bool(drawn.flip) == flip
    torch.testing.assert_close(drawn.rand_augment, augmented[(0, 7)][2].rand_augment, equal_nan=True)
    assert drawn.rand_augment[: len(RA_OPS)].isfinite().sum() == 2
    x, _ = decode_and_augment(collate_encoded([augmented[(0, 7)]]), "cpu", 32, dataset)
    torch.testing.assert_close(x, rand_augment(expected, drawn.rand_augment[None]))
    assert (x - expected.round()).abs().mean() > 1


def test_crops_resized_together_equal_crops_resized_one_at_a_time():
    """The GPU's batched resize (two matrix products) gives F.interpolate's antialiased bilinear
    pixels, image for image: shrunk, enlarged, flipped or not, of any shape, the longest images
    resized alone. In float16 (training's on a GPU) within a tenth of a level on average, never
    half a level off."""
    rng = np.random.default_rng(0)
    images, rows = [], []
    for i in range(40):
        h, w = (int(v) for v in rng.integers(12, 150, size=2))
        images.append(torch.from_numpy(rng.integers(0, 256, size=(3, h, w), dtype=np.uint8)))
        rows.append([*random_resized_crop_box(rng, h, w), i % 2])
    rows[3] = [0, 0, 13, 12, 1]  # enlarged 1.6x
    box, flips = torch.tensor(rows)[:, :4], torch.tensor(rows)[:, 4].bool()
    expected = []
    for image, (y, x, h, w, flip) in zip(images, rows, strict=True):
        crop = image[None, :, y : y + h, x : x + w].float()
        resized = torch.nn.functional.interpolate(crop, size=(20, 20), mode="bilinear", antialias=True)
        expected.append(resized.flip(-1) if flip else resized)
    expected = torch.cat(expected)
    together = resize_crops_together(images, box, flips, 20)
    assert together.shape == (40, 3, 20, 20)
    assert sum(max(image.shape[1:]) > TOGETHER_SIDE * 20 for image in images) >= 5  # some go one at a time
    torch.testing.assert_close(together, expected, rtol=0, atol=2e-3)
    torch.testing.assert_close(crop_resize_flip(images, box, flips, 20), expected, rtol=0, atol=0)  # the CPU's way
    half = resize_crops_together(images, box, flips, 20, dtype=torch.float16)
    assert half.dtype == torch.float32
    assert float((half - expected).abs().mean()) < 0.1 and float((half - expected).abs().max()) < 0.5
    assert float((half - expected).abs().mean()) > 0  # the products did run in float16


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_resize_weights_are_what_f_interpolate_gives_each_pixel_of_the_crop(mode):
    """Row o of the weights is what F.interpolate (antialiased) takes into output pixel o from each
    pixel of the crop, read off by resizing each pixel alone: crops shrunk up to TOGETHER_SIDE,
    enlarged, at either end of the span, one pixel long; zero outside the crop; rows reversed for a
    mirrored image."""
    size, span = 16, int(TOGETHER_SIDE * 16)
    crops = [(0, 40), (3, 37), (5, 16), (10, 7), (24, 16), (0, 1), (39, 1)]  # (start, length)
    starts, lengths = (torch.tensor(column, dtype=torch.float32) for column in zip(*crops, strict=True))
    flip = torch.arange(len(crops)) % 2 == 1
    weights = resize_weights(starts, lengths, size, span, mode, flip=flip)
    assert weights.shape == (len(crops), size, span)
    for b, (start, length) in enumerate(crops):
        alone = torch.eye(length)[:, None, None, :]  # each pixel of the crop alone, in a row of one
        taken = torch.nn.functional.interpolate(alone, size=(1, size), mode=mode, antialias=True)[:, 0, 0]
        expected = torch.zeros(size, span)
        expected[:, start : start + length] = taken.T
        torch.testing.assert_close(weights[b], expected.flip(0) if flip[b] else expected, rtol=0, atol=1e-6)
    half = resize_weights(starts, lengths, size, span, mode, torch.float16, flip)
    assert torch.equal(half, weights.half())


def test_corrupt_files_are_named_and_skipped_with_skip_corrupt(tmp_path, caplog):
    """A truncated JPEG (libjpeg may decode it, grey below the cut, where PIL refuses it) and a
    file that is not an image: named; with skip_corrupt replaced (training) or left out (evaluation)."""
    good, truncated, text = tmp_path / "good.jpg", tmp_path / "cut.jpg", tmp_path / "notes.jpg"
    synthetic_photo(np.random.default_rng(0), 200, 150).save(good, quality=90)
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    text.write_text("not an image")
    samples = [Sample(str(p), i) for i, p in enumerate((truncated, text, good))]
    for index, path in ((0, truncated), (1, text)):
        with pytest.raises(CorruptImageError, match=f"cannot decode image {path}: "):
            EncodedFiles(samples, train=True)[(index, 0)]
    with caplog.at_level("WARNING", logger="vit"):
        assert EncodedFiles(samples, train=True, skip_corrupt=True)[(0, 0)][1] == 2  # the next readable one
        assert EncodedFiles(samples, train=False, skip_corrupt=True)[1][1] == -1  # MISSING: not scored
    assert f"skipped cannot decode image {truncated}" in caplog.text
    floats = tmp_path / "floats.tif"  # refused by name, as the per-sample path refuses it
    Image.fromarray(np.zeros((4, 4), np.float32), mode="F").save(floats)
    with pytest.raises(ValueError, match=f"^{floats} is a 32-bit float image"):
        EncodedFiles([Sample(str(floats), 0)], train=True)[(0, 0)]


def test_a_jpeg_is_truncated_when_no_end_marker_follows_its_scan_as_pil_says(tmp_path):
    """Bytes after the end marker (a phone's appended video) are no harm; an end marker before the
    scan (an embedded thumbnail's) does not make a cut file whole. PIL decides the same."""
    rng = np.random.default_rng(0)
    thumbnail = tmp_path / "thumbnail.jpg"
    synthetic_photo(rng, 16, 12).save(thumbnail, quality=90)
    full, trailed, cut = tmp_path / "full.jpg", tmp_path / "trailed.jpg", tmp_path / "cut.jpg"
    synthetic_photo(rng, 256, 192).save(full, quality=90, comment=thumbnail.read_bytes())  # a segment before the scan
    data = full.read_bytes()
    trailed.write_bytes(data + bytes(5000))
    assert read_header(trailed.read_bytes()) == (192, 256, True)
    assert read_rgb(trailed).shape == (192, 256, 3)
    after_thumbnail, scan = data.index(thumbnail.read_bytes()) + thumbnail.stat().st_size, data.index(b"\xff\xda")
    for end in (after_thumbnail + 10, scan + 2000):  # cut within the headers, within the scan
        cut.write_bytes(data[:end])
        with pytest.raises(ValueError, match="truncated"):
            read_header(cut.read_bytes())
        with pytest.raises(CorruptImageError, match="truncated"):
            read_rgb(cut)


def test_a_jpeg_the_device_decoder_refuses_but_the_per_sample_decoder_reads_trains_on_its_pixels(tmp_path, monkeypatch):
    """Whether a file is corrupt is the per-sample path's decision on every path: a JPEG that
    decode_jpeg refuses (nvjpeg is stricter than libjpeg about some encoders' files) but PIL reads
    is decoded by PIL where the batch is decoded, neither skipped nor counted."""
    paths = [tmp_path / f"{i}.jpg" for i in range(3)]
    for i, path in enumerate(paths):
        synthetic_photo(np.random.default_rng(i), 40, 32).save(path, quality=90)
    refused = torch.frombuffer(bytearray(paths[1].read_bytes()), dtype=torch.uint8)
    libjpeg = device_module.decode_jpeg

    def strict_decoder(data, mode, device):  # one file, or a batch that fails whole if any file fails
        if any(torch.equal(d, refused) for d in ([data] if isinstance(data, torch.Tensor) else data)):
            raise RuntimeError("decode_jpeg: a file it does not take")
        return libjpeg(data, mode=mode, device=device)

    monkeypatch.setattr(device_module, "decode_jpeg", strict_decoder)
    files = EncodedFiles([Sample(str(p), i) for i, p in enumerate(paths)], train=True, skip_corrupt=True)
    decoded = decode_encoded(collate_encoded([files[(i, i)] for i in range(3)]), "cpu", files)
    assert files.num_skipped == 0 and decoded.labels.tolist() == [0, 1, 2]
    for image, path in zip(decoded.images, paths, strict=True):
        assert torch.equal(image, torch.tensor(read_rgb(path)).permute(2, 0, 1))


def test_a_file_the_training_process_cannot_decode_is_named_or_skipped_as_the_workers_skip_one(tmp_path, caplog):
    """A JPEG whose header is sound but whose scan is not passes the worker and fails in the batch
    decoder: named; with skip_corrupt the batch keeps its size and the file is replaced as a loader
    worker replaces a file it refuses itself (the next readable file, with the crop, flip and
    RandAugment ops its sample seed draws for that file's size), and in evaluation given a stand-in
    left out of the scores, as the per-sample path scores it."""
    folder, refused_by_worker = tmp_path / "photos", tmp_path / "cut"
    folder.mkdir()
    refused_by_worker.mkdir()
    paths = [folder / f"{i}.jpg" for i in range(4)]
    for i, path in enumerate(paths):
        synthetic_photo(np.random.default_rng(i), 64 + 8 * i, 48).save(path, quality=90)
        (refused_by_worker / path.name).write_bytes(path.read_bytes())
    jpeg = paths[1].read_bytes()
    paths[1].write_bytes(jpeg[:300] + bytes(len(jpeg) - 302) + jpeg[-2:])  # the scan zeroed
    (refused_by_worker / "1.jpg").write_bytes(jpeg[:500])  # cut short: the worker's header check refuses it
    samples = [Sample(str(p), 10 + i) for i, p in enumerate(paths)]
    strict = EncodedFiles(samples, train=True, augment=Augment(randaugment_ops=2))
    with pytest.raises(CorruptImageError, match=f"cannot decode image {paths[1]}: "):
        decode_encoded(collate_encoded([strict[(i, i)] for i in range(4)]), "cpu", strict)

    files = EncodedFiles(samples, train=True, augment=Augment(randaugment_ops=2), skip_corrupt=True)
    batch = collate_encoded([files[(i, 100 + i)] for i in range(4)])
    with caplog.at_level("WARNING", logger="vit"):
        decoded = decode_encoded(batch, "cpu", files)
    assert f"skipped cannot decode image {paths[1]}" in caplog.text and files.num_skipped == 1
    assert (
        decoded.labels.tolist()
        == [10, 12, 12, 13]
        == [ImageFiles(samples, skip_corrupt=True).load(i)[1] for i in range(4)]
    )
    worker_samples = [Sample(str(refused_by_worker / p.name), 10 + i) for i, p in enumerate(paths)]
    worker = EncodedFiles(worker_samples, train=True, augment=Augment(randaugment_ops=2), skip_corrupt=True)
    stands_in = collate_encoded([worker[(i, 100 + i)] for i in range(4)])
    for took, expected in zip(decoded.augmentation, stands_in.augmentation, strict=True):
        torch.testing.assert_close(took, expected, rtol=0, atol=0, equal_nan=True)
    assert decoded.augmentation.index.tolist() == [0, 2, 2, 3] and decoded.augmentation.seed.tolist() == [
        100,
        101,
        102,
        103,
    ]
    assert not torch.equal(decoded.augmentation.box[1], decoded.augmentation.box[2])  # its own seed's crop
    assert torch.equal(decoded.images[1], torch.tensor(read_rgb(paths[2])).permute(2, 0, 1))
    x, y = augment_decoded(decoded, 32)
    assert x.shape == (4, 3, 32, 32) and y.tolist() == [10, 12, 12, 13]
    torch.testing.assert_close(x, augment_decoded(decode_encoded(stands_in, "cpu", worker), 32)[0], rtol=0, atol=0)

    evaluation = EncodedFiles(samples, train=False, skip_corrupt=True)
    decoded = decode_encoded(collate_encoded([evaluation[i] for i in range(4)]), "cpu", evaluation)
    per_sample = ImageFiles(samples, skip_corrupt=True, substitute=False)
    assert decoded.labels.tolist() == [per_sample.load(i)[1] for i in range(4)] == [10, MISSING, 12, 13]
    assert augment_decoded(decoded, 32)[0].shape == (4, 3, 32, 32)


def _recipe(data: Path, run: Path, *extra: str) -> list[str]:
    """configs/imagenet_resnet50.yaml (random resized crops, 0.875 eval crop, SGD, label smoothing) with
    a ResNet-18 at 72 px on a small JPEG folder, the device pipeline (a batch ahead, in a thread, as on a
    GPU; half the JPEGs decoded in the loader worker) and RandAugment on: 3 epochs of 4 steps."""
    return [
        "fit", "--config", str(ROOT / "configs/imagenet_resnet50.yaml"), *QUIET,
        "--trainer.default_root_dir", str(run), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.strategy", "auto", "--trainer.precision", "32-true", "--trainer.max_epochs", "3",
        "--trainer.logger", "false", "--model.model_name", "resnet18", "--data.root", str(data),
        "--data.img_size", "72", "--data.batch_size", "8", "--data.num_workers", "0",
        "--data.pipeline", "device", "--data.device.prefetch", "1", "--data.device.worker_decode", "0.5",
        "--data.augment.randaugment_ops", "2", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_the_resnet50_recipe_with_device_decoding_resumes_mid_epoch_to_the_same_weights(tmp_path, one_thread):
    """SIGTERM after step 6 (epoch 1, batch 2 of 4), resumed with --ckpt_path last: the model and
    optimizer equal an uninterrupted run's, bit for bit; a PNG among the JPEGs takes the CPU decoder."""
    data = write_image_folder(tmp_path / "data", train=8, val=2, size=96, ext="jpg")
    Image.open(data / "train" / "class1" / "3.jpg").save(data / "train" / "class1" / "3.png")
    (data / "train" / "class1" / "3.jpg").unlink()
    (data / "train" / "class1" / "9.jpg").write_bytes((data / "train" / "class1" / "0.jpg").read_bytes())
    with pytest.raises(SystemExit) as stopped:
        main(_recipe(data, tmp_path / "run", *signal_at(6, "SIGTERM")))
    assert stopped.value.code == 143
    resumed = main(_recipe(data, tmp_path / "run", "--ckpt_path", "last"))
    straight = main(_recipe(data, tmp_path / "straight"))
    assert resumed.trainer.global_step == straight.trainer.global_step == 12
    assert_bit_identical(weights(resumed), weights(straight))
    train_line = straight.datamodule.describe_transforms()[0]
    assert train_line.startswith("decode on the training device (50% of the JPEGs in the loader workers), random")
    assert "RandAugment 2 ops" in train_line
    assert float(straight.trainer.callback_metrics["val/acc1"]) > 0.25  # 4 classes by grey level: it learns


def test_device_decoding_refuses_what_it_does_not_do():
    from vit.data import ImageFolderDataModule

    with pytest.raises(ValueError, match=r"data\.augment\.crop: got 'pad_crop', expected rrc or resize with --data"):
        ImageFolderDataModule(str(ROOT / "tests"), img_size=224, pipeline="device", augment={"crop": "pad_crop"})
    with pytest.raises(ValueError, match="default, which the device pipeline does not do"):  # small images' crop
        ImageFolderDataModule(str(ROOT / "tests"), img_size=32, pipeline="device")
    with pytest.raises(ValueError, match=r"data\.device\.worker_decode: got 0\.5, expected 0\.0 unless --data\.pipel"):
        ImageFolderDataModule(str(ROOT / "tests"), img_size=224, device={"worker_decode": 0.5})
    with pytest.raises(ValueError, match=r"data\.device\.worker_decode: got -0\.1, expected a share .* from 0 to 1"):
        ImageFolderDataModule(str(ROOT / "tests"), img_size=224, pipeline="device", device={"worker_decode": -0.1})
