"""Data: image decoding, folder layouts, augmentation, Mixup/CutMix and the resumable sampler."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import shared_path, write_image
from vit.data import (
    Augment,
    CIFARDataModule,
    CorruptImageError,
    DigitsDataModule,
    ImageFiles,
    ImageFolderDataModule,
    TinyImageNetDataModule,
    read_rgb,
)
from vit.data.images import MISSING, Sample, readable_class_names, same_class_names, scan_image_folder
from vit.data.mixup import Mixup, MixupCutmix
from vit.data.sampling import ResumableSampler, resumable_loader
from vit.data.transforms import eval_transform, train_transform
from vit.lit import ImageClassifier


@pytest.mark.parametrize("mode", ["L", "RGBA", "RGB"])
def test_greyscale_and_rgba_files_become_rgb(tmp_path, mode):
    path = tmp_path / f"img_{mode}.png"
    write_image(path, mode, size=(20, 12), value=77)
    image = read_rgb(path)
    assert image.shape == (12, 20, 3) and image.dtype == np.uint8
    assert (image == 77).all()


def test_corrupt_file_raises_an_error_naming_it(tmp_path):
    bad = tmp_path / "cat" / "broken.jpg"
    bad.parent.mkdir()
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(CorruptImageError, match=r"broken\.jpg"):
        read_rgb(bad)
    with pytest.raises(CorruptImageError, match=r"broken\.jpg"):
        ImageFiles([Sample(str(bad), 0)])[0]


def test_skip_corrupt_logs_counts_and_substitutes_the_next_image(tmp_path, caplog):
    good, bad = tmp_path / "good.png", tmp_path / "bad.png"
    write_image(good, value=9)
    bad.write_bytes(b"garbage")
    dataset = ImageFiles([Sample(str(bad), 0), Sample(str(good), 1)], skip_corrupt=True)
    with caplog.at_level("WARNING"):
        image, label = dataset[0]
    assert label == 1 and (image == 9).all()
    assert dataset.num_skipped == 1 and "bad.png" in caplog.text and "1 corrupt images skipped" in caplog.text


class _CountScored(L.Callback):
    """How many images the validation scored: the module's accuracy state after each batch."""

    def __init__(self) -> None:
        self.scored = 0

    def on_validation_batch_end(self, trainer, pl_module, *args) -> None:
        self.scored = int(pl_module.val_acc1.tp.sum() + pl_module.val_acc1.fn.sum())


def test_evaluation_with_skip_corrupt_scores_every_readable_image_once(tmp_path, caplog):
    """A corrupt file in validation used to be replaced by its neighbour, which was then scored
    twice: it is left out now (a black stand-in labelled MISSING keeps the batch size, so DDP ranks
    stay in step), logged and counted."""
    for split, n in (("train", 4), ("val", 3)):
        for cls in ("a", "b"):
            for i in range(n):
                write_image(tmp_path / split / cls / f"{i}.png", value=40 * i)
    (tmp_path / "val" / "b" / "1.png").write_bytes(b"garbage")
    dm = ImageFolderDataModule(root=str(tmp_path), img_size=16, batch_size=4, num_workers=0, skip_corrupt=True)
    dm.setup("fit")
    with caplog.at_level("WARNING"):
        batches = list(dm.val_dataloader())
    assert [len(y) for _, y in batches] == [4, 2]
    assert torch.cat([y for _, y in batches]).tolist() == [0, 0, 0, 1, MISSING, 1]
    assert dm.val_set.num_skipped == 1 and "b/1.png" in caplog.text
    module, counter = ImageClassifier("vit_nano_patch4_16", num_classes=2), _CountScored()
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[counter]
    )
    trainer.validate(module, dm.val_dataloader())
    assert counter.scored == 5
    dm.batch_size = 1  # a batch holding only the stand-in is skipped
    trainer.validate(module, dm.val_dataloader())
    assert counter.scored == 5


def test_image_folder_layout_and_its_errors(tmp_path):
    for split, n in (("train", 3), ("val", 2)):
        for cls in ("b_dog", "a_cat"):
            for i in range(n):
                write_image(tmp_path / split / cls / f"{i}.png")
    (tmp_path / "train" / "a_cat" / "notes.txt").write_text("not an image")
    dm = ImageFolderDataModule(root=str(tmp_path), img_size=16, batch_size=4, num_workers=0)
    assert dm.num_classes == 2 and dm.classes == ["a_cat", "b_dog"]
    dm.setup("fit")
    assert len(dm.train_set) == 6 and len(dm.val_set) == 4
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (4, 3, 16, 16) and y.tolist() == [0, 0, 1, 1]

    with pytest.raises(FileNotFoundError, match=r"missing/train does not exist: expected .*missing/train/<class>/"):
        ImageFolderDataModule(root=str(tmp_path / "missing"))
    (tmp_path / "empty" / "train").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no class sub-folders"):
        ImageFolderDataModule(root=str(tmp_path / "empty"))
    write_image(tmp_path / "val" / "c_extra" / "0.png")
    with pytest.raises(ValueError, match="class folders that the training split does not: c_extra"):
        ImageFolderDataModule(root=str(tmp_path), img_size=16, num_workers=0).setup("fit")


def test_a_link_back_up_a_class_folder_is_not_walked_round_again(tmp_path):
    write_image(tmp_path / "train" / "a" / "x.png")
    write_image(tmp_path / "train" / "b" / "y.png")
    (tmp_path / "train" / "a" / "up").symlink_to("..")  # train/a/up/a/up/... and train/a/up/b/y.png
    classes, samples = scan_image_folder(tmp_path / "train")
    assert classes == ["a", "b"] and [(Path(s.path).name, s.label) for s in samples] == [("x.png", 0), ("y.png", 1)]


def test_wordnet_classes_whose_first_words_agree_keep_their_ids(tmp_path):
    words = "n02012849\tcrane\nn03126707\tcrane\nn01443537\tgoldfish, Carassius auratus\n"
    (tmp_path / "words.txt").write_text(words)
    names = readable_class_names(["n01443537", "n02012849", "n03126707", "n09999999"], tmp_path)
    assert names == ["goldfish", "crane (n02012849)", "crane (n03126707)", "n09999999"]
    # a checkpoint saved while both were "crane" still names these classes (and resumes); another order does not
    assert same_class_names(["goldfish", "crane", "crane", "n09999999"], names)
    assert not same_class_names(["crane", "goldfish", "crane", "n09999999"], names)


def test_tiny_imagenet_official_layout_reads_val_labels_and_boxes(tmp_path):
    (tmp_path / "wnids.txt").write_text("n02\nn01\n")
    for wnid in ("n01", "n02"):
        for i in range(2):
            write_image(tmp_path / "train" / wnid / "images" / f"{wnid}_{i}.JPEG")
        (tmp_path / "train" / wnid / f"{wnid}_boxes.txt").write_text(f"{wnid}_0.JPEG\t1\t2\t3\t4\n")
    for i in range(3):
        write_image(tmp_path / "val" / "images" / f"val_{i}.JPEG")
    (tmp_path / "val" / "val_annotations.txt").write_text(
        "val_0.JPEG\tn02\t0\t0\t5\t5\nval_1.JPEG\tn01\t1\t1\t6\t6\nval_2.JPEG\tn02\t2\t2\t7\t7\n"
    )
    dm = TinyImageNetDataModule(root=str(tmp_path), img_size=16, batch_size=2, num_workers=0)
    dm.setup("fit")
    assert dm.classes == ["n01", "n02"] and dm.num_classes == 2
    assert [(s.path.split("/")[-1], s.label, s.box) for s in dm.val_set.samples] == [
        ("val_0.JPEG", 1, (0.0, 0.0, 5.0, 5.0)),
        ("val_1.JPEG", 0, (1.0, 1.0, 6.0, 6.0)),
        ("val_2.JPEG", 1, (2.0, 2.0, 7.0, 7.0)),
    ]
    train = {s.path.split("/")[-1]: (s.label, s.box) for s in dm.train_set.samples}
    assert train["n01_0.JPEG"] == (0, (1.0, 2.0, 3.0, 4.0)) and train["n01_1.JPEG"] == (0, None)
    (tmp_path / "train" / "n01" / "images" / "._n01_0.JPEG").write_bytes(b"\0\5\26\7")  # a macOS resource fork
    assert len(TinyImageNetDataModule(root=str(tmp_path), img_size=16, num_workers=0).load_splits()[0]) == 4
    with pytest.raises(FileNotFoundError, match=r"wnids\.txt not found; expected the official Tiny-ImageNet"):
        TinyImageNetDataModule(root=str(tmp_path / "nope"))


def test_real_tiny_imagenet_and_cifar10_folders():
    tiny = TinyImageNetDataModule(root=str(shared_path("data/tiny-imagenet-200")), num_workers=0)
    tiny.setup("fit")
    assert tiny.num_classes == 200 and len(tiny.train_set) == 20_000 and len(tiny.val_set) == 10_000
    assert all(s.box is not None for s in tiny.val_set.samples)
    cifar = ImageFolderDataModule(root=str(shared_path("data/cifar10")), val_dir="test", img_size=32, num_workers=0)
    cifar.setup("fit")
    assert cifar.num_classes == 10 and len(cifar.train_set) == 50_000 and len(cifar.val_set) == 10_000


def test_cifar_without_files_or_download_says_where_and_what(tmp_path):
    dm = CIFARDataModule(root=str(tmp_path), dataset="cifar100", download=False)
    assert dm.num_classes == 100
    with pytest.raises(FileNotFoundError, match=r"cifar100 is not in .*cifar-100-python.*cifar-100-python\.tar\.gz"):
        dm.setup("fit")


def test_digits_default_needs_no_download_and_splits_stratified():
    dm = DigitsDataModule(num_workers=0, batch_size=32)
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == 1797 and len(dm.val_set) == 360
    assert np.bincount(dm.val_set.labels).min() >= 35  # every digit is in val
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 3, 16, 16) and x.dtype == torch.float32


def test_train_and_eval_transforms_produce_normalised_tensors():
    image = np.random.default_rng(0).integers(0, 256, (48, 40, 3), dtype=np.uint8)
    for crop in ("rrc", "pad_crop", "resize"):
        out = train_transform(32, Augment(crop=crop, randaugment_ops=2))(image=image)["image"]
        assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    out = eval_transform(224, crop_pct=0.875)(image=image)["image"]
    assert out.shape == (3, 224, 224)
    # eval: resize the short side to 256, centre-crop 224; a constant image stays constant after normalising
    flat = eval_transform(8)(image=np.full((10, 10, 3), 124, np.uint8))["image"]
    torch.testing.assert_close(flat[0], torch.full((8, 8), (124 / 255 - 0.485) / 0.229), atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match=r"data\.augment\.crop: got 'random', expected one of rrc, pad_crop, resize"):
        Augment(crop="random")


def test_augmentation_is_reproducible_from_the_sample_seed():
    images = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    from vit.data import ImageArrays

    dataset = ImageArrays(images, [0, 1, 2, 3], train_transform(32, Augment(crop="rrc", randaugment_ops=2)))
    a, b, c = dataset[(1, 1234)][0], dataset[(1, 1234)][0], dataset[(1, 99)][0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_mixup_and_cutmix_make_soft_targets_that_match_the_mixed_pixels():
    x = torch.arange(4, dtype=torch.float32).view(4, 1, 1, 1).expand(4, 3, 8, 8).contiguous()
    y = torch.tensor([0, 1, 2, 3])
    mixed, target = MixupCutmix(4, Mixup(mixup_alpha=1.0))(x, y, np.random.default_rng(0))
    lam = target[0, 0].item()
    torch.testing.assert_close(target.sum(1), torch.ones(4))
    torch.testing.assert_close(mixed[0], x[0] * lam + x[3] * (1 - lam))  # mixed with the reversed batch
    assert target[0, 3].item() == pytest.approx(1 - lam)

    mixed, target = MixupCutmix(4, Mixup(cutmix_alpha=1.0))(x, y, np.random.default_rng(1))
    pasted_fraction = (mixed[0, 0] == 3).float().mean().item()  # pixels that came from image 3
    assert target[0, 3].item() == pytest.approx(pasted_fraction)
    assert target[0, 0].item() == pytest.approx(1 - pasted_fraction)


def test_sampler_order_depends_only_on_seed_and_epoch_and_shards_ranks():
    dataset = list(range(10))
    sampler = ResumableSampler(dataset, seed=3)
    sampler.set_epoch(2)
    first = list(sampler)
    again = ResumableSampler(dataset, seed=3)
    again.set_epoch(2)
    assert list(again) == first and sorted(i for i, _ in first) == dataset
    sampler.set_epoch(3)
    assert list(sampler) != first

    ranks = []
    for rank in (0, 1):
        s = ResumableSampler(dataset, seed=3)
        s.num_replicas, s.rank, s.num_samples, s.total_size = 2, rank, 5, 10
        s.set_epoch(2)
        ranks.append([i for i, _ in s])
    assert not set(ranks[0]) & set(ranks[1]) and len(ranks[0]) == len(ranks[1]) == 5

    sampler.set_epoch(2)
    sampler.resume_epoch, sampler.resume_position = 2, 4
    assert list(sampler) == first[4:]  # resumed mid-epoch
    assert list(sampler) == first  # and the next pass is whole again


class _Indices(torch.utils.data.Dataset):
    """Item (index, sample seed) -> the index, so a batch shows which samples it holds."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, item: tuple[int, int]) -> int:
        return item[0]


def test_the_training_loader_starts_each_epoch_after_the_batches_the_trainer_finished():
    import lightning as L

    dataset = _Indices()
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False)
    loader = resumable_loader(dataset, ResumableSampler(dataset, shuffle=False), trainer, batch_size=4)
    trainer.fit_loop.epoch_loop.batch_progress.current.processed = 2  # as restored from a mid-epoch checkpoint
    assert [b.tolist() for b in loader] == [[8, 9, 10, 11]]
    trainer.fit_loop.epoch_loop.batch_progress.current.processed = 0  # the next epoch
    assert len(list(loader)) == 3

    alone = resumable_loader(dataset, ResumableSampler(dataset, shuffle=False), None, batch_size=4)
    assert [b.tolist() for b in alone] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_a_loader_without_a_trainer_counts_the_batches_a_resume_skipped_in_its_state():
    """Saved after a batch, resumed, saved after another and resumed again: the third batch next."""
    dataset, state = _Indices(), None
    for expected in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]):
        loader = resumable_loader(dataset, ResumableSampler(dataset, shuffle=False), None, batch_size=4)
        if state is not None:
            loader.load_state_dict(state)
        assert next(iter(loader)).tolist() == expected
        state = loader.state_dict()


def test_image_folder_shapes_with_the_real_cifar_copy():
    root = shared_path("data/cifar10")
    classes, samples = scan_image_folder(root / "test")
    assert classes[:3] == ["airplane", "automobile", "bird"] and len(samples) == 10_000


def test_image_folder_eval_keeps_the_whole_image_unless_training_used_random_resized_crops(tmp_path):
    for split in ("train", "val"):
        write_image(tmp_path / split / "cls" / "0.png", size=(32, 32))
    image = np.zeros((32, 32, 3), np.uint8)
    image[0, :] = 255  # a white top edge: kept by a whole-image eval, cut by a 0.875 centre crop
    for crop, edge_kept in (("pad_crop", True), ("resize", True), ("rrc", False)):
        dm = ImageFolderDataModule(root=str(tmp_path), img_size=32, num_workers=0, augment={"crop": crop})
        top = dm.eval_transform(image=image)["image"][0, 0]
        assert bool((top > 1.5).all()) == edge_kept, crop


def test_image_folder_picks_its_crop_from_the_image_size_and_logs_both_pipelines(tmp_path, caplog):
    """A folder of 32-px images is augmented as the CIFAR module does (resize, pad 4, random crop,
    flip; whole-image eval), not with ImageNet's random resized crop, which could keep 8% of it; a
    folder at 224 px gets the random resized crop and the 0.875 centre-crop eval. Both are logged."""
    for split in ("train", "val"):
        write_image(tmp_path / split / "cls" / "0.png", size=(32, 32))

    def ops(transform) -> list[str]:
        return [type(op).__name__ for op in transform.transforms]

    small = ImageFolderDataModule(root=str(tmp_path), img_size=32, num_workers=0)
    cifar = CIFARDataModule(root=str(tmp_path / "no_cifar_here"), download=False)
    assert ops(small.train_transform) == ops(cifar.train_transform)
    pad_crop = ["Lambda", "PadIfNeeded", "RandomCrop", "HorizontalFlip", "Normalize", "ToTensorV2"]  # Lambda: resize
    assert ops(small.train_transform) == pad_crop
    assert (small.augment.crop_padding, small.eval_crop_pct) == (cifar.augment.crop_padding, cifar.eval_crop_pct)
    assert (small.augment.crop_padding, small.eval_crop_pct) == (4, 1.0)

    large = ImageFolderDataModule(root=str(tmp_path), img_size=224, num_workers=0)
    assert ops(large.train_transform) == ["RandomResizedCrop", "HorizontalFlip", "Normalize", "ToTensorV2"]
    assert (large.augment.crop_scale, large.eval_crop_pct) == ((0.08, 1.0), 0.875)
    given = ImageFolderDataModule(root=str(tmp_path), img_size=32, num_workers=0, augment={"crop": "rrc"})
    assert given.augment.crop == "rrc"  # as given

    with caplog.at_level("INFO", logger="vit"):
        small.setup("fit")
        large.setup("fit")
    assert "train transform: resize 32x32, pad 4 + random crop 32, flip, normalise" in caplog.text
    assert "eval transform: centre crop 1 of the shorter side, resize to 32 (bicubic), normalise" in caplog.text
    assert "train transform: random resized crop 224 (scale 0.08-1), flip, normalise" in caplog.text
    assert "eval transform: centre crop 0.875 of the shorter side, resize to 224 (bicubic), normalise" in caplog.text


def test_the_logged_train_transform_says_how_often_batches_are_mixed(tmp_path):
    def line(**mix) -> str:
        return CIFARDataModule(root=str(tmp_path), download=False, mixup=mix).describe_transforms()[0]

    assert "Mixup" not in line()
    assert line(cutmix_alpha=1.0).endswith("normalise, Mixup 0 / CutMix 1 per batch")
    assert line(cutmix_alpha=1.0, prob=0.5).endswith("Mixup 0 / CutMix 1 on 50% of batches")
    both = line(mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.25)
    assert both.endswith("Mixup 0.8 / CutMix 1 (CutMix on 25%) per batch")


def test_16_bit_greyscale_is_scaled_to_8_bits_and_float_images_are_refused(tmp_path):
    levels = np.array([[0, 257 * 100, 65535]], dtype=np.uint16)  # 0, mid-grey, white in 16 bits
    Image.fromarray(levels).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode.startswith("I")
    image = read_rgb(tmp_path / "deep.png")
    assert image.dtype == np.uint8 and image.shape == (1, 3, 3)
    assert image[0, :, 0].tolist() == [0, 100, 255]  # PIL's convert("RGB") gave [0, 255, 255]
    Image.fromarray(np.full((2, 2), 0.5, dtype=np.float32)).save(tmp_path / "float.tif")
    with pytest.raises(ValueError, match=r"float\.tif is a 32-bit float image.*convert it to 8 or 16 bits"):
        read_rgb(tmp_path / "float.tif")


def test_an_empty_class_folder_or_a_class_missing_from_val_is_named_in_a_warning(tmp_path, caplog):
    write_image(tmp_path / "train" / "cat" / "0.png")
    (tmp_path / "train" / "dog").mkdir()
    write_image(tmp_path / "val" / "cat" / "0.png")
    with caplog.at_level("WARNING", logger="vit"):
        classes, _ = scan_image_folder(tmp_path / "train")
        scan_image_folder(tmp_path / "val", classes=classes)
    assert f"{tmp_path / 'train' / 'dog'} has no images: class 'dog'" in caplog.text
    assert f"{tmp_path / 'val'} has no folder for class 'dog'" in caplog.text


def test_class_folders_are_read_with_their_sub_folders_and_other_files_are_counted(tmp_path, caplog):
    """As torchvision's ImageFolder: images in sub-folders of a class belong to it (they were
    ignored silently, and a class could end with none); files that are not images are named in a
    warning with their count; hidden files and macOS "._*" forks are neither."""
    write_image(tmp_path / "cat" / "0.png")
    write_image(tmp_path / "cat" / "2024" / "a.JPG")
    write_image(tmp_path / "dog" / "shots" / "deep" / "1.png")
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    (tmp_path / "dog" / "2.heic").write_bytes(b"")
    (tmp_path / "dog" / "._1.png").write_bytes(b"\0")
    (tmp_path / "dog" / ".hidden").mkdir()
    write_image(tmp_path / "dog" / ".hidden" / "3.png")
    with caplog.at_level("WARNING", logger="vit"):
        classes, samples = scan_image_folder(tmp_path)
    assert classes == ["cat", "dog"]
    assert [(Path(s.path).relative_to(tmp_path).as_posix(), s.label) for s in samples] == [
        ("cat/0.png", 0),
        ("cat/2024/a.JPG", 0),
        ("dog/shots/deep/1.png", 1),
    ]
    assert f"{tmp_path}: 2 file(s) without an image extension are not read, e.g. {tmp_path / 'dog' / '2.heic'}" in (
        caplog.text
    )
