"""Training fast at small scale: the in-memory pipeline, the wall-clock schedule, Muon, flip TTA."""

from __future__ import annotations

import signal
import time

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import quiet_trainer, write_image_folder
from tests.faults import InterruptAt
from vit.data import DigitsDataModule, ImageFiles
from vit.data.augment import Augment, batch_augment, normalize
from vit.data.datamodules import ImageFolderDataModule, holdout_indices
from vit.data.host import available_memory
from vit.data.images import CorruptImageError, ImageArrays, Sample
from vit.data.memory import ResumableBatchSampler, TensorImages, to_tensor_images
from vit.data.transforms import train_transform
from vit.layers import whiten_patch_embed_
from vit.lit import ImageClassifier
from vit.optim import MuonAdamW, orthogonalize, split_muon_groups
from vit.registry import create_model
from vit.schedule import WallClockBudget, warmup_decay


def _images(n: int = 8, size: int = 8) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


# -- batch augmentation ---------------------------------------------------------------------------


def test_batch_augment_is_a_function_of_its_seed():
    x = _images()
    a = batch_augment(x, torch.Generator().manual_seed(5), crop_padding=2, hflip=True, cutout=3)
    b = batch_augment(x, torch.Generator().manual_seed(5), crop_padding=2, hflip=True, cutout=3)
    c = batch_augment(x, torch.Generator().manual_seed(6), crop_padding=2, hflip=True, cutout=3)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.dtype == torch.uint8 and a.shape == x.shape


def test_batch_crops_are_translations_of_the_zero_padded_image_and_flips_mirror_it():
    x = _images(n=64)
    out = batch_augment(x, torch.Generator().manual_seed(0), crop_padding=2, hflip=True)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    offsets, flips = [], 0
    for i in range(len(x)):
        matches = [
            (dy, dx, flip)
            for dy in range(5)
            for dx in range(5)
            for flip in (False, True)
            if torch.equal(out[i], (lambda c: c.flip(-1) if flip else c)(padded[i, :, dy : dy + 8, dx : dx + 8]))
        ]
        assert matches, f"image {i} is not a flipped or unflipped crop of the padded image"
        offsets.append(matches[0][:2])
        flips += matches[0][2]
    assert len(set(offsets)) > 10 and 16 < flips < 48  # offsets vary; about half are mirrored


def test_batch_path_has_the_same_statistics_as_the_per_sample_albumentations_path():
    """The mean augmented image over many draws, per pixel, agrees between the two paths."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    draws = 3000
    per_sample = train_transform(16, Augment(crop="pad_crop", crop_padding=3), mean=(0, 0, 0), std=(1, 1, 1))
    reference = torch.stack([per_sample(image=image)["image"] for _ in range(draws)]).mean(0)  # in [0, 1]
    batch = torch.from_numpy(image).permute(2, 0, 1)[None].expand(draws, -1, -1, -1).contiguous()
    ours = batch_augment(batch, torch.Generator().manual_seed(0), crop_padding=3, hflip=True).float().mean(0) / 255
    assert (ours - reference).abs().mean() < 0.01
    assert (ours - reference).abs().max() < 0.06
    # the dependence on the position is real: a mean far from the un-augmented image
    assert (reference - batch[0].float() / 255).abs().mean() > 0.05


def test_cutout_zeroes_one_square_per_image():
    x = torch.full((32, 3, 16, 16), 200, dtype=torch.uint8)
    out = batch_augment(x, torch.Generator().manual_seed(1), cutout=4)
    zeroed = (out[:, 0] == 0).sum(dim=(1, 2))
    assert zeroed.max() == 16 and zeroed.min() >= 4  # a full 4x4 square, or one clipped at the border
    assert (out[:, 0] == 0).eq(out[:, 2] == 0).all()  # all channels


def test_normalize_matches_albumentations():
    image = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    expected = train_transform(8, Augment(crop="resize", hflip=False))(image=image)["image"]
    ours = normalize(torch.from_numpy(image).permute(2, 0, 1)[None], (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    torch.testing.assert_close(ours[0], expected, atol=1e-3, rtol=0)


# -- batches, splits and the decode cache -------------------------------------------------------


def test_the_batch_sampler_orders_by_seed_and_epoch_shards_ranks_and_resumes_at_an_image():
    dataset = TensorImages(_images(n=20), torch.arange(20))
    sampler = ResumableBatchSampler(dataset, batch_size=4, shuffle=True, seed=3)
    sampler.set_epoch(1)
    first = list(sampler)
    assert len(first) == len(sampler) == 5
    assert sorted(torch.cat([b for b, _ in first]).tolist()) == list(range(20))
    again = ResumableBatchSampler(dataset, batch_size=4, shuffle=True, seed=3)
    again.set_epoch(1)
    assert [(b.tolist(), s) for b, s in again] == [(b.tolist(), s) for b, s in first]
    sampler.set_epoch(2)
    assert [b.tolist() for b, _ in sampler] != [b.tolist() for b, _ in first]

    shards = [ResumableBatchSampler(dataset, 4, shuffle=True, seed=3, num_replicas=2, rank=r) for r in (0, 1)]
    for s in shards:
        s.set_epoch(1)
    seen = [torch.cat([b for b, _ in s]).tolist() for s in shards]
    assert len(seen[0]) == len(seen[1]) == 10 and not set(seen[0]) & set(seen[1])
    assert [seed for _, seed in shards[0]] != [seed for _, seed in shards[1]]  # ranks augment differently

    sampler.set_epoch(1)
    sampler.resume_epoch, sampler.resume_position = 1, 12  # in images, as every sampler counts: batch 3 on
    assert [b.tolist() for b, _ in sampler] == [b.tolist() for b, _ in first[3:]]
    assert len(list(sampler)) == 5  # the next pass is whole again

    ragged = ResumableBatchSampler(dataset, batch_size=6, shuffle=True, drop_last=True)
    assert len(ragged) == len(list(ragged)) == 3  # 20 = 3 x 6 + 2: the ragged batch is dropped


def test_a_loaded_batch_carries_its_augmentation_seed_as_a_host_number():
    """A tensor seed would move to the device with the batch and be read back there each step,
    the host waiting for the device; a Python int stays on the host through loader and transfer."""
    from torch.utils.data import DataLoader

    dataset = TensorImages(_images(n=8), torch.arange(8))
    sampler = ResumableBatchSampler(dataset, batch_size=4, shuffle=True, seed=3)
    loader = DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=1)
    for (_, labels, seed), (indices, expected) in zip(loader, list(sampler), strict=True):
        assert type(seed) is int and seed == expected and labels.tolist() == indices.tolist()


def test_holdout_is_stratified_disjoint_and_fixed():
    labels = np.repeat(np.arange(5), 100)
    train, val = holdout_indices(labels, 50)
    assert len(val) == 50 and len(train) == 450 and not set(train) & set(val)
    assert np.bincount(labels[val]).tolist() == [10] * 5
    assert np.array_equal(holdout_indices(labels, 0.1)[1], val)
    with pytest.raises(ValueError, match="val_holdout"):
        holdout_indices(labels, 500)


def test_holdout_takes_exactly_what_was_asked_when_classes_outnumber_it(tmp_path):
    """5 of 10 balanced classes used to round to 0 held-out images: no validation, no warning."""
    folder = write_image_folder(tmp_path, classes=10, train=3, val=1, size=8)
    for pipeline in ("per_sample", "memory"):
        dm = ImageFolderDataModule(
            str(folder), img_size=8, pipeline=pipeline, val_holdout=5, augment={"crop": "pad_crop"}
        )
        dm.setup("fit")
        assert len(dm.val_set) == 5 and len(dm.train_set) == 25
    labels = np.repeat(np.arange(10), 20)
    train, val = holdout_indices(labels, 5)
    assert len(val) == 5 and len(set(labels[val])) == 5 and len(train) == 195
    assert np.bincount(labels[holdout_indices(labels, 13)[1]], minlength=10).tolist() == [2, 2, 2, 1, 1, 1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"data\.val_holdout: got 0\.001, .* 200 training images .* holds out 0$"):
        holdout_indices(labels, 0.001)


def test_holdout_leaves_every_class_an_image_to_train_on():
    """A class of 1 image at a 0.5 holdout, or one of 2 at 0.85, went wholly to validation."""
    labels = np.array([0] + [1] * 9)
    train, val = holdout_indices(labels, 0.5)
    assert len(val) == 5 and 0 in labels[train] and np.bincount(labels[val], minlength=2).tolist() == [0, 5]
    labels = np.array([0, 0] + [1] * 8 + [2] * 10)
    train, val = holdout_indices(labels, 0.85)
    assert len(val) == 17 and np.bincount(labels[train]).tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match=r"holds out 1 to 17 of them \(each of the 3 classes keeps one"):
        holdout_indices(labels, 0.9)


def test_decoding_is_cached_by_content(tmp_path, caplog):
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    samples = []
    for i in range(6):
        path = folder / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)).save(path)
        samples.append(Sample(str(path), i % 2))
    dataset = ImageFiles(samples)
    first = to_tensor_images(dataset, img_size=8, cache_dir=tmp_path / "cache")
    assert first.images.shape == (6, 3, 8, 8) and first.labels.tolist() == [0, 1] * 3
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1
    caplog.clear()
    with caplog.at_level("INFO", logger="vit"):
        again = to_tensor_images(dataset, img_size=8, cache_dir=tmp_path / "cache")
    assert torch.equal(again.images, first.images) and "decoded" not in caplog.text  # read from the cache
    Image.fromarray(np.zeros((10, 10, 3), np.uint8)).save(folder / "0.png")  # the folder changed
    changed = to_tensor_images(dataset, img_size=8, cache_dir=tmp_path / "cache")
    assert changed.images[0].max() == 0 and len(list((tmp_path / "cache").glob("*.npz"))) == 2
    pixels = rng.integers(0, 256, 2 * 16 * 32 * 3, dtype=np.uint8)  # the same bytes as two other shapes
    wide, tall = (ImageArrays(pixels.reshape(2, *shape, 3), [0, 1]) for shape in ((16, 32), (32, 16)))
    cached = [to_tensor_images(arrays, img_size=8, cache_dir=tmp_path / "arrays").images for arrays in (wide, tall)]
    assert not torch.equal(*cached) and len(list((tmp_path / "arrays").glob("*.npz"))) == 2


def test_a_broken_or_unwritable_cache_costs_only_the_cache_and_strict_runs_never_read_a_skipping_one(tmp_path, caplog):
    """A truncated cache file gave a raw BadZipFile without its path; a full disk a raw traceback
    and a `.tmp` per try; a cache built with skip_corrupt was reused silently by a strict run."""
    import resource

    folder = tmp_path / "imgs"
    samples = []
    for i in range(6):
        path = folder / f"{i}.png"
        path.parent.mkdir(exist_ok=True)
        Image.fromarray(np.full((10, 10, 3), 40 * i, np.uint8)).save(path)
        samples.append(Sample(str(path), i % 2))
    corrupt = folder / "5.png"
    corrupt.write_bytes(corrupt.read_bytes()[:30])
    cache = tmp_path / "cache"
    skipping = to_tensor_images(ImageFiles(samples, skip_corrupt=True), img_size=8, cache_dir=cache)
    assert len(skipping) == 5
    with pytest.raises(CorruptImageError, match=f"cannot decode image {corrupt}"):  # not the 5-image cache
        to_tensor_images(ImageFiles(samples), img_size=8, cache_dir=cache)

    (cached,) = cache.glob("*.npz")
    cached.write_bytes(cached.read_bytes()[:100])
    with caplog.at_level("WARNING", logger="vit"):
        again = to_tensor_images(ImageFiles(samples, skip_corrupt=True), img_size=8, cache_dir=cache)
    assert torch.equal(again.images, skipping.images)
    assert f"the image cache {cached} cannot be read (BadZipFile" in caplog.text

    cached.unlink()
    (cache / f".{cached.name}.999999999.tmp").write_bytes(b"left by a process killed while writing")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200, limit[1]))  # back before pytest writes its report
    try:
        with caplog.at_level("WARNING", logger="vit"):
            full = to_tensor_images(ImageFiles(samples, skip_corrupt=True), img_size=8, cache_dir=cache)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert torch.equal(full.images, skipping.images)
    assert f"could not write the image cache {cached} (File too large); training goes on without it" in caplog.text
    assert list(cache.iterdir()) == []


def test_memory_check_counts_the_page_cache_as_available_and_keeps_to_a_cgroup_limit(tmp_path):
    # after one pass over a dataset the page cache holds most of memory: free pages read near zero
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 24000000 kB\nMemFree: 300000 kB\nMemAvailable: 20000000 kB\n")
    assert available_memory(proc, cgroup) == 20000000 * 1024
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    assert available_memory(proc, cgroup) == 20000000 * 1024
    # a container's limit counts its own use less the cache it can drop
    (cgroup / "memory.max").write_text(f"{8 * 2**30}\n")
    (cgroup / "memory.current").write_text(f"{6 * 2**30}\n")
    (cgroup / "memory.stat").write_text(f"anon {2**30}\ninactive_file {5 * 2**30}\n")
    assert available_memory(proc, cgroup) == 7 * 2**30
    (cgroup / "memory.stat").write_text("anon 0\ninactive_file 0\n")
    assert available_memory(proc, cgroup) == 2 * 2**30
    assert available_memory(tmp_path / "none", tmp_path / "none") is None


def test_in_memory_folder_module_holds_out_validation_and_keeps_the_test_split(tmp_path):
    for split, n in (("train", 10), ("test", 3)):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(np.full((12, 12, 3), i * 10, np.uint8)).save(tmp_path / split / c / f"{i}.png")
    data = ImageFolderDataModule(
        str(tmp_path),
        val_dir="test",
        img_size=8,
        pipeline="memory",
        val_holdout=4,
        batch_size=4,
        augment={"crop": "pad_crop"},
    )
    data.setup("fit")
    assert len(data.train_set) == 16 and len(data.val_set) == 4 and len(data.test_set) == 6
    x, y = next(iter(data.test_dataloader()))
    assert x.dtype == torch.uint8 and x.shape == (4, 3, 8, 8)  # decoded at img_size, normalised on the device
    assert data.on_after_batch_transfer((x, y), 0)[0].dtype == torch.float32


def test_batch_options_need_the_memory_pipeline():
    with pytest.raises(ValueError, match=r"--data\.pipeline memory"):
        DigitsDataModule(augment={"cutout": 4})
    with pytest.raises(ValueError, match=r"augment\.crop: got 'rrc', expected pad_crop or resize with --data"):
        DigitsDataModule(pipeline="memory", augment={"crop": "rrc"})


def _memory_recipe() -> tuple[ImageClassifier, DigitsDataModule]:
    module = ImageClassifier(
        "vit_nano_patch4_16", {"drop_path_rate": 0.2}, num_classes=10, label_smoothing=0.1, optimizer={"lr": 2e-3},
        schedule={"warmup_fraction": 0.1},
    )  # fmt: skip
    data = DigitsDataModule(
        batch_size=64, pipeline="memory", augment={"cutout": 4, "randaugment_ops": 2},
        mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0},
    )  # fmt: skip
    return module, data


def test_in_memory_training_resumes_exactly_mid_epoch(tmp_path):
    L.seed_everything(7)
    module, data = _memory_recipe()
    quiet_trainer(tmp_path / "straight", max_steps=30).fit(module, data)
    expected = module.model.state_dict()

    L.seed_everything(7)
    module, data = _memory_recipe()
    previous_handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            quiet_trainer(tmp_path / "run", max_steps=30, callbacks=[InterruptAt(13)]).fit(module, data)
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    L.seed_everything(123)
    module, data = _memory_recipe()
    trainer = quiet_trainer(tmp_path / "run", max_steps=30)
    trainer.fit(module, data, ckpt_path="last")
    assert trainer.global_step == 30
    for name, value in expected.items():
        torch.testing.assert_close(module.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_progressive_sizes_follow_the_run_and_validation_stays_full_size(tmp_path):
    sizes = {}

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            sizes[trainer.global_step] = batch[0].shape[-1]

        def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
            sizes["val"] = batch[0].shape[-1]

    module = ImageClassifier("vit_nano_patch4_16", {"posemb": "sincos2d"}, num_classes=10)
    data = DigitsDataModule(batch_size=64, pipeline="memory", memory={"train_sizes": [[0, 8], [0.5, 16]]})
    trainer = quiet_trainer(tmp_path, max_steps=10, limit_val_batches=1, callbacks=[Spy()])
    trainer.fit(module, data)
    trainer.validate(module, data, verbose=False)
    assert [sizes[s] for s in range(10)] == [8] * 5 + [16] * 5 and sizes["val"] == 16


def test_patch_drop_schedule_follows_the_run_and_validation_sees_every_patch(tmp_path):
    tokens = {}

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            def count(block, args):
                tokens[trainer.global_step] = args[0].shape[1]  # tokens entering the first block

            self.handle = module.model.blocks[0].register_forward_pre_hook(count)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.handle.remove()

    module = ImageClassifier(
        "vit_nano_patch4_16",
        {"posemb": "sincos2d", "global_pool": "avg", "class_token": False, "patch_drop_rate": 0.25},
        num_classes=10,
        patch_drop_schedule=[[0.6, 0.0], [0, 0.5]],  # any order; replaces the model's 0.25
    )
    data = DigitsDataModule(batch_size=64, pipeline="memory")
    trainer = quiet_trainer(tmp_path, max_steps=10, limit_val_batches=1, callbacks=[Spy()])
    trainer.fit(module, data)
    assert [tokens[s] for s in range(10)] == [8] * 6 + [16] * 4  # 16 patches, half dropped until 60%
    module.model.eval()
    with torch.no_grad():
        assert module.model.forward_features(torch.zeros(2, 3, 16, 16)).shape[1] == 16


def test_patch_drop_schedule_needs_a_vit_and_rates_below_one():
    with pytest.raises(ValueError, match=r"model.patch_drop_schedule: got \[\[0, 1.0\]\], expected .*rate in \[0, 1\)"):
        ImageClassifier("vit_nano_patch4_16", num_classes=10, patch_drop_schedule=[[0, 1.0]])
    with pytest.raises(ValueError, match=r"patch_drop_schedule needs a ViT .* resnet20 has none"):
        ImageClassifier("resnet20", num_classes=10, patch_drop_schedule=[[0, 0.5]])


# -- the schedule on the clock ---------------------------------------------------------------------


def test_warmup_then_cosine_or_linear_decay_by_progress():
    assert warmup_decay(0.05, 0.1, 0.0) == pytest.approx(0.5)
    assert warmup_decay(0.1, 0.1, 0.0) == pytest.approx(1.0)
    assert warmup_decay(0.55, 0.1, 0.0) == pytest.approx(0.5)
    assert warmup_decay(1.0, 0.1, 0.01) == pytest.approx(0.01)
    assert warmup_decay(0.325, 0.1, 0.0) == pytest.approx(0.8535534)  # a quarter of the decay, on the cosine
    assert warmup_decay(0.325, 0.1, 0.0, "linear") == pytest.approx(0.75)
    assert warmup_decay(1.0, 0.1, 0.01, "linear") == pytest.approx(0.01)


def test_wall_clock_budget_stops_the_run_says_so_and_the_lr_ends_on_time(tmp_path, caplog):
    budget = WallClockBudget(minutes=6 / 60)  # warmup 1.2 s: a slow first step still leaves steps near the peak
    lrs, expected = [], []

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
            expected.append(1e-3 * warmup_decay(budget.progress(), 0.2, 0.0))

    module = ImageClassifier(num_classes=10, optimizer={"lr": 1e-3}, schedule={"warmup_fraction": 0.2})
    trainer = quiet_trainer(tmp_path, max_epochs=10_000, limit_val_batches=0, callbacks=[budget, Spy()])
    with caplog.at_level("INFO", logger="vit"):
        trainer.fit(module, DigitsDataModule(batch_size=32, num_workers=0))  # no loader process to start
    assert 6.0 <= budget.elapsed() < 7.5 and trainer.current_epoch < 10_000
    said = f"budget of 0.1 minutes ended after step {trainer.global_step} (epoch {trainer.current_epoch - 1}): training"
    assert caplog.text.count(said) == 1  # the epoch it stopped in, which the trainer then counts done
    assert max(lrs) > 0.9e-3 and lrs[-1] < 0.05e-3  # warmed up to the peak, decayed to ~0 at the end
    # each step's lr is the schedule at the fraction of the budget (by the clock, not by steps) that
    # was used when the scheduler stepped, at the end of the step before the previous one
    assert lrs[2:] == pytest.approx(expected[1:-1], rel=1e-6)


def test_a_budget_takes_its_warmup_as_a_fraction(tmp_path):
    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[WallClockBudget(1)])
    with pytest.raises(ValueError, match="warmup_fraction"):
        trainer.fit(ImageClassifier(num_classes=10, schedule={"warmup_epochs": 1}), DigitsDataModule(batch_size=32))


def test_budget_elapsed_time_survives_a_checkpoint():
    budget = WallClockBudget(minutes=1)
    state = {"elapsed": 42.0}
    budget.load_state_dict(state)
    assert 42.0 <= budget.elapsed() < 43.0
    time.sleep(0.01)
    assert budget.state_dict()["elapsed"] > 42.0


@pytest.mark.parametrize("bound", [{"max_epochs": 3}, {"max_steps": 200, "max_epochs": -1}])
def test_warmup_epochs_count_the_loaders_batches_whether_the_run_is_bounded_by_epochs_or_steps(tmp_path, bound):
    """One epoch of warmup is one epoch of batches either way (bounded by max_steps alone it used to
    be the whole run, cut to half of it)."""
    module = ImageClassifier(num_classes=10, optimizer={"lr": 1e-3}, schedule={"warmup_epochs": 1})
    trainer = quiet_trainer(tmp_path, limit_val_batches=0, **bound)
    trainer.fit(module, DigitsDataModule(batch_size=50, num_workers=0))
    per_epoch = trainer.num_training_batches
    assert per_epoch == 28  # 1,437 training digits, the last partial batch dropped
    schedule = trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0]
    assert schedule(per_epoch - 2) < 1.0 and schedule(per_epoch - 1) == 1.0
    assert schedule(13) == pytest.approx(14 / 28)


def test_warmup_longer_than_half_the_run_is_cut_with_a_warning(tmp_path):
    module = ImageClassifier(
        num_classes=10, optimizer={"lr": 1e-3}, schedule={"warmup_epochs": 5}
    )  # 5 epochs of warmup in a 1-epoch run
    trainer = quiet_trainer(tmp_path, max_epochs=1, limit_val_batches=0)
    with pytest.warns(UserWarning, match="longer than half the run"):
        trainer.fit(module, DigitsDataModule(batch_size=32))
    assert trainer.optimizers[0].param_groups[0]["lr"] < 0.1e-3  # the run still decayed


def test_a_run_without_training_batches_has_no_warmup_to_cut(tmp_path, recwarn):
    """limit_train_batches 0 (to validate a loaded checkpoint) used to warn of a warmup 'longer than
    half the run (-1)'."""
    module = ImageClassifier(num_classes=10, optimizer={"lr": 1e-3}, schedule={"warmup_fraction": 0.05})
    trainer = quiet_trainer(tmp_path, max_epochs=1, limit_train_batches=0, limit_val_batches=1)
    trainer.fit(module, DigitsDataModule(batch_size=32, num_workers=0))
    assert trainer.global_step == 0
    assert not [w for w in recwarn if "longer than half the run" in str(w.message)]


# -- Muon and flip TTA -----------------------------------------------------------------------------


def test_muon_steps_the_block_matrices_like_torch_muon_and_the_rest_like_adamw():
    """With torch's bfloat16 Newton-Schulz iteration the update is torch.optim.Muon's, bit for bit."""
    torch.manual_seed(0)
    model = create_model("vit_nano_patch4_16", num_classes=10)
    reference = create_model("vit_nano_patch4_16", num_classes=10)
    reference.load_state_dict(model.state_dict())
    hidden = {p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")}
    groups = [{"params": list(model.parameters()), "lr": 1e-2, "weight_decay": 0.1}]
    optimizer = MuonAdamW(split_muon_groups(groups, hidden), lr=1e-2, ns_dtype=torch.bfloat16)
    ref_hidden = [p for n, p in reference.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    ref_rest = [p for n, p in reference.named_parameters() if not (p.ndim == 2 and n.startswith("blocks."))]
    ref_muon = torch.optim.Muon(ref_hidden, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ref_adamw = torch.optim.AdamW(ref_rest, lr=1e-2, weight_decay=0.1)
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    for _ in range(2):
        for m, opts in ((model, [optimizer]), (reference, [ref_muon, ref_adamw])):
            torch.nn.functional.cross_entropy(m(x), y).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    # one state for checkpoints: a fresh optimizer loaded from it continues identically
    clone = MuonAdamW(split_muon_groups(groups, hidden), lr=1e-2)
    clone.load_state_dict(optimizer.state_dict())
    assert len(clone.state) == len(list(model.parameters()))
    assert clone._muon.state is clone.state and clone._muon.param_groups[0] is clone.param_groups[0]


@pytest.mark.parametrize(("precision", "ns_dtype"), [("32-true", None), ("bf16-mixed", torch.bfloat16)])
def test_muon_orthogonalises_in_bf16_where_the_run_trains_in_bf16(tmp_path, precision, ns_dtype):
    """A run in bf16 was chosen for a device with bf16 units, where the iteration is faster in bf16;
    a float32 run may be on a CPU without them, where bf16 matmuls are slow."""
    module = ImageClassifier(model_name="vit_nano_patch4_16", num_classes=10, optimizer={"name": "muon", "lr": 1e-3})
    trainer = quiet_trainer(tmp_path, max_epochs=1, limit_train_batches=1, limit_val_batches=0, precision=precision)
    trainer.fit(module, DigitsDataModule(batch_size=32, num_workers=0))
    assert trainer.optimizers[0]._muon.ns_dtype is ns_dtype


def test_muon_orthogonalises_in_float32_on_the_cpu():
    """The default on CPU tensors: float32 (bfloat16 matmuls are ~30x slower on CPUs without bf16 units)."""
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    coefficients = torch.optim.Muon([torch.zeros(2, 2, requires_grad=True)]).defaults["ns_coefficients"]
    fp32 = orthogonalize(g, coefficients, 5, 1e-7, torch.float32)
    bf16 = orthogonalize(g, coefficients, 5, 1e-7, torch.bfloat16)
    assert fp32.dtype == torch.float32 and fp32.shape == g.shape
    s = torch.linalg.svdvals(fp32)
    assert s.min() > 0.6 and s.max() < 1.1  # near-orthogonal: singular values near 1, as the coefficients intend
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(fp32.flatten(), (u @ vh).flatten(), dim=0) > 0.98
    assert (fp32 - bf16.float()).abs().max() < 0.02  # the same iteration, rounded less

    model = create_model("vit_nano_patch4_16", num_classes=10)
    hidden = {p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")}
    optimizer = MuonAdamW(split_muon_groups([{"params": list(model.parameters())}], hidden), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.tensor([0, 1, 2, 3])).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    qkv = "blocks.0.attn.qkv.weight"
    expected = orthogonalize(grads[qkv], coefficients, 5, 1e-7, torch.float32)  # the first step: scale-free
    lr = 1e-2 * 0.2 * 384**0.5  # match_rms_adamw for a (384, 128) matrix; Muon's default weight decay 0.1
    step = (before[qkv] * (1 - 1e-2 * 0.1) - dict(model.named_parameters())[qkv]) / lr
    torch.testing.assert_close(step, expected, atol=1e-5, rtol=1e-4)


def test_muon_needs_transformer_blocks():
    model = create_model("resnet20", num_classes=10)
    with pytest.raises(ValueError, match="2-D hidden weight"):
        MuonAdamW(split_muon_groups([{"params": list(model.parameters())}], set()), lr=0.1)


def test_flip_tta_averages_the_logits_of_the_image_and_its_mirror():
    module = ImageClassifier("vit_nano_patch4_16", num_classes=10, tta_flip=True).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = (module(x) + module(x.flip(-1))) / 2
        torch.testing.assert_close(module.eval_logits(x), expected)
        torch.testing.assert_close(module.eval_logits(x.flip(-1)), expected)  # invariant to mirroring


# -- fewer tokens, and the hybrid stem --------------------------------------------------------------


def test_patch_dropout_keeps_prefix_tokens_and_a_random_ordered_subset_of_patches_while_training():
    from vit.layers import PatchDropout

    drop = PatchDropout(0.5, num_prefix_tokens=1)
    x = torch.arange(17, dtype=torch.float32).view(1, 17, 1).expand(3, 17, 2).contiguous()
    out = drop.train()(x)
    assert out.shape == (3, 9, 2)
    assert (out[:, 0] == 0).all()  # the CLS token stays first
    kept = out[:, 1:, 0]
    assert (kept[:, 1:] > kept[:, :-1]).all()  # patches keep their order
    assert not torch.equal(kept[0], kept[1]) or not torch.equal(kept[1], kept[2])  # a different subset per image
    assert torch.equal(drop.eval()(x), x)


def test_a_vit_with_patch_dropout_trains_on_fewer_tokens_and_evaluates_on_all():
    model = create_model("vit_nano_patch4_16", num_classes=10, patch_drop_rate=0.75, posemb="sincos2d")
    x = torch.randn(2, 3, 16, 16)
    assert model.train()._embed(x)[0].shape == (2, 1 + 4, 128)  # 16 patches -> 4, plus CLS
    assert model.eval()._embed(x)[0].shape == (2, 1 + 16, 128)
    assert model.train()(x).shape == (2, 10)


def test_with_rope_each_kept_patch_is_rotated_by_its_own_grid_position():
    """Patch dropout reorders nothing but removes tokens: the rotary tables must follow the kept
    patches, not be the first rows of the full grid's."""
    torch.manual_seed(0)
    model = create_model("vit_nano_patch4_16", num_classes=10, patch_drop_rate=0.5, posemb="rope")
    x = torch.randn(3, 3, 16, 16)
    full, (cos, sin) = model.eval()._embed(x)
    kept, (kept_cos, kept_sin) = model.train()._embed(x)
    # the tables cover the CLS token too, with the identity rotation (cos 1, sin 0)
    assert kept.shape == (3, 1 + 8, 128) and kept_cos.shape == (3, 1, 1 + 8, cos.shape[-1])
    assert (kept_cos[:, :, 0] == 1).all() and (kept_sin[:, :, 0] == 0).all()
    cos, sin = cos[1:], sin[1:]
    for b in range(3):
        # which of the 16 patches each kept token is (tokens are the patches' embeddings, unchanged)
        where = [int((full[b, 1:] == token).all(dim=-1).nonzero()) for token in kept[b, 1:]]
        assert where == sorted(where) and len(set(where)) == 8
        assert torch.equal(kept_cos[b, 0, 1:], cos[where]) and torch.equal(kept_sin[b, 0, 1:], sin[where])
    logits = model.train()(x)
    logits.sum().backward()  # trains: every block runs on 8 rotated patches and the CLS token
    assert logits.shape == (3, 10) and model.patch_embed.proj.weight.grad.abs().sum() > 0


def test_conv_stem_makes_a_hybrid_with_the_same_token_grid():
    model = create_model("vit_micro_patch4_32", num_classes=10, stem_channels=(48, 96))
    tokens = model.patch_embed(torch.randn(2, 3, 32, 32))
    assert tokens.shape == (2, 64, 192)
    names = [n for n, _ in model.named_parameters() if n.startswith("patch_embed")]
    assert "patch_embed.backbone.0.weight" in names and "patch_embed.proj.weight" in names
    assert model.patch_embed.proj.kernel_size == (1, 1)
    with pytest.raises(ValueError, match="log2"):
        create_model("vit_micro_patch4_32", stem_channels=(48, 96, 192))


def test_a_pooled_conv_stem_convolves_every_pixel_then_pools_to_the_same_grid():
    torch.manual_seed(0)
    model = create_model("vit_micro_patch4_32", num_classes=10, stem_channels=(16, 32), stem_pool=True).eval()
    maps = []
    for layer in model.patch_embed.backbone:
        if isinstance(layer, torch.nn.Conv2d):
            layer.register_forward_hook(lambda m, i, out: maps.append((m.stride, tuple(out.shape[-2:]))))
    tokens = model.patch_embed(torch.randn(2, 3, 32, 32))
    assert tokens.shape == (2, 64, 192)  # the 4x4 patch grid of the plain ViT
    assert maps == [((1, 1), (32, 32)), ((1, 1), (16, 16))]  # stride-1 convs, each map halved by its pool
    strided = create_model("vit_micro_patch4_32", num_classes=10, stem_channels=(16, 32))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in strided.parameters())
    with pytest.raises(ValueError, match="stem_pool pools after the convs of a conv stem: give stem_channels"):
        create_model("vit_micro_patch4_32", stem_pool=True)


@pytest.mark.parametrize(
    "model_name, model_kwargs",
    [("resnet20", {}), ("vit_micro_patch4_32", {"stem_channels": [8, 16], "stem_pool": True})],
    ids=["resnet20", "vit-pooled-stem"],
)
def test_channels_last_stores_convolutions_nhwc_and_gives_the_same_logits(model_name, model_kwargs):
    torch.manual_seed(0)
    plain = ImageClassifier(model_name=model_name, model_kwargs=model_kwargs, num_classes=10).eval()
    nhwc = ImageClassifier(model_name=model_name, model_kwargs=model_kwargs, num_classes=10,
                           speed={"channels_last": True}).eval()  # fmt: skip
    nhwc.model.load_state_dict(plain.model.state_dict())
    conv = next(m.weight for m in nhwc.model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    x = torch.randn(4, 3, 32, 32)
    torch.testing.assert_close(nhwc(x), plain(x), atol=1e-5, rtol=1e-5)


# -- whitened patch embedding ----------------------------------------------------------------------


def _smooth_images(n: int = 64, size: int = 16) -> torch.Tensor:
    """Images whose neighbouring pixels and colour channels are strongly correlated, as in photos."""
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.avg_pool2d(torch.randn(n, 1, size + 3, size + 3, generator=g), 4, stride=1)
    return x * torch.tensor([1.0, 0.8, 0.6]).view(1, 3, 1, 1) + 0.1 * torch.randn(n, 3, size, size, generator=g)


def _patch_tokens(proj: torch.nn.Conv2d, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return proj(images).flatten(2).transpose(1, 2).flatten(0, 1)  # (images * patches, channels)


def test_whitened_patch_embedding_gives_the_patches_zero_mean_and_unit_variance():
    images, eps = _smooth_images(), 1e-3
    patches = torch.nn.functional.unfold(images, 4, stride=4).transpose(1, 2).flatten(0, 1)  # 48 pixels each
    variances = torch.linalg.eigvalsh(torch.cov(patches.T.double())).float()
    assert variances.max() / variances.min() > 100  # strongly correlated pixels
    proj = torch.nn.Conv2d(3, 64, 4, stride=4)
    before = torch.linalg.eigvalsh(torch.cov(_patch_tokens(proj, images).T))
    assert before[-1] / before[-48] > 100  # the default init passes the correlations on

    torch.manual_seed(1)
    whiten_patch_embed_(proj, images, eps=eps)
    tokens = _patch_tokens(proj, images)
    assert tokens.mean(0).abs().max() < 1e-4
    spectrum = torch.linalg.eigvalsh(torch.cov(tokens.T.double())).float()
    # 48 whitened directions, spread over 64 channels by an orthonormal map: variance
    # lambda / (lambda + eps) along each, nothing in the other 16 channels' worth of directions.
    torch.testing.assert_close(spectrum[-48:], (variances / (variances + eps)).sort().values, atol=1e-4, rtol=1e-4)
    assert spectrum[:16].abs().max() < 1e-5

    other = torch.nn.Conv2d(3, 64, 4, stride=4)
    torch.manual_seed(2)  # the spreading map does not use (or depend on) the global RNG
    whiten_patch_embed_(other, images, eps=eps)
    assert torch.equal(other.weight, proj.weight) and torch.equal(other.bias, proj.bias)


def test_whitening_into_fewer_channels_keeps_the_strongest_directions():
    images = _smooth_images()
    patches = torch.nn.functional.unfold(images, 4, stride=4).transpose(1, 2).flatten(0, 1)
    variances, directions = torch.linalg.eigh(torch.cov(patches.T.double()))
    proj = torch.nn.Conv2d(3, 8, 4, stride=4)
    whiten_patch_embed_(proj, images, eps=0.0)
    rows = proj.weight.flatten(1).double()
    # each channel is one of the 8 largest-variance directions, scaled to unit variance
    torch.testing.assert_close(rows.abs(), (directions[:, -8:] / variances[-8:].sqrt()).T.abs(), atol=1e-4, rtol=1e-3)
    spectrum = torch.linalg.eigvalsh(torch.cov(_patch_tokens(proj, images).T))
    torch.testing.assert_close(spectrum, torch.ones(8), atol=1e-3, rtol=0)


def test_whitening_refuses_convs_that_are_not_patchify_and_too_few_patches():
    with pytest.raises(ValueError, match=r"patchify conv .* kernel \(3, 3\), stride \(1, 1\)"):
        whiten_patch_embed_(torch.nn.Conv2d(3, 8, 3), _smooth_images())
    with pytest.raises(ValueError, match=r"images \(B, 3, H, W\), got \(4, 1, 16, 16\)"):
        whiten_patch_embed_(torch.nn.Conv2d(3, 8, 4, stride=4), torch.zeros(4, 1, 16, 16))
    with pytest.raises(ValueError, match=r"48-pixel patches needs at least 96 of them, got 16"):
        whiten_patch_embed_(torch.nn.Conv2d(3, 8, 4, stride=4), torch.zeros(1, 3, 16, 16))


class _PatchEmbedSpy(L.Callback):
    """The first batch's images, and the patch embedding as each step's optimizer sees it."""

    def __init__(self) -> None:
        self.first_images, self.weight_at_step, self.weight_after_step = None, {}, {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 0:  # callbacks see the batch before the module's own hook
            self.first_images = batch[0].clone()

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.weight_at_step[trainer.global_step] = module.model.patch_embed.proj.weight.detach().clone()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.weight_after_step[trainer.global_step - 1] = module.model.patch_embed.proj.weight.detach().clone()


def _whitened_classifier() -> ImageClassifier:
    return ImageClassifier("vit_nano_patch4_16", {"posemb": "sincos2d"}, num_classes=10, whiten_patch_embed=True)


def test_whiten_patch_embed_whitens_the_first_batch_once_and_not_again_on_resume(tmp_path):
    spy = _PatchEmbedSpy()
    data = DigitsDataModule(batch_size=64, pipeline="memory")
    trainer = quiet_trainer(tmp_path, max_steps=2, limit_val_batches=1, callbacks=[spy])
    trainer.fit(_whitened_classifier(), data)
    expected = torch.nn.Conv2d(3, 128, 4, stride=4)  # vit_nano is 128 wide
    whiten_patch_embed_(expected, spy.first_images)
    assert torch.equal(spy.weight_at_step[0], expected.weight)  # the first step starts from the whitening
    assert torch.equal(spy.weight_at_step[1], spy.weight_after_step[0])  # the second from the first's update

    resumed = _PatchEmbedSpy()
    trainer = quiet_trainer(tmp_path, max_steps=3, limit_val_batches=1, callbacks=[resumed])
    trainer.fit(_whitened_classifier(), data, ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))
    assert torch.equal(resumed.weight_at_step[2], spy.weight_after_step[1])  # the trained weights, not re-whitened


def test_whiten_patch_embed_needs_a_patchify_vit_and_no_pretrained_weights():
    with pytest.raises(ValueError, match=r"whiten_patch_embed needs a ViT with a patchify conv; resnet20 has none"):
        ImageClassifier("resnet20", num_classes=10, whiten_patch_embed=True)
    with pytest.raises(ValueError, match=r"has none \(or a stem\)"):
        ImageClassifier("vit_nano_patch4_16", {"stem_channels": [8, 16]}, num_classes=10, whiten_patch_embed=True)
    with pytest.raises(ValueError, match=r"would replace the patch embedding finetune\.init_from loads"):
        ImageClassifier(
            "vit_nano_patch4_16", num_classes=10, whiten_patch_embed=True, finetune={"init_from": "timm:vit_tiny"}
        )
