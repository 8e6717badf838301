"""Sharded streaming data (vit.data.streaming over litdata): a converted image folder holds every
image with its label; the chunked order gives each process an equal share of its own chunks;
training on it resumes bit for bit, and 2 DDP processes read distinct samples."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import ROOT, write_image_folder
from tests.test_fault_tolerance import QUIET, _free_port, assert_bit_identical, signal_at, weights
from vit.cli import main
from vit.data import StreamingDataModule
from vit.data.augment import Augment
from vit.data.device import EncodedFiles, collate_encoded, decode_encoded
from vit.data.images import CorruptImageError, scan_image_folder
from vit.data.sampling import ChunkedSampler
from vit.data.streaming import StreamingImages, open_streaming
from vit.tools.convert_streaming import convert_image_folder
from vit.tools.convert_streaming import main as convert_main

pytest.importorskip("litdata")


def _source(tmp_path: Path, train: int = 12) -> Path:
    return write_image_folder(tmp_path / "src", train=train, val=2, size=40, ext="jpg")


def test_a_converted_folder_holds_every_image_with_its_label_and_the_class_names(tmp_path):
    source = _source(tmp_path)
    report = convert_image_folder(source, tmp_path / "stream", chunk_bytes="8KB")
    assert report == {"train": {"written": 48, "left out": []}, "val": {"written": 8, "left out": []}}
    for split in ("train", "val"):
        classes, files = scan_image_folder(source / split)
        images = StreamingImages(str(tmp_path / "stream" / split))
        stored = open_streaming(str(tmp_path / "stream" / split))
        assert images.classes == classes == ["class0", "class1", "class2", "class3"]
        assert len(images.index["chunks"]) > 1 and images.chunk_of[0] == 0 and images.chunk_of[-1] > 0
        paths = [stored[i]["path"] for i in range(len(images))]
        assert sorted(paths) == sorted(str(Path(f.path).relative_to(source)) for f in files)
        for i, path in enumerate(paths):  # the file's bytes, its class folder's label
            assert images.read_bytes(i) == (source / path).read_bytes()
            assert images.samples[i].label == stored[i]["label"] == classes.index(Path(path).parent.name)
        # training images are written shuffled (each chunk mixes the classes); validation in folder order
        assert (paths != sorted(paths)) == (split == "train")
    assert convert_image_folder(source, tmp_path / "stream")["train"] == {"kept": 48, "options": "no --max-side"}


def test_reading_in_a_shuffled_order_deserializes_only_the_samples_read(tmp_path, monkeypatch):
    """Our sampler reads by index in a shuffled order: each read deserializes its own sample's
    fields, not litdata's default window of up to 256 samples around it (which doubled a loader
    worker's time per image on 500x375 JPEGs)."""
    from litdata.streaming import serializers

    convert_image_folder(_source(tmp_path, train=60), tmp_path / "stream")  # 240 images in one chunk
    images = StreamingImages(str(tmp_path / "stream" / "train"))
    assert len(images.index["chunks"]) == 1
    read = []
    for name in ("NumericSerializer", "StringSerializer"):  # a sample's label and path
        cls = getattr(serializers, name)
        monkeypatch.setattr(cls, "deserialize", lambda self, data, _f=cls.deserialize: read.append(1) or _f(self, data))
    for i in np.random.default_rng(0).permutation(len(images))[:20]:
        assert images.read_bytes(int(i))[:3] == b"\xff\xd8\xff"
    assert len(read) == 2 * 20  # each read: its own label and path


def test_a_loader_worker_reads_its_batch_chunk_by_chunk_and_returns_it_in_the_order_asked(tmp_path, monkeypatch):
    """litdata keeps a few chunks mapped in each process: a shuffled batch read sample by sample
    maps and unmaps them in turn. A worker's batch (`__getitems__`, as the DataLoader asks) is read
    chunk by chunk, each chunk in stored order, and comes back as reading each sample alone gives
    it, for the device path's encoded files as for the per-sample path's decoded images."""
    convert_image_folder(_source(tmp_path), tmp_path / "stream", chunk_bytes="8KB")
    images = StreamingImages(str(tmp_path / "stream" / "train"))
    assert len(images.index["chunks"]) >= 4
    rng = np.random.default_rng(0)
    items = [(int(i), int(rng.integers(2**31))) for i in rng.permutation(len(images))[:20]]
    read: list[int] = []
    stored_read = images.read_item
    monkeypatch.setattr(images, "read_item", lambda i: read.append(int(images.positions[i])) or stored_read(i))
    for dataset in (EncodedFiles(images, train=True, augment=Augment(crop="rrc", hflip=True)), images):
        read.clear()
        batch = dataset.__getitems__(items)
        assert read == sorted(read) and sorted(read) == sorted(i for i, _ in items)  # stored order: chunk by chunk
        alone = [dataset[item] for item in items]
        for (image, label, *params), (image_alone, label_alone, *params_alone) in zip(batch, alone, strict=True):
            assert np.array_equal(np.asarray(image), np.asarray(image_alone)) and label == label_alone
            for a, b in zip(params, params_alone, strict=True):  # the parameters drawn (NaN: an op not taken)
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    half = images.subset(np.arange(len(images))[::2], None)  # a split of it: its positions 3, 0, 1 are stored 6, 0, 2
    assert [int(half.positions[[3, 0, 1][k]]) for k in half.read_order([3, 0, 1])] == [0, 2, 6]


def test_conversion_names_a_corrupt_image_leaves_it_out_with_skip_corrupt_and_caps_sizes(tmp_path, capsys):
    source = _source(tmp_path, train=3)
    corrupt = source / "train" / "class1" / "2.jpg"
    corrupt.write_bytes(corrupt.read_bytes()[:300])
    Image.new("RGB", (300, 120), (200, 10, 10)).save(source / "train" / "class2" / "big.jpg", quality=90)
    with pytest.raises(CorruptImageError, match=f"cannot decode image {corrupt}"):
        convert_image_folder(source, tmp_path / "stream")
    assert not (tmp_path / "stream" / "train").exists()  # nothing half written under the split's name

    convert_main([str(source), str(tmp_path / "stream"), "--skip-corrupt", "--max-side", "60", "--workers", "1"])
    printed = capsys.readouterr()
    assert f"{tmp_path / 'stream' / 'train'}: 12 images, 1 left out" in printed.out
    assert f"left out: cannot decode image {corrupt}" in printed.err
    images, stored = StreamingImages(str(tmp_path / "stream" / "train")), open_streaming(str(tmp_path / "stream/train"))
    big = next(i for i in range(len(images)) if stored[i]["path"].endswith("big.jpg"))
    assert images.read_image(big).shape == (24, 60, 3)  # the longer side capped at 60
    assert len(list(tmp_path.joinpath("stream").glob(".*.tmp"))) == 0


def test_conversion_decodes_the_files_that_are_not_jpegs_and_names_what_it_leaves_out(tmp_path, monkeypatch):
    """A cut PNG's header reads, its pixels do not: named at conversion, not first in training; an
    image over PIL's pixel limit is left out with skip_corrupt, as training would skip it."""
    source = _source(tmp_path, train=2)
    png = source / "train" / "class0" / "cut.png"
    Image.new("RGB", (64, 48), (1, 2, 3)).save(png)
    png.write_bytes(png.read_bytes()[:-40])
    with pytest.raises(CorruptImageError, match=f"cannot decode image {png}: image file is truncated"):
        convert_image_folder(source, tmp_path / "stream")
    png.unlink()
    huge = source / "train" / "class1" / "huge.jpg"
    Image.new("RGB", (400, 300)).save(huge)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50_000)  # 400 x 300 is over twice it
    report = convert_image_folder(source, tmp_path / "stream", skip_corrupt=True)
    assert report["train"]["written"] == 8 and report["train"]["left out"] == [
        f"cannot decode image {huge}: 120000 pixels exceeds twice PIL's limit of 50000"
    ]


def test_conversion_refuses_what_it_would_not_write_where_asked_before_doing_any_work(tmp_path, capsys):
    """An s3:// target (convert locally, then copy), a folder that is not a converted split, a
    litdata dataset written without our labels and a --chunk-bytes that is not a size: refused,
    naming them, before a file is converted. A broken symlink is named as one and left out with
    skip_corrupt; a file name that is not UTF-8 is stored readably."""
    source = _source(tmp_path, train=2)
    with pytest.raises(ValueError, match="s3:/bucket/x is not a local folder"):
        convert_main([str(source), "s3://bucket/x", "--workers", "1"])
    stream = tmp_path / "stream"
    (stream / "train").mkdir(parents=True)
    (stream / "train" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=f"{stream / 'train'} exists and is not a converted split"):
        convert_image_folder(source, stream)
    assert sorted(p.name for p in stream.iterdir()) == ["train"]  # no split begun
    (stream / "train" / "notes.txt").unlink()
    (stream / "val").mkdir()
    (stream / "val" / "index.json").write_text(json.dumps({"chunks": [], "config": {}}))
    with pytest.raises(ValueError, match=r"index\.json has no class names and labels"):
        convert_image_folder(source, stream)
    (stream / "val" / "index.json").unlink()
    with pytest.raises(SystemExit):  # argparse's, before any work
        convert_main([str(source), str(stream), "--chunk-bytes", "100 apples"])
    assert "'100 apples' is not a size: bytes, or a number with a unit" in capsys.readouterr().err
    link = source / "train" / "class1" / "gone.jpg"
    link.symlink_to(tmp_path / "nowhere.jpg")
    for max_side in (None, 64):  # named before any resizing too
        report = convert_image_folder(source, stream, max_side, skip_corrupt=True, splits=("train",))
        assert report["train"]["left out"] == [
            f"cannot read image {link}: it is a broken symlink (to {tmp_path / 'nowhere.jpg'})"
        ]
        shutil.rmtree(stream / "train")
    link.unlink()
    latin1 = source / "train" / "class0" / os.fsdecode(b"caf\xe9.jpg")
    (source / "train" / "class0" / "0.jpg").rename(latin1)
    assert convert_image_folder(source, stream)["train"]["written"] == 8  # into the empty folders left
    stored = open_streaming(str(stream / "train"))
    assert "train/class0/caf\\xe9.jpg" in {stored[i]["path"] for i in range(8)}


def test_a_streaming_sample_that_does_not_decode_is_named_with_the_file_it_came_from(tmp_path):
    source = _source(tmp_path, train=2)
    broken = source / "train" / "class2" / "1.jpg"
    jpeg = broken.read_bytes()
    broken.write_bytes(jpeg[:300] + bytes(len(jpeg) - 302) + jpeg[-2:])  # header and end marker sound, scan not
    convert_image_folder(source, tmp_path / "stream")
    images = StreamingImages(str(tmp_path / "stream" / "train"))
    position = next(i for i in range(len(images)) if images.name(i).endswith("(train/class2/1.jpg)"))
    name = f"{tmp_path / 'stream' / 'train'}[{images.positions[position]}] (train/class2/1.jpg)"
    with pytest.raises(CorruptImageError, match=f"cannot decode image {re.escape(name)}: "):
        images.read_image(position)
    files = EncodedFiles(images, train=True)
    batch = collate_encoded([files[(position, 0)]])
    with pytest.raises(CorruptImageError, match=f"cannot decode image {re.escape(name)}: "):
        decode_encoded(batch, "cpu", files)


def test_a_loader_worker_reads_a_streaming_sample_once_whatever_decodes_it(tmp_path, monkeypatch):
    """A PNG (decoded in the worker) is read from its chunk once, as a JPEG is: its name, which
    costs a read, is looked up only for an error."""
    source = _source(tmp_path, train=1)
    Image.new("RGB", (40, 30), (9, 8, 7)).save(source / "train" / "class0" / "flat.png")
    convert_image_folder(source, tmp_path / "stream")
    images = StreamingImages(str(tmp_path / "stream" / "train"))
    reads, stored_read = [], images.read_item
    monkeypatch.setattr(images, "read_item", lambda i: reads.append(i) or stored_read(i))
    files = EncodedFiles(images, train=True)
    for position in range(len(images)):
        reads.clear()
        image, _, _ = files[(position, 0)]
        assert reads == [position], (position, image.shape)


def test_streaming_images_decoded_into_memory_are_cached_by_their_chunks(tmp_path):
    convert_image_folder(_source(tmp_path, train=2), tmp_path / "stream")
    data = StreamingDataModule(str(tmp_path / "stream"), img_size=16, batch_size=4, num_workers=0, pipeline="memory",
                               memory={"cache_dir": str(tmp_path / "cache")})  # fmt: skip
    data.setup("fit")
    x, _, _ = next(iter(data.train_dataloader()))
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.uint8
    assert next(iter(data.val_dataloader()))[0].shape == (4, 3, 16, 16)
    cached = {path: path.stat().st_mtime_ns for path in (tmp_path / "cache").glob("images-*.npz")}
    assert len(cached) == 2  # train and val
    again = StreamingDataModule(str(tmp_path / "stream"), img_size=16, batch_size=4, num_workers=0, pipeline="memory",
                                memory={"cache_dir": str(tmp_path / "cache")})  # fmt: skip
    again.setup("fit")
    again.train_dataloader(), again.val_dataloader()
    decoded = [d.composed.dataset(d.spec, d.train_set, d.run(), train=True).images for d in (again, data)]
    assert torch.equal(*decoded)
    assert {path: path.stat().st_mtime_ns for path in (tmp_path / "cache").glob("images-*.npz")} == cached  # read


def test_the_chunked_order_gives_each_process_an_equal_share_of_its_own_chunks():
    """1,000 samples in 20 chunks of 50, 4 processes: each reads 250 distinct samples, together all;
    a process's chunks are its own but for the 2 its share begins and ends in; 64 samples in a row
    come from at most the 8 chunks of a window (+1 where windows meet) and mix several; the order
    is a function of (seed, epoch)."""
    chunk_of = np.arange(1000) // 50
    dataset = list(range(1000))

    def order(rank: int, epoch: int = 0, seed: int = 3, world: int = 4) -> list[int]:
        sampler = ChunkedSampler(dataset, chunk_of, seed=seed, window=8, num_replicas=world, rank=rank)
        sampler.set_epoch(epoch)
        return sampler.epoch_order()

    shares = [order(rank) for rank in range(4)]
    assert [len(s) for s in shares] == [250] * 4 and sorted(np.concatenate(shares).tolist()) == dataset
    chunks = [set(chunk_of[s]) for s in shares]
    assert all(len(a & b) <= 1 for i, a in enumerate(chunks) for b in chunks[i + 1 :])
    assert all(len(c) <= 250 // 50 + 1 for c in chunks)
    for share in shares:
        for start in range(0, 250 - 64, 64):
            assert 2 <= len(set(chunk_of[share[start : start + 64]])) <= 9
    assert order(1) == shares[1] and order(1, epoch=1) != shares[1] and order(1, seed=4) != shares[1]
    thirds = [order(rank, world=3) for rank in range(3)]  # 1,000 = 3 x 334 - 2: two samples read twice
    assert [len(t) for t in thirds] == [334] * 3 and set(np.concatenate(thirds).tolist()) == set(dataset)


def _recipe(stream: Path, run: Path, *extra: str) -> list[str]:
    """configs/imagenet_resnet50.yaml (the device pipeline, random resized crops, SGD) with a ResNet-18
    at 32 px on the converted folder: 3 epochs of 4 steps."""
    return [
        "fit", "--config", str(ROOT / "configs/imagenet_resnet50.yaml"), *QUIET,
        "--trainer.default_root_dir", str(run), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.strategy", "auto", "--trainer.precision", "32-true", "--trainer.max_epochs", "3",
        "--trainer.logger", "false", "--model.model_name", "resnet18",
        "--data", "vit.data.StreamingDataModule", "--data.root", str(stream), "--data.img_size", "32",
        "--data.augment", "{crop: rrc, randaugment_ops: 2}", "--data.batch_size", "8", "--data.num_workers", "0",
        *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_training_on_streaming_data_resumes_mid_epoch_to_the_same_weights(tmp_path, one_thread):
    """SIGTERM after step 6 (epoch 1, batch 2 of 4), resumed with --ckpt_path last: the model equals
    an uninterrupted run's bit for bit; the shipped config's device decoding and augmentation ran."""
    convert_image_folder(_source(tmp_path, train=8), tmp_path / "stream", chunk_bytes="8KB")
    with pytest.raises(SystemExit) as stopped:
        main(_recipe(tmp_path / "stream", tmp_path / "run", *signal_at(6, "SIGTERM")))
    assert stopped.value.code == 143
    resumed = main(_recipe(tmp_path / "stream", tmp_path / "run", "--ckpt_path", "last"))
    straight = main(_recipe(tmp_path / "stream", tmp_path / "straight"))
    assert resumed.trainer.global_step == straight.trainer.global_step == 12
    assert_bit_identical(weights(resumed), weights(straight))
    assert isinstance(straight.datamodule, StreamingDataModule) and straight.model.hparams.num_classes == 4
    assert "decode on the training device, random resized crop 32" in straight.datamodule.describe_transforms()[0]


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", ["0", "1"])
def test_two_ddp_processes_read_distinct_samples_of_a_streaming_set_and_stay_identical(tmp_path, prefetch):
    """2 gloo processes, 2 epochs over 48 images in chunks: each epoch, each rank reads 24 images,
    together all 48; the replicas' weights are equal at the end. Decoded when each step begins,
    or a batch ahead in a thread (as on a GPU), validation included."""
    convert_image_folder(_source(tmp_path), tmp_path / "stream", chunk_bytes="8KB")
    report = tmp_path / "report.yaml"
    report.write_text(
        "trainer:\n  callbacks:\n    - class_path: tests.rank_report.RankReport\n"
        f"      init_args:\n        dirpath: {tmp_path / 'report'}\n        orders: true\n"
    )
    command = [
        sys.executable, str(ROOT / "scripts" / "train.py"), "fit", "--config", str(ROOT / "configs/default.yaml"),
        "--config", str(report), "--trainer.default_root_dir", str(tmp_path / "run"),
        "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.devices", "2",
        "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false",
        "--data", "vit.data.StreamingDataModule", "--data.root", str(tmp_path / "stream"), "--data.img_size", "16",
        "--data.augment.crop", "rrc", "--data.pipeline", "device", "--data.batch_size", "6",
        "--data.num_workers", "1", "--data.device.prefetch", prefetch,
    ]  # fmt: skip
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port())}
    result = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True,
                            timeout=300, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / "report" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["global_step"] for r in reports] == [8, 8]  # 2 epochs of 24 images a rank, 6 a step
    for epoch in (0, 1):
        seen = [r["orders"][epoch] for r in reports]
        assert len(seen[0]) == len(seen[1]) == 24 and sorted(seen[0] + seen[1]) == list(range(48))
    assert reports[0]["orders"][0] != reports[0]["orders"][1]
    ranks = [torch.load(tmp_path / "report" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(torch.equal(value, ranks[1][name]) for name, value in ranks[0].items())


def test_a_mid_epoch_resume_with_another_process_count_restarts_the_epoch_of_chunked_data(caplog):
    """Each process's share of the chunks depends on the process count: resumed with 1 process
    instead of 2 after 3 batches, the chunked order's epoch restarts (no image is skipped), where a
    batch-size change alone carries the position on."""
    from vit.data.sampling import carry_position

    def resumed_at(saved: dict, now: dict) -> int:
        progress = {"current": {"ready": 3, "started": 3, "processed": 3, "completed": 3}}
        carry_position({"loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}, saved, now)
        return progress["current"]["processed"]

    chunked = {"train_images": 48, "order_per_process": True}
    assert resumed_at({"batch_size": 4, "world_size": 2}, {"batch_size": 4, "world_size": 1, **chunked}) == 0
    assert "restarts from its first batch" in caplog.text
    assert resumed_at({"batch_size": 4, "world_size": 2}, {"batch_size": 8, "world_size": 2, **chunked}) == 1
    assert resumed_at({"batch_size": 4, "world_size": 2}, {"batch_size": 4, "world_size": 1, "train_images": 48}) == 6


@pytest.fixture
def s3_server(monkeypatch):
    """A local S3 server (moto) and the environment boto3 and litdata read it from, as users point
    them at an S3-compatible store: AWS_ENDPOINT_URL and credentials."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for key, value in {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    yield
    server.stop()


def _upload(folder: Path, bucket: str, prefix: str) -> None:
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket=bucket)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")


@pytest.mark.slow
def test_a_streaming_set_in_object_storage_trains_as_its_local_copy_does(tmp_path, s3_server, one_thread):
    """The converted folder uploaded to an S3 bucket (a local S3 server): read from `s3://`, each
    sample has the local copy's bytes and label, and a run from it ends with the weights of a run
    from the local folder, bit for bit; litdata caches in chunk_cache_dir."""
    convert_image_folder(_source(tmp_path, train=8), tmp_path / "stream", chunk_bytes="8KB")
    _upload(tmp_path / "stream", "datasets", "imagenet-streaming")
    url = "s3://datasets/imagenet-streaming"
    local, remote = StreamingImages(str(tmp_path / "stream" / "train")), StreamingImages(f"{url}/train")
    assert len(remote) == len(local) == 32 and remote.class_names == local.class_names
    assert [s.label for s in remote.samples] == [s.label for s in local.samples]
    assert all(remote.read_bytes(i) == local.read_bytes(i) for i in range(len(local)))
    cache = tmp_path / "chunk-cache"
    from_s3 = main(_recipe(url, tmp_path / "s3", "--data.chunk_cache_dir", str(cache), "--trainer.max_epochs", "1"))
    from_folder = main(_recipe(tmp_path / "stream", tmp_path / "folder", "--trainer.max_epochs", "1"))
    assert from_s3.trainer.global_step == from_folder.trainer.global_step == 4
    assert_bit_identical(weights(from_s3), weights(from_folder))
    assert len(list(cache.rglob("index.json"))) == 2  # litdata's cache (train and val) is where it was asked to be


def test_a_rerun_with_another_cap_or_quality_than_a_kept_split_is_refused_naming_both(tmp_path, capsys):
    """A kept split and one written now with another --max-side or --quality would hold images of
    other sizes in train and val: the index records both, and such a rerun is refused before any
    work. Without a cap the files' bytes are stored, so the quality is no matter."""
    source, stream = _source(tmp_path, train=2), tmp_path / "stream"
    convert_image_folder(source, stream, max_side=32, splits=("train",))  # val not yet: a run stopped after train
    train = stream / "train"
    recorded = json.loads((train / "index.json").read_text())["vit"]
    assert (recorded["max_side"], recorded["quality"]) == (32, 90)
    for max_side, quality, asked in ((24, 90, "--max-side 24 --quality 90"), (32, 80, "--max-side 32 --quality 80"),
                                     (None, 90, "no --max-side")):  # fmt: skip
        with pytest.raises(ValueError) as refused:
            convert_image_folder(source, stream, max_side, quality)
        assert str(refused.value) == (
            f"{train} was converted with --max-side 32 --quality 90, not {asked}: run with its options, "
            f"or delete {train} to convert it again with yours"
        )
        assert sorted(p.name for p in stream.iterdir()) == ["train"]  # no split begun
    with pytest.raises(ValueError, match=f"{train} was converted with --max-side 32 --quality 90, not --max-side 24"):
        convert_image_folder(source, stream, 24, splits=("val",))  # a split not asked for is checked too
    convert_main([str(source), str(stream), "--max-side", "32", "--workers", "2", "--skip-corrupt"])
    printed = capsys.readouterr().out
    assert f"{train}: already converted (8 images, --max-side 32 --quality 90), kept" in printed
    assert f"{stream / 'val'}: 8 images" in printed
    assert json.loads((stream / "val" / "index.json").read_text())["vit"]["max_side"] == 32
    uncapped = tmp_path / "uncapped"
    convert_image_folder(source, uncapped, splits=("train",))
    assert convert_image_folder(source, uncapped, quality=50)["val"]["written"] == 8


def test_a_split_converted_before_options_were_recorded_is_not_mixed_with_a_new_one(tmp_path, capsys):
    """An index written before --max-side and --quality were recorded: whether a split written now
    would match it is unknown, so that is refused; keeping it alone is said, not silent."""
    source, stream = _source(tmp_path, train=2), tmp_path / "stream"
    convert_image_folder(source, stream, max_side=32, splits=("train",))
    train = stream / "train"
    index = json.loads((train / "index.json").read_text())
    index["vit"] = {k: index["vit"][k] for k in ("classes", "class_names", "labels")}  # as older versions wrote it
    (train / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as refused:
        convert_image_folder(source, stream, max_side=32)
    assert str(refused.value) == (
        f"{train} does not record the --max-side and --quality it was converted with (an older version of this "
        f"command wrote it), so val might be written with other ones: delete {train} to convert the splits "
        "again in one run, or convert into another folder"
    )
    assert sorted(p.name for p in stream.iterdir()) == ["train"]
    convert_main([str(source), str(stream), "--max-side", "32", "--splits", "train", "--workers", "1"])
    assert capsys.readouterr().out == (
        f"{train}: already converted (8 images, its --max-side and --quality not recorded), kept\n"
    )


@pytest.mark.parametrize(
    "option, expected",
    [
        (["--chunk-bytes", "0"], "must be a size of at least 1 byte, got '0'"),
        (["--chunk-bytes", "0.0MB"], "must be a size of at least 1 byte, got '0.0MB'"),
        (["--quality", "200"], "must be a whole number from 1 to 100 (JPEG quality), got 200"),
        (["--max-side", "0"], "must be a whole number of at least 1, got 0"),
    ],
)
def test_a_conversion_option_out_of_range_is_a_usage_error_naming_it(tmp_path, capsys, option, expected):
    """--chunk-bytes 0 wrote the whole split as one chunk; PIL clamps any JPEG quality to 1-100."""
    source = _source(tmp_path, train=1)
    with pytest.raises(SystemExit) as stop:
        convert_main([str(source), str(tmp_path / "stream"), *option])
    assert stop.value.code == 2 and not (tmp_path / "stream").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: argument {option[0]}: {expected}")


def test_a_full_disk_while_converting_names_the_split_and_its_folder_and_removes_that_folder(tmp_path, monkeypatch):
    from litdata.streaming.writer import BinaryWriter

    def disk_full(self, raw_data, filename, compress=None):
        with open(os.path.join(self._cache_dir, filename), "wb") as out:
            out.write(raw_data[: len(raw_data) // 2])  # what fitted
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(BinaryWriter, "write_chunk_to_file", disk_full)
    source, stream = _source(tmp_path), tmp_path / "stream"
    with pytest.raises(OSError) as full:
        convert_main([str(source), str(stream), "--chunk-bytes", "8KB", "--workers", "1"])
    tmp = stream / ".train.tmp"
    assert str(full.value) == f"[Errno 28] cannot write the train split into {tmp}: No space left on device"
    assert full.value.errno == errno.ENOSPC and list(stream.iterdir()) == []


def test_training_from_a_conversion_that_did_not_finish_says_so(tmp_path, capsys):
    """A conversion killed while writing the training split leaves only its hidden temporary folder:
    training says that the conversion did not finish (litdata's error said that the path does not
    exist); no split at all, or an image folder where a converted split should be, are named too."""
    source, stream = _source(tmp_path, train=1), tmp_path / "stream"
    convert_image_folder(source, stream)
    os.rename(stream / "train", stream / ".train.tmp")  # as a kill -9 before the split's rename leaves it
    fit = ["fit", "--config", str(ROOT / "configs/default.yaml"), *QUIET, "--trainer.default_root_dir",
           str(tmp_path / "run"), "--data", "vit.data.StreamingDataModule", "--data.root", str(stream)]  # fmt: skip
    expected = [
        f"the conversion at {stream} did not finish ({stream / '.train.tmp'} is there but {stream / 'train'} is not): "
        "run scripts/convert_streaming.py again",
        f"{stream / 'train'} does not exist: convert the image folder with scripts/convert_streaming.py SRC {stream}",
        f"{stream / 'train'} has no index.json, so it is not a split converted by scripts/convert_streaming.py: "
        f"convert the image folder with scripts/convert_streaming.py SRC {stream}",
    ]
    for number, line in enumerate(expected):
        if number == 1:
            shutil.rmtree(stream / ".train.tmp")
        if number == 2:
            shutil.copytree(source / "train", stream / "train")  # an image folder, not converted
        with pytest.raises(SystemExit) as stop:
            main(fit)
        assert stop.value.code == 1
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {line}"


def _stored(split: Path) -> dict[str, int]:
    """Each stored image's source path and label."""
    stored = open_streaming(str(split))
    return {stored[i]["path"]: stored[i]["label"] for i in range(len(stored))}


def test_a_kept_split_whose_source_changed_is_refused_naming_the_changes_and_overwrite_converts_it_again(
    tmp_path, capsys
):
    """Chunks cannot be updated file by file (the training split is shuffled across them): a rerun
    over a split whose source changed (an image moved to another class, one rewritten, one added,
    one removed) is refused before any work, naming the changes; --overwrite converts that split
    again, the unchanged split is kept, and a rerun after that keeps both."""
    source, stream = _source(tmp_path, train=2), tmp_path / "stream"
    (source / "train/class0/0.jpg").rename(source / "train/class0/a.jpg")
    convert_image_folder(source, stream)
    (source / "train/class0/a.jpg").rename(source / "train/class1/a.jpg")  # mv keeps its size and time
    Image.new("RGB", (40, 40), (250, 0, 0)).save(source / "train/class2/1.jpg")
    Image.new("RGB", (40, 40), (0, 0, 250)).save(source / "train/class3/new.jpg")
    (source / "train/class3/0.jpg").unlink()
    before = {p: p.stat().st_mtime_ns for p in stream.rglob("*")}
    with pytest.raises(ValueError) as refused:
        convert_main([str(source), str(stream), "--workers", "1"])
    assert str(refused.value) == (
        f"4 change(s) in {source / 'train'} since {stream / 'train'} was written (train/class0/a.jpg moved to "
        "train/class1/, train/class2/1.jpg rewritten, train/class3/new.jpg added, ...): delete "
        f"{stream / 'train'} or pass --overwrite to convert it again"
    )
    assert {p: p.stat().st_mtime_ns for p in stream.rglob("*")} == before  # nothing done
    capsys.readouterr()
    convert_main([str(source), str(stream), "--workers", "1", "--overwrite"])
    assert capsys.readouterr().out == (
        f"{stream / 'train'}: 8 images, converted again (4 change(s) in its source)\n"
        f"{stream / 'val'}: already converted (8 images, no --max-side), kept\n"
    )
    stored = _stored(stream / "train")
    _, samples = scan_image_folder(source / "train")
    assert stored == {str(Path(s.path).relative_to(source)): s.label for s in samples}
    assert stored["train/class1/a.jpg"] == 1 and "train/class0/a.jpg" not in stored  # in one class: its new one
    images = StreamingImages(str(stream / "train"))
    rewritten = next(i for i in range(len(images)) if images.name(i).endswith("(train/class2/1.jpg)"))
    assert images.read_bytes(rewritten) == (source / "train/class2/1.jpg").read_bytes()
    assert sorted(p.name for p in stream.iterdir()) == ["train", "val"]  # the old split gone, no temporary left
    assert convert_image_folder(source, stream) == {
        "train": {"kept": 8, "options": "no --max-side"}, "val": {"kept": 8, "options": "no --max-side"}
    }  # fmt: skip


def test_a_split_whose_classes_changed_or_written_before_sources_were_recorded_is_compared_as_it_can_be(tmp_path):
    """A class folder added changes every split's labels: each kept split is refused. A split that
    an older version wrote records no sources: the source's files and folders newer than its index
    are named."""
    source, stream = _source(tmp_path, train=2), tmp_path / "stream"
    convert_image_folder(source, stream)
    Image.new("RGB", (40, 40)).save((source / "train/class9").mkdir() or source / "train/class9/0.jpg")
    with pytest.raises(ValueError, match=r"^1 change\(s\) in .* \(class folder class9 added\): delete "):
        convert_image_folder(source, stream)
    shutil.rmtree(source / "train/class9")
    (stream / "val" / "sources.json").unlink()  # as older versions wrote it
    for path in [source / "val", *(source / "val").rglob("*")]:  # made well before the conversion
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns - 10 * 10**9))
    assert convert_image_folder(source, stream)["val"] == {"kept": 8, "options": "no --max-side"}
    Image.new("RGB", (40, 40)).save(source / "val/class2/1.jpg")  # rewritten: the file and its folder are newer
    with pytest.raises(ValueError) as refused:
        convert_image_folder(source, stream)
    assert str(refused.value) == (
        f"1 change(s) in {source / 'val'} since {stream / 'val'} was written (val/class2/1.jpg modified): delete "
        f"{stream / 'val'} or pass --overwrite to convert it again"
    )
    (source / "val/class2/1.jpg").rename(source / "val/class3/moved.jpg")
    with pytest.raises(ValueError, match=r"^3 change\(s\) in .*\(val/class2 modified, val/class3 modified, val/"):
        convert_image_folder(source, stream)
    report = convert_image_folder(source, stream, overwrite=True)
    assert report["val"]["written"] == 8 and (stream / "val" / "sources.json").is_file()
