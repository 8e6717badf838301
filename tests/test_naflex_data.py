"""Images at their own aspect ratio as patch sequences (`data.naflex`): the grid each image gets
within the budget, the pixels its patches hold, evaluation's resize, and NaFlexViT fine-tuning
through scripts/train.py on a folder of mixed-aspect JPEGs, resumed after SIGTERM bit for bit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

import vit
from tests.conftest import ROOT
from tests.test_fault_tolerance import QUIET, assert_bit_identical, signal_at, weights
from vit.checkpoint import Preprocess, load_checkpoint
from vit.cli import main
from vit.data import ImageFolderDataModule, NaFlex
from vit.data.augment import Augment
from vit.data.images import read_rgb
from vit.data.naflex import PackSequences, sequence_grid
from vit.data.transforms import EvalTransform, SequenceEvalTransform, SequenceTrainTransform
from vit.lit import ImageClassifier
from vit.training import Throughput, param_groups

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
# naflexvit_base_patch16_gap cut to 2 blocks of width 32 with 8-pixel patches.
SMALL_NAFLEX = {"embed_dim": 32, "depth": 2, "num_heads": 2, "patch_size": 8}
# (height, width) of the folder's images: wide, tall, square and very wide.
ASPECTS = [(24, 48), (48, 24), (36, 36), (20, 60)]


def unpatchify(batch: dict[str, torch.Tensor], b: int, patch: int) -> torch.Tensor:
    """Image b of a packed batch rebuilt from its valid patches, each put where its (row, column) says."""
    valid = batch["patch_valid"][b]
    coords, patches = batch["patch_coord"][b][valid], batch["patches"][b][valid]
    rows, columns = (int(v) + 1 for v in coords.amax(dim=0))
    image = torch.full((3, rows * patch, columns * patch), float("nan"))
    for (r, c), values in zip(coords.tolist(), patches, strict=True):
        pixels = values.view(patch, patch, 3).permute(2, 0, 1)  # flattened as (row, column, channel)
        image[:, r * patch : (r + 1) * patch, c * patch : (c + 1) * patch] = pixels
    return image


def test_a_wide_image_becomes_a_wide_grid_within_the_budget_and_its_patches_rebuild_it():
    rng = np.random.default_rng(0)
    naflex = NaFlex(max_patches=256, patch_size=16)
    transform = SequenceEvalTransform(naflex, MEAN, STD)
    shapes = [(64, 128), (128, 64), (100, 100), (30, 200)]
    images = [transform(image=rng.integers(0, 256, (*hw, 3), dtype=np.uint8))["image"] for hw in shapes]
    # 2:1 -> 11 x 22 = 242 patches (12 x 24 would be 288); 1:2 -> 22 x 11; square -> 16 x 16; 3:20 -> 6 x 40.
    assert [tuple(image.shape) for image in images] == [
        (3, 176, 352), (3, 352, 176), (3, 256, 256), (3, 96, 640)
    ]  # fmt: skip
    batch, labels = PackSequences(naflex)([(image, label) for label, image in enumerate(images)])
    assert batch["patches"].shape == (4, 256, 16 * 16 * 3) and labels.tolist() == [0, 1, 2, 3]
    assert batch["patch_valid"].sum(dim=1).tolist() == [242, 242, 256, 240]
    for b, image in enumerate(images):
        assert torch.equal(unpatchify(batch, b, 16), image)  # every pixel where its coordinates put it
        n = int(batch["patch_valid"][b].sum())
        assert batch["patch_valid"][b, :n].all() and not batch["patches"][b, n:].any()  # real patches first


def test_the_grid_is_timms_for_the_same_budget():
    """timm's get_image_size_for_seq bisects for the scale; ours takes it exactly. Images of a few
    pixels are left out: timm caps the scale at 100."""
    from timm.data.naflex_transforms import get_image_size_for_seq

    for height in range(5, 400, 13):
        for width in range(5, 600, 17):
            for budget in (1, 16, 64, 256, 576):
                _, (h, w) = get_image_size_for_seq((height, width), 16, budget)
                assert sequence_grid(height, width, budget) == (h // 16, w // 16), (height, width, budget)


def listed_grid(height: int, width: int, max_patches: int) -> tuple[int, int]:
    """The grid as every candidate listed: each whole number of rows, then of columns, up to the budget."""
    by_rows = [(r, -(-width * r // height)) for r in range(1, max_patches + 1)]
    by_columns = [(-(-height * c // width), c) for c in range(1, max_patches + 1)]
    return max(grid for grid in by_rows + by_columns if grid[0] * grid[1] <= max_patches)


def test_the_grid_is_found_without_lists_as_long_as_the_budget():
    """Every candidate listed costs memory and time in proportion to the budget for each image (a
    budget of 10^6: 25 s and 270 MB an image; 10^8: the OOM killer). Bisection gives the same grids
    in a few dozen steps for any budget."""
    import tracemalloc

    rng = np.random.default_rng(0)
    for height, width in [(1, 1), (1, 9000), (9000, 1), (3, 7), (375, 500), *rng.integers(1, 5000, (60, 2))]:
        for budget in (1, 2, 3, 7, 16, 100, 256, 576, 1000, 4097):
            assert sequence_grid(int(height), int(width), budget) == listed_grid(int(height), int(width), budget)
    tracemalloc.start()
    grid = sequence_grid(375, 500, 10**6)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert grid == (866, 1154) and peak < 10_000, peak  # 999,364 patches; listed: 273 MB at its peak
    rows, columns = sequence_grid(375, 500, 10**8)
    assert rows * columns <= 10**8 < (rows + 1) * -(-500 * (rows + 1) // 375)


def test_a_budget_beyond_what_a_model_attends_over_is_refused_in_one_line(tmp_path, capsys):
    """--data.naflex.max_patches 100000000 ran until the kernel's OOM killer ended it (exit 137, no
    message). Above 2^16 patches one image's padding mask alone holds 2^32 entries: refused before
    any work, one line, exit 2."""
    data = write_aspect_folder(tmp_path / "data", per_class=1)
    with pytest.raises(SystemExit) as stop:
        main(recipe(data, tmp_path / "run", "--data.naflex.max_patches", "100000000"))
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and sum(line.startswith("error") for line in err) == 1
    assert err[-1] == (
        "error: --data.naflex.max_patches: got 100000000, expected at most 65,536 patches an image (e.g. 256, "
        "576): the model's padding mask holds max_patches^2 entries an image"
    )
    assert not (tmp_path / "run").exists()


def test_a_batch_padded_to_the_budget_that_cannot_fit_in_memory_is_refused_naming_its_size(
    tmp_path, capsys, monkeypatch
):
    """One batch is batch_size x max_patches patches of 3 x p x p float32 pixels built in RAM by the
    loader, and without CUDA the model's padding mask of max_patches^2 entries an image (at least 2
    bytes each) is in RAM too: a batch that cannot fit in the free RAM is refused, saying what it takes."""
    import vit.data.host

    root = write_aspect_folder(tmp_path / "data", per_class=1)
    monkeypatch.setattr(vit.data.host, "available_memory", lambda: 10**9)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    naflex = {"max_patches": 4096, "patch_size": 16}
    with pytest.raises(ValueError) as refused:
        ImageFolderDataModule(str(root), batch_size=64, naflex=naflex)  # 0.8 GB of patches, 2.1 GB of mask
    assert str(refused.value) == (
        "data.naflex.max_patches: got 4096, expected a budget whose padded batch fits in memory: a batch of 64 "
        "takes 0.8 GB of float32 patches and 2.1 GB of attention mask, and 1.0 GB of RAM is free"
    )
    ImageFolderDataModule(str(root), batch_size=8, naflex=naflex)  # 0.1 GB and 0.3 GB fit
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the mask is then on the GPU
    alone = "a batch of 400 takes 5.0 GB of float32 patches, and 1.0 GB of RAM is free"
    with pytest.raises(ValueError, match=re.escape(alone)):
        ImageFolderDataModule(str(root), batch_size=400, naflex=naflex)
    ImageFolderDataModule(str(root), batch_size=64, naflex=naflex)
    with pytest.raises(SystemExit) as stop:
        main(recipe(root, tmp_path / "run", "--data.naflex.max_patches", "4096", "--data.naflex.patch_size", "16",
                    "--data.batch_size", "400"))  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and err[-1].startswith("error: --data.naflex.max_patches: got 4096, expected a ")


def test_evaluation_resizes_as_the_square_eval_transform_and_keeps_the_whole_image():
    rng = np.random.default_rng(1)
    square = rng.integers(0, 256, (100, 100, 3), dtype=np.uint8)
    naflex = NaFlex(max_patches=16, patch_size=16)  # a square image: 4 x 4 patches, 64 px
    ours = SequenceEvalTransform(naflex, MEAN, STD)(image=square)["image"]
    assert torch.equal(ours, EvalTransform(64, 1.0, MEAN, STD)(image=square)["image"])

    # A 1:3 image, dark on its left third and bright on the rest: 3 x 9 patches, nothing cropped.
    wide = np.full((40, 120, 3), 220, dtype=np.uint8)
    wide[:, :40] = 20
    pixels = SequenceEvalTransform(NaFlex(max_patches=27, patch_size=8), (0, 0, 0), (1, 1, 1))(image=wide)["image"]
    assert pixels.shape == (3, 24, 72)
    assert (pixels[:, :, :20] * 255).round().eq(20).all() and (pixels[:, :, 28:] * 255).round().eq(220).all()


def test_training_crops_keep_near_the_images_aspect_and_follow_the_sample_seed():
    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, (60, 180, 3), dtype=np.uint8)
    naflex = NaFlex(max_patches=64, patch_size=8)
    transform = SequenceTrainTransform(naflex, Augment(crop_scale=(0.3, 1.0), randaugment_ops=2), MEAN, STD)
    shapes = []
    for seed in range(40):
        transform.set_random_seed(seed)
        first = transform(image=image)["image"]
        transform.set_random_seed(seed)
        assert torch.equal(transform(image=image)["image"], first)  # a function of the seed
        rows, columns = first.shape[1] // 8, first.shape[2] // 8
        assert rows * columns <= 64
        shapes.append(columns / rows)
    # Crops of a 3:1 image at 3/4 to 4/3 of its aspect (2.25-4), rounded up to whole patches.
    assert min(shapes) >= 1.8 and max(shapes) <= 5 and len(set(shapes)) > 3

    evaluated = SequenceEvalTransform(naflex, MEAN, STD)(image=image)["image"]
    whole = SequenceTrainTransform(naflex, Augment(crop="resize", hflip=False), MEAN, STD)
    assert torch.equal(whole(image=image)["image"], evaluated)
    flipping = SequenceTrainTransform(naflex, Augment(crop="resize"), MEAN, STD)
    outcomes = set()
    for seed in range(8):
        flipping.set_random_seed(seed)
        out = flipping(image=image)["image"]
        outcomes.add((torch.equal(out, evaluated), torch.equal(out, evaluated.flip(-1))))
    assert outcomes == {(True, False), (False, True)}  # the whole image as it is, or its mirror image


def test_a_batch_transformed_in_one_call_is_each_image_transformed_with_its_seed():
    """A loader worker's batch goes through SequenceTrainTransform.apply_batch (vit.data.images.
    ImageFiles.__getitems__): the same pixels as each image seeded and transformed alone."""
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((60, 180), (90, 40), (33, 33))]
    seeds = [11, 7, 2**31 + 5]
    for augment in (Augment(crop_scale=(0.3, 1.0), randaugment_ops=2), Augment(crop="resize")):
        transform = SequenceTrainTransform(NaFlex(max_patches=64, patch_size=8), augment, MEAN, STD)
        batch = transform.apply_batch(images, seeds)
        for image, seed, out in zip(images, seeds, batch, strict=True):
            transform.set_random_seed(seed)
            assert torch.equal(transform(image=image)["image"], out)


def test_the_options_that_make_square_batches_are_refused_with_naflex(tmp_path):
    root = write_aspect_folder(tmp_path / "data", per_class=1)
    naflex = {"max_patches": 16, "patch_size": 8}
    refused = [
        ({"mixup": {"mixup_alpha": 0.8}}, r"data\.mixup\.mixup_alpha: got 0\.8, expected 0 with --data\.naflex"),
        ({"pipeline": "memory"}, r"data\.pipeline: got 'memory', expected per_sample with --data\.naflex"),
        ({"pipeline": "device"}, r"data\.pipeline: got 'device', expected per_sample with --data\.naflex"),
        ({"augment": {"crop": "pad_crop"}}, r"data\.augment\.crop: got 'pad_crop', expected rrc or resize with"),
        ({"eval_crop_pct": 0.875}, r"data\.eval_crop_pct: got 0\.875, expected 1 with --data\.naflex"),
    ]
    for options, message in refused:
        with pytest.raises(ValueError, match=message):
            ImageFolderDataModule(str(root), img_size=32, naflex=naflex, **options)
    data = ImageFolderDataModule(str(root), img_size=32, naflex=naflex)  # not the pad_crop of small img_size
    assert (data.augment.crop, data.eval_crop_pct) == ("rrc", 1.0)
    train, evaluation = data.describe_transforms()
    assert train == (
        "random resized crop (scale 0.08-1, aspect 0.75-1.3x the image's) resized at its aspect to at most 16 "
        "patches of 8 px, flip, normalise"
    )
    assert evaluation == "the whole image resized at its aspect to at most 16 patches of 8 px (bicubic), normalise"


def test_a_naflexvit_fine_tunes_with_its_embedding_as_the_first_layer():
    """Layer decay and freeze_blocks treat NaFlexVit's `embeds` (patch projection, positions,
    registers) as a ViT's patch embedding, tokens and positions."""
    module = ImageClassifier("naflexvit_base_patch16_gap", SMALL_NAFLEX, num_classes=3, finetune={"freeze_blocks": 1})
    trainable = {name for name, p in module.model.named_parameters() if p.requires_grad}
    assert not any(name.startswith(("embeds.", "blocks.0.")) for name in trainable)
    assert any(name.startswith("blocks.1.") for name in trainable) and "head.weight" in trainable

    model = vit.create_model("naflexvit_base_patch16_gap", **SMALL_NAFLEX, num_classes=3)
    groups = param_groups(model, weight_decay=0.05, lr=1.0, layer_decay=0.5)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    for name in ("embeds.proj.weight", "embeds.pos_embed", "embeds.reg_token"):
        assert lr_of[id(named[name])] == 0.5**3, name  # 2 blocks: the embedding is 3 layers below the head
    assert lr_of[id(named["blocks.1.mlp.fc1.weight"])] == 0.5 and lr_of[id(named["head.weight"])] == 1.0


# -- through scripts/train.py -----------------------------------------------------------------------


def write_aspect_folder(root: Path, per_class: int = 3, classes: int = 4) -> Path:
    """`root/{train,val}/class<c>/<i>.jpg` at the ASPECTS in turn: noise around a per-class grey level."""
    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("val", 1)):
        for c in range(classes):
            for i in range(n):
                height, width = ASPECTS[(c + i) % len(ASPECTS)]
                pixels = rng.normal(60 + 50 * c, 25, (height, width, 3)).clip(0, 255).astype(np.uint8)
                path = root / split / f"class{c}" / f"{i}.jpg"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels).save(path)
    return root


TINY = json.dumps({**SMALL_NAFLEX, "drop_path_rate": 0.0})  # model_kwargs on the command line (YAML takes JSON)


def recipe(data: Path, run: Path, *overrides: str) -> list[str]:
    """configs/finetune/naflexvit_folder.yaml on the CPU with a tiny model: 16 patches of 8 px an
    image, 12 training images in batches of 4 (3 steps an epoch), 2 epochs, one loader worker."""
    return [
        "fit", "--config", str(ROOT / "configs/finetune/naflexvit_folder.yaml"), *QUIET,
        "--trainer.default_root_dir", str(run), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.precision", "32-true", "--trainer.max_epochs", "2", "--trainer.logger", "false",
        "--model.model_kwargs", TINY, "--model.finetune.init_from", "null", "--model.optimizer.lr", "3e-3",
        "--data.root", str(data), "--data.batch_size", "4", "--data.num_workers", "1",
        "--data.naflex.max_patches", "16", "--data.naflex.patch_size", "8", *overrides,
    ]  # fmt: skip


class RecordInputs(L.Callback):
    """Each training batch's input shapes and real patches per image, as the model received them."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.valid: list[list[int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch, batch_idx: int) -> None:
        x, _ = batch
        self.shapes.append(tuple(x["patches"].shape))
        self.valid.append(x["patch_valid"].sum(dim=1).tolist())


@pytest.mark.slow
def test_naflexvit_trains_validates_tests_and_predicts_on_patch_sequences_through_the_cli(tmp_path, one_thread):
    data = write_aspect_folder(tmp_path / "data")
    # A truncated JPEG, last in validation: its stand-in is left out of the scores (data.skip_corrupt).
    (data / "val/class3/9.jpg").write_bytes((data / "val/class3/0.jpg").read_bytes()[:300])
    cli = main(recipe(data, tmp_path / "run", "--trainer.max_epochs", "1", "--data.skip_corrupt", "true",
                      "--trainer.callbacks+=tests.test_naflex_data.RecordInputs",
                      "--trainer.callbacks+=vit.training.Throughput"))  # fmt: skip
    assert cli.trainer.global_step == 3
    assert next(c for c in cli.trainer.callbacks if isinstance(c, Throughput)).images == 12  # images, not dict keys
    record = next(c for c in cli.trainer.callbacks if isinstance(c, RecordInputs))
    assert record.shapes == [(4, 16, 8 * 8 * 3)] * 3
    counts = [n for batch in record.valid for n in batch]
    assert all(1 <= n <= 16 for n in counts) and len(set(counts)) > 1  # random crops, each its own grid
    assert "val/acc1" in cli.trainer.callback_metrics

    val = next(iter(cli.datamodule.val_dataloader()))[0]
    # The whole image at its aspect, sides rounded up to whole patches: 24 x 48 -> 3 x 5, 48 x 24 -> 5 x 3,
    # 36 x 36 -> 4 x 4, 20 x 60 -> 2 x 6 (3 x 7 would be 21).
    assert val["patch_valid"].sum(dim=1).tolist() == [15, 15, 16, 12]
    tested = cli.trainer.test(cli.model, datamodule=cli.datamodule)[0]
    assert 0 <= tested["test/acc1"] <= 1
    probabilities = torch.cat(cli.trainer.predict(cli.model, datamodule=cli.datamodule))
    assert probabilities.shape == (5, 4) and torch.allclose(probabilities.sum(dim=1), torch.ones(5))


@pytest.mark.slow
def test_naflex_training_resumes_after_sigterm_mid_epoch_to_the_same_weights(tmp_path, one_thread):
    """SIGTERM after step 4 (epoch 1, batch 1 of 3), resumed with --ckpt_path last: the model equals
    a run that was never stopped, bit for bit (each image's crop and flip follow its sample seed)."""
    data = write_aspect_folder(tmp_path / "data")
    with pytest.raises(SystemExit) as stopped:
        main(recipe(data, tmp_path / "run", *signal_at(4, "SIGTERM")))
    assert stopped.value.code == 143
    assert torch.load(tmp_path / "run/checkpoints/last-interrupted.ckpt", weights_only=True)["global_step"] == 4
    resumed = main(recipe(data, tmp_path / "run", "--ckpt_path", "last"))
    straight = main(recipe(data, tmp_path / "straight"))
    assert resumed.trainer.global_step == straight.trainer.global_step == 6
    assert_bit_identical(weights(resumed), weights(straight))


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["--model.model_name", "vit_nano_patch4_16", "--model.model_kwargs", "{}"],
         "--model.model_name: got 'vit_nano_patch4_16', expected a NaFlexVit (naflexvit_*) with --data.naflex"),
        (["--data.naflex.patch_size", "16"],
         "--data.naflex.patch_size: got 16, expected 8, the patch size of model naflexvit_base_patch16_gap"),
        (["--model.tta_flip", "true"], "--model.tta_flip: got True, expected off with --data.naflex"),
    ],
    ids=["not-naflexvit", "patch-size", "tta-flip"],
)  # fmt: skip
def test_a_model_that_cannot_take_the_sequences_is_refused_naming_both_options(tmp_path, capsys, overrides, line):
    data = write_aspect_folder(tmp_path / "data", per_class=1)
    with pytest.raises(SystemExit) as stopped:
        main(recipe(data, tmp_path / "run", *overrides))
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {line}")


# -- the checkpoint's preprocessing: vit-predict, vit-export and vit-rollout -------------------------


def test_a_naflex_datamodule_records_its_patch_budget_and_older_settings_have_none(tmp_path):
    root = write_aspect_folder(tmp_path / "data", per_class=1)
    data = ImageFolderDataModule(str(root), img_size=32, naflex={"max_patches": 16, "patch_size": 8})
    recorded = Preprocess.of(data).to_dict()
    assert (recorded["max_patches"], recorded["patch_size"]) == (16, 8)
    assert Preprocess.from_dict(recorded) == Preprocess.of(data)
    square = Preprocess.of(ImageFolderDataModule(str(root), img_size=32))
    assert "max_patches" not in square.to_dict() and square.max_patches is None
    old = {"img_size": 32, "crop_pct": 1.0, "mean": MEAN, "std": STD}  # a checkpoint from before the budget
    assert Preprocess.from_dict(old) == Preprocess(32, 1.0, MEAN, STD, None, None)
    with pytest.raises(ValueError, match="a patch budget needs both max_patches and patch_size, got 16 and None"):
        Preprocess.from_dict({**old, "max_patches": 16})


@pytest.fixture(scope="module")
def naflex_run(tmp_path_factory):
    """The tiny NaFlexViT trained 2 steps through the CLI, validated once; its CLI and last.ckpt."""
    root = tmp_path_factory.mktemp("naflex_run")
    data = write_aspect_folder(root / "data")
    # img_size: the square images an older checkpoint (one without the budget) is given.
    steps = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--data.img_size", "32"]
    cli = main(recipe(data, root / "run", *steps))
    assert cli.trainer.global_step == 2
    return cli, root / "run/checkpoints/last.ckpt"


def validation_probabilities(cli) -> tuple[list[Path], dict[str, torch.Tensor], torch.Tensor]:
    """The validation files in the eval loader's order, its first batch (all of them), and the softmax of
    the logits the validation step computes for it."""
    files = [Path(sample.path) for sample in cli.datamodule.val_set.samples]
    batch, _ = next(iter(cli.datamodule.val_dataloader()))
    assert len(files) == len(batch["patches"]) == 4
    module = cli.model.eval()
    with torch.no_grad():
        return files, batch, module.eval_logits(batch).softmax(dim=-1)


@pytest.mark.slow
def test_vit_predict_on_a_naflex_checkpoint_gives_the_validation_steps_probabilities(naflex_run):
    from vit.tools import predict

    cli, ckpt = naflex_run
    files, batch, expected = validation_probabilities(cli)
    recorded = load_checkpoint(ckpt)[1]["preprocess"]
    assert (recorded["max_patches"], recorded["patch_size"]) == (16, 8)
    prepared = Preprocess.from_dict(recorded)([read_rgb(path) for path in files])
    assert all(torch.equal(prepared[name], batch[name]) for name in batch)  # validation's pixels, packing, padding

    predictions = predict.main([str(ckpt), *map(str, files), "--top-k", "4", "--device", "cpu"])
    names = cli.datamodule.class_names
    assert [p.path for p in predictions] == files
    for prediction, probs in zip(predictions, expected, strict=True):
        for name, prob in prediction.top:
            assert prob == pytest.approx(float(probs[names.index(name)]), abs=1e-6)
    # The square images the checkpoint used to record give other probabilities: the budget is what matters.
    square = Preprocess.from_dict({**recorded, "max_patches": None, "patch_size": None})
    model = load_checkpoint(ckpt)[0]
    with torch.no_grad():
        squares = model(square([read_rgb(path) for path in files])).softmax(dim=-1)
    assert (squares - expected).abs().max() > 1e-3


@pytest.mark.slow
def test_a_checkpoint_without_the_budget_still_predicts_and_explains_square_images(naflex_run, tmp_path):
    from vit.tools import predict, rollout

    cli, ckpt = naflex_run
    checkpoint = torch.load(ckpt, weights_only=True)
    for name in ("max_patches", "patch_size"):
        del checkpoint["vit"]["preprocess"][name]
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    files = [Path(sample.path) for sample in cli.datamodule.val_set.samples]
    model = load_checkpoint(old)[0]
    with torch.no_grad():
        square = Preprocess.from_dict(checkpoint["vit"]["preprocess"])([read_rgb(path) for path in files])
        expected = model(square).softmax(dim=-1)
    assert square.shape == (4, 3, 32, 32)
    predictions = predict.main([str(old), *map(str, files), "--top-k", "4", "--device", "cpu"])
    names = cli.datamodule.class_names
    for prediction, probs in zip(predictions, expected, strict=True):
        for name, prob in prediction.top:
            assert prob == pytest.approx(float(probs[names.index(name)]), abs=1e-6)
    out = rollout.main(["--checkpoint", str(old), str(files[0]), "--out", str(tmp_path / "maps"), "--device", "cpu"])
    assert np.load(out / f"00000_{files[0].name}".replace(".jpg", ".npy")).shape == (4, 4)  # 32 px of 8-px patches


@pytest.mark.slow
def test_vit_rollout_explains_a_naflex_checkpoint_at_each_images_own_grid(naflex_run, tmp_path):
    """One image at a time, unpadded, at the grid validation gave it: its logits are its packed
    sequence's, every method's map has that grid's shape, the predictions shown are vit-predict's and
    attention rollout is the per-image reference of tests/test_rollout.py on the explicit attention."""
    from tests.test_rollout import _numpy_rollout
    from vit.rollout import METHODS
    from vit.tools import predict, rollout

    cli, ckpt = naflex_run
    files = [Path(sample.path) for sample in cli.datamodule.val_set.samples]  # class0..3: the ASPECTS in turn
    images = [read_rgb(path) for path in files]
    grids = [(3, 5), (5, 3), (4, 4), (2, 6)]  # 16 patches of 8 px: a 2:1 image's sides rounded up to 3 x 5
    assert [sequence_grid(*image.shape[:2], 16) for image in images] == grids
    model, meta = load_checkpoint(ckpt)
    preprocess = Preprocess.from_dict(meta["preprocess"])
    singles = preprocess.tensors(images)
    assert [tuple(x.shape[1:]) for x in singles] == [(8 * h, 8 * w) for h, w in grids]
    with torch.no_grad():
        packed = model.eval()(preprocess(images))  # padded to 16 patches, the padding masked
        alone = torch.cat([model(x[None]) for x in singles])
    torch.testing.assert_close(alone, packed, atol=1e-5, rtol=0)

    out = rollout.main(["--checkpoint", str(ckpt), *map(str, files), "--method", ",".join(METHODS),
                        "--out", str(tmp_path / "maps"), "--device", "cpu"])  # fmt: skip
    stems = [f"{i:05d}_{path.stem}" for i, path in enumerate(files)]
    for stem, grid in zip(stems, grids, strict=True):
        for method in METHODS:
            assert np.load(out / f"{stem}_{method}.npy").shape == grid, (stem, method)
    # original | map | overlay, each 3:5 at 224 px wide: the map (never white in jet) 134 px tall, white under it
    wide = np.asarray(Image.open(out / f"{stems[0]}_attention.png"))
    assert wide.shape[1] == 3 * 224 and (wide[:134, 224:448] != 255).any(-1).all() and (wide[134:] == 255).all()
    assert Image.open(out / "gallery.png").width == (1 + len(METHODS)) * 96

    with torch.no_grad():
        logits, attns = model.forward_with_attn(singles[0][None])
    torch.testing.assert_close(logits, packed[:1], atol=1e-5, rtol=0)
    assert (model.num_prefix_tokens, model.global_pool) == (4, "avg") and attns[0].shape[-1] == 4 + 15
    expected = _numpy_rollout([a.numpy() for a in attns], "mean", 0.0, 4, "avg").reshape(1, 3, 5)
    np.testing.assert_allclose(np.load(out / f"{stems[0]}_attention.npy"), expected[0], rtol=1e-5, atol=1e-6)

    sections = (out / "index.html").read_text().split("<section>")[1:]
    shown = [re.findall(r"(\w+): (\d\.\d\d)", section.split("</p>")[0]) for section in sections]
    by_predict = predict.main([str(ckpt), *map(str, files), "--top-k", "3", "--device", "cpu"])
    assert shown == [[(name, f"{prob:.2f}") for name, prob in p.top] for p in by_predict]


@pytest.mark.slow
def test_the_onnx_export_of_a_naflex_checkpoint_takes_patch_sequences_of_its_budget(naflex_run, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import onnx

    from vit.export import OnnxClassifier
    from vit.tools import predict
    from vit.tools.export import main as export_main

    cli, ckpt = naflex_run
    out = tmp_path / "naflex.onnx"
    export_main([str(ckpt), "--out", str(out), "--check_sizes", "16"])  # --input patches, --max_patches 16
    props = {p.key: p.value for p in onnx.load(str(out), load_external_data=False).metadata_props}
    assert {k: props[k] for k in ("vit.input", "vit.patch_size", "vit.max_patches")} == {
        "vit.input": "patches", "vit.patch_size": "8,8", "vit.max_patches": "16"
    }  # fmt: skip
    assert (props["vit.eval_max_patches"], props["vit.eval_patch_size"]) == ("16", "8")
    assert OnnxClassifier(out).preprocess == Preprocess.from_dict(load_checkpoint(ckpt)[1]["preprocess"])
    files, _, expected = validation_probabilities(cli)
    names = cli.datamodule.class_names
    for prediction, probs in zip(predict.main([str(out), *map(str, files), "--top-k", "4"]), expected, strict=True):
        for name, prob in prediction.top:
            assert prob == pytest.approx(float(probs[names.index(name)]), abs=1e-5)

    export_main([str(ckpt), "--out", str(out), "--check_sizes", "16", "--max_patches", "24"])  # the option wins
    props = {p.key: p.value for p in onnx.load(str(out), load_external_data=False).metadata_props}
    assert (props["vit.max_patches"], props["vit.eval_max_patches"]) == ("24", "16")
    capsys.readouterr()
    export_main([str(ckpt), "--out", str(out), "--check_sizes", "16", "--input", "images"])
    props = {p.key: p.value for p in onnx.load(str(out), load_external_data=False).metadata_props}
    assert "vit.input" not in props and "vit.eval_max_patches" not in props and props["vit.eval_img_size"] == "32"
    assert "this image export's metadata says 32 px squares instead" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"max_patches \(8\) is shorter than the preprocessing's budget of 16"):
        export_main([str(ckpt), "--out", str(out), "--check_sizes", "16", "--max_patches", "8"])
