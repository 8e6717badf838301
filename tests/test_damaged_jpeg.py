"""One rule for a damaged JPEG (vit.data.images.jpeg_damage) on every path that reads images: per
sample, in memory, decoded on the device, converted for streaming, capped by resize_folder."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
from PIL import Image

from vit.data.device import EncodedFiles, collate_encoded, decode_encoded
from vit.data.images import CUT_ZEROS, CorruptImageError, ImageFiles, Sample, jpeg_damage, read_header, read_rgb
from vit.data.memory import to_tensor_images
from vit.tools.convert_streaming import encoded
from vit.tools.data_check import synthetic_photo
from vit.tools.resize_folder import resize_folder


def _jpeg(seed: int = 0, width: int = 96, height: int = 72, **options) -> bytes:
    buffer = io.BytesIO()
    synthetic_photo(np.random.default_rng(seed), width, height).save(buffer, "JPEG", quality=90, **options)
    return buffer.getvalue()


def _damaged(data: bytes) -> dict[str, bytes]:
    """The ways a download or a copy leaves a JPEG: cut short; preallocated and half written (its
    second half zeros); half written with its last block (the end marker) in place."""
    half = len(data) // 2
    return {
        "cut": data[:half],
        "zero-filled": data[:half] + bytes(len(data) - half),
        "zero-filled, end marker kept": data[:half] + bytes(len(data) - half - 2) + b"\xff\xd9",
    }


@pytest.mark.parametrize("damage", ["cut", "zero-filled", "zero-filled, end marker kept"])
def test_a_damaged_jpeg_is_refused_naming_it_or_skipped_and_listed_on_every_path(tmp_path, damage, caplog):
    good = [tmp_path / "images" / f"{i}.jpg" for i in range(3)]
    good[0].parent.mkdir()
    for i, path in enumerate(good):
        path.write_bytes(_jpeg(i))
    bad = tmp_path / "images" / "bad.jpg"
    bad.write_bytes(_damaged(_jpeg(7))[damage])
    samples = [Sample(str(good[0]), 0), Sample(str(bad), 1), Sample(str(good[1]), 2), Sample(str(good[2]), 3)]
    reason = "truncated" if damage != "zero-filled, end marker kept" else "ends in .* zero bytes"
    assert jpeg_damage(bad.read_bytes()) is not None and all(jpeg_damage(p.read_bytes()) is None for p in good)

    with pytest.raises(CorruptImageError, match=f"cannot decode image {bad}: .*{reason}"):  # per sample
        read_rgb(bad)
    with caplog.at_level(logging.WARNING, logger="vit"):
        per_sample = ImageFiles(samples, skip_corrupt=True)
        assert per_sample.load(1)[1] == 2 and per_sample.num_skipped == 1  # the next image takes its place
        in_memory = to_tensor_images(ImageFiles(samples, skip_corrupt=True), 32)
        assert in_memory.labels.tolist() == [0, 2, 3]  # left out
        on_device = EncodedFiles(samples, train=True, skip_corrupt=True)  # the worker reads its header
        assert on_device[(1, 0)][1] == 2 and on_device.num_skipped == 1
        with pytest.raises(CorruptImageError, match=f"cannot decode image {bad}: .*{reason}"):
            EncodedFiles(samples, train=True)[(1, 0)]
    assert caplog.text.count(f"skipped cannot decode image {bad}") == 3
    with pytest.raises(CorruptImageError, match=f"cannot decode image {bad}: .*{reason}"):  # streaming conversion
        encoded(bad, None, 90)
    source = tmp_path / "folder"
    (source / "train" / "a").mkdir(parents=True)
    for path in (*good, bad):
        (source / "train" / "a" / path.name).write_bytes(path.read_bytes())
    outcomes = resize_folder(source, tmp_path / "capped", max_side=512, skip_corrupt=True)  # all within the cap
    assert len(outcomes["copied"]) == 3 and [reason[:19] for reason in outcomes["corrupt"]] == ["cannot decode image"]
    assert not (tmp_path / "capped" / "train" / "a" / "bad.jpg").exists()


def test_a_jpeg_whose_tables_write_a_flat_end_as_zero_bits_is_not_taken_for_a_cut_one():
    """Optimised Huffman tables may code a flat block (no DC change, then end-of-block) as zero
    bits, so a catalogue photo (an object on white) can end its scan in a run of zero bytes: a
    sound file, which a rule on the zeros alone would refuse."""
    found = []
    for width in range(64, 128):  # the scan ends byte-aligned (no padding bits) for some widths
        pixels = np.full((96, width, 3), 255, np.uint8)
        pixels[8:40, 8:40] = (200, 30, 30)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "JPEG", quality=90, optimize=True)
        data = buffer.getvalue()
        scan = data[: data.rindex(b"\xff\xd9")]
        if len(scan) - len(scan.rstrip(b"\0")) >= CUT_ZEROS:
            found.append(data)
    assert found, "no width gave a scan that ends in zeros: the test checks nothing"
    for data in found:
        assert jpeg_damage(data) is None
        assert read_header(data)[2]  # the device decodes it
        with Image.open(io.BytesIO(data)) as image:
            assert np.array_equal(read_rgb(data), np.asarray(image.convert("RGB")))
    cut = _damaged(_jpeg(3))["zero-filled, end marker kept"]  # the same zeros with standard tables: cut
    assert "zero bytes" in jpeg_damage(cut)


@pytest.mark.parametrize(
    "options",
    [{}, {"optimize": True}, {"progressive": True}, {"subsampling": 0}, {"mode": "L"}, {"mode": "CMYK"}],
    ids=["standard tables", "optimised tables", "progressive", "4:4:4", "grey", "CMYK"],
)
def test_sound_jpegs_of_every_kind_pass_the_rule(options):
    options = dict(options)
    mode = options.pop("mode", "RGB")
    for seed in range(40):
        rng = np.random.default_rng(seed)
        width, height = (int(v) for v in rng.integers(8, 300, 2))
        pixels = np.asarray(synthetic_photo(rng, width, height))
        if seed % 2:
            pixels = pixels.copy()
            pixels[height // 2 :] = rng.integers(0, 256)  # flat regions: runs of the tables' shortest codes
        buffer = io.BytesIO()
        Image.fromarray(pixels).convert(mode).save(buffer, "JPEG", quality=int(rng.integers(30, 101)), **options)
        assert jpeg_damage(buffer.getvalue()) is None, (seed, options)


def test_a_decoder_error_names_the_file_alone(tmp_path):
    """Not PIL's in-memory buffer (`<_io.BytesIO object at 0x...>`) nor torchvision's source line."""
    paths = [tmp_path / f"{i}.jpg" for i in range(3)]
    for i, path in enumerate(paths):
        path.write_bytes(_jpeg(i, 64, 48))
    paths[1].write_bytes(b"an error page saved as a .jpg")
    samples = [Sample(str(p), i) for i, p in enumerate(paths)]
    with pytest.raises(CorruptImageError) as error:
        EncodedFiles(samples, train=True)[(1, 0)]
    assert str(error.value) == f"cannot decode image {paths[1]}: cannot identify image file"
    jpeg = paths[2].read_bytes()
    paths[2].write_bytes(jpeg[:300] + bytes(len(jpeg) - 302) + jpeg[-2:])  # sound markers, tables zeroed
    files = EncodedFiles(samples, train=True)
    with pytest.raises(CorruptImageError) as error:
        decode_encoded(collate_encoded([files[(0, 0)], files[(2, 0)]]), "cpu", files)
    assert str(error.value).startswith(f"cannot decode image {paths[2]}: ") and ".cpp" not in str(error.value)


def test_a_corrupt_file_read_again_is_counted_and_logged_once(tmp_path, caplog):
    """Validation reads the same files each epoch (and in Lightning's sanity check): one file, one
    count, in the loader workers and in the device's decoder."""
    paths = [tmp_path / f"{i}.jpg" for i in range(3)]
    for i, path in enumerate(paths):
        path.write_bytes(_jpeg(i, 64, 48))
    paths[1].write_bytes(paths[1].read_bytes()[:500])  # cut: refused where it is read
    jpeg = paths[2].read_bytes()
    paths[2].write_bytes(jpeg[:300] + bytes(len(jpeg) - 302) + jpeg[-2:])  # refused by the device's decoder
    samples = [Sample(str(p), i) for i, p in enumerate(paths)]
    per_sample = ImageFiles(samples, skip_corrupt=True, substitute=False)
    on_device = EncodedFiles(samples, train=False, skip_corrupt=True)
    with caplog.at_level(logging.WARNING, logger="vit"):
        for _ in range(3):  # three epochs
            per_sample[1]
            decode_encoded(collate_encoded([on_device[i] for i in range(3)]), "cpu", on_device)
    assert per_sample.num_skipped == 1 and on_device.num_skipped == 2
    assert [caplog.text.count(f"skipped cannot decode image {p}") for p in paths] == [0, 2, 1]
