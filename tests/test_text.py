"""Character-level language modelling: tokenizer, text windows, LanguageModel training, sampling."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

import vit.gpt
import vit.vision_transformer
from tests.conftest import ROOT
from vit import create_model
from vit.checkpoint import load_model, read_lightning_checkpoint
from vit.cli import TrainCLI, main
from vit.data import CharTokenizer, TextDataModule
from vit.language_model import LanguageModel
from vit.layers import Block
from vit.schedule import warmup_decay_steps
from vit.tools.sample import sample

GPT_CONFIGS = sorted((ROOT / "configs" / "gpt").glob("*.yaml"))
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
WORDS = ["the", "king", "queen", "shall", "not", "speak", "of", "love", "and", "death", "to", "my", "lord",
         "good", "night", "sweet", "prince"]  # fmt: skip


def _verse(lines: int = 300, seed: int = 0) -> str:
    """Seeded pseudo-verse: 16 words, 25 distinct characters; a model learns their spelling fast."""
    rng = random.Random(seed)
    return "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 8))) + ".\n" for _ in range(lines))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These models are tiny: a second thread only adds waiting, and a lot of it when the other core is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "verse.txt"
    path.write_text(_verse(), encoding="utf-8")
    return path


def fit(root: Path, text: Path, *overrides: str):
    """A tiny GPT (2 blocks, width 32, context 32) through `scripts/train.py fit --config configs/gpt/cpu.yaml`."""
    args = [
        "fit", "--config", str(ROOT / "configs/gpt/cpu.yaml"), "--trainer.default_root_dir", str(root), *QUIET,
        "--data.path", str(text), "--data.block_size", "32", "--data.batch_size", "8", "--data.val_windows", "64",
        "--model.model_kwargs", '{"depth": 2, "embed_dim": 32, "num_heads": 2}', "--model.optimizer.lr", "3e-3",
        "--model.schedule.warmup_steps", "5", "--trainer.logger", "false", "--trainer.num_sanity_val_steps", "0",
        *overrides,
    ]  # fmt: skip
    return main(args)


class ValLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    def on_validation_end(self, trainer, module) -> None:
        self.losses.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_file) -> tuple[Path, list[tuple[int, float]]]:
    """60 steps on the verse, validating every 20; returns the last checkpoint and the val losses."""
    root = tmp_path_factory.mktemp("run")
    cli = fit(
        root, text_file, "--trainer.max_steps", "60", "--trainer.val_check_interval", "20",
        "--model.schedule.decay_steps", "60", "--trainer.callbacks+=tests.test_text.ValLosses",
    )  # fmt: skip
    (losses,) = [cb.losses for cb in cli.trainer.callbacks if isinstance(cb, ValLosses)]
    return root / "checkpoints" / "last.ckpt", losses


# -- tokenizer and data ---------------------------------------------------------------------------


def test_tokenizer_round_trips_any_utf8_text():
    text = "Ünïcödé — naïve café, 日本語!\nand back."
    tok = CharTokenizer.from_text(text)
    assert tok.vocab == "".join(sorted(set(text))) and len(tok) == 22
    ids = tok.encode(text)
    assert len(ids) == len(text) and min(ids) == 0 and max(ids) == len(tok) - 1
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text


def test_tokenizer_names_characters_it_does_not_know():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"not in the vocabulary: 'xz'"):
        tok.encode("abxcz")


def test_windows_are_the_text_shifted_by_one(text_file):
    text = text_file.read_text()
    data = TextDataModule(str(text_file), block_size=32, batch_size=4, val_windows=10)
    data.setup("fit")
    n_train = int(len(text) * 0.9)
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long
    for xs, ys in [*zip(x, y, strict=True), data.val_set[3]]:
        torch.testing.assert_close(xs[1:], ys[:-1])  # y is x one character later
        window = data.tokenizer.decode(xs) + data.tokenizer.decode(ys[-1:])
        assert window in text
    assert data.tokenizer.decode(x[0]) + data.tokenizer.decode(y[0, -1:]) in text[:n_train]
    val_start = data.val_set.starts[3]
    assert data.tokenizer.decode(data.val_set[3][0]) == text[n_train + val_start : n_train + val_start + 32]


def test_validation_windows_are_one_fixed_set(text_file):
    def val_batches(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        data = TextDataModule(str(text_file), block_size=16, val_windows=50)
        data.setup("fit")
        return [x for x, _ in data.val_dataloader()]

    first, second = val_batches(0), val_batches(1)
    assert sum(len(x) for x in first) == 50
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_val_holdout_validates_on_the_end_of_the_training_text_and_tests_on_the_validation_split(text_file):
    text = text_file.read_text()
    n_train = int(len(text) * 0.9)
    n_fit = n_train - int(n_train * 0.2)
    plain = TextDataModule(str(text_file), block_size=16, val_windows=40)
    held = TextDataModule(str(text_file), block_size=16, val_windows=40, val_holdout=0.2)
    plain.setup("fit")
    held.setup("fit")
    assert len(held.train_set.tokens) == n_fit and len(plain.train_set.tokens) == n_train
    assert held.val_set.tokens.tolist() == plain.train_set.tokens[n_fit:].tolist()  # the training text's end
    # the test split is the validation split of a run without the holdout: the same 40 windows
    assert held.test_set.tokens.tolist() == plain.val_set.tokens.tolist()
    assert held.test_set.starts == plain.val_set.starts == plain.test_set.starts
    assert all(torch.equal(a[0], b[0]) for a, b in zip(held.test_dataloader(), plain.val_dataloader(), strict=True))
    with pytest.raises(ValueError, match=r"data.val_holdout: got 1.0, expected the share of the training text"):
        TextDataModule(str(text_file), val_holdout=1.0)


def test_training_windows_cover_random_offsets_and_depend_on_the_seed(text_file):
    data = TextDataModule(str(text_file), block_size=16, batch_size=64)
    data.setup("fit")
    windows = {tuple(x.tolist()) for x, _ in [data.train_set[(0, s)] for s in range(200)]}
    assert len(windows) > 150  # random, not a fixed tiling
    torch.testing.assert_close(data.train_set[(0, 5)], data.train_set[(99, 5)])  # the seed decides


def test_bad_text_input_gives_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"text file .*missing\.txt does not exist"):
        TextDataModule(str(tmp_path / "missing.txt")).setup()
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt is empty"):
        TextDataModule(str(empty)).setup()
    short = tmp_path / "short.txt"
    short.write_text("to be or not to be, " * 10)  # 200 chars: 180 train, 20 validation
    with pytest.raises(ValueError, match=r"validation split of .*short\.txt has 20 characters.*block_size 64"):
        TextDataModule(str(short), block_size=64).setup()
    binary = tmp_path / "image.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ValueError, match=r"image\.bin is not UTF-8"):
        TextDataModule(str(binary)).setup()


def test_a_failed_download_is_one_try_that_names_the_url_the_file_and_data_path(tmp_path, monkeypatch):
    """Offline, Tiny Shakespeare's download raised urllib's URLError with no word of --data.path."""
    import socket
    import urllib.error

    from vit.data.text import TINY_SHAKESPEARE_URL

    calls = []

    def offline(url, timeout=None):
        calls.append((url, timeout))
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setattr("urllib.request.urlopen", offline)
    data = TextDataModule(download_dir=str(tmp_path / "data"))
    with pytest.raises(OSError) as e:
        data.prepare_data()
    assert str(e.value) == (
        "could not download Tiny Shakespeare (<urlopen error [Errno -2] Name or service not known>): fetch "
        f"{TINY_SHAKESPEARE_URL} elsewhere and pass the file with --data.path /path/to/input.txt "
        f"(or put it at {tmp_path / 'data' / 'tinyshakespeare.txt'})"
    )
    assert calls == [(TINY_SHAKESPEARE_URL, 30)]  # one try, and a stalled network gives up after 30 s
    assert list((tmp_path / "data").iterdir()) == []  # nothing a later run would take for the text


# -- model ----------------------------------------------------------------------------------------


def test_the_gpt_and_the_vit_are_built_of_the_same_block_class():
    gpt, vit_model = create_model("gpt_char_cpu", vocab_size=20), create_model("vit_nano_patch4_16")
    assert {type(b) for b in gpt.blocks} == {type(b) for b in vit_model.blocks} == {Block}


@pytest.mark.parametrize("posemb", ["learn", "sincos", "rope"])
def test_cached_and_uncached_generation_give_the_same_tokens(posemb):
    model = create_model("gpt_char_cpu", vocab_size=30, block_size=24, posemb=posemb).eval()
    prompt = torch.randint(0, 30, (3, 5))
    for temperature, top_k in [(0.0, None), (1.0, None), (0.8, 5)]:
        cached, uncached = (
            model.generate(prompt, 40, temperature, top_k, torch.Generator().manual_seed(3), use_cache=use_cache)
            for use_cache in (True, False)
        )  # 45 tokens: past block_size 24, where the window starts sliding
        assert cached.shape == (3, 45)
        assert torch.equal(cached, uncached), (temperature, top_k)


def test_cached_logits_match_the_full_forward_pass():
    model = create_model("gpt_char_cpu", vocab_size=30, block_size=16).eval()
    idx = torch.randint(0, 30, (2, 16))
    caches = [vit.gpt.KVCache() for _ in model.blocks]
    with torch.no_grad():
        full = model(idx)
        steps = [model(idx[:, :10], caches)] + [model(idx[:, i : i + 1], caches) for i in range(10, 16)]
        with pytest.raises(ValueError, match="16 cached \\+ 1 new tokens exceeds block_size 16"):
            model(idx[:, :1], caches)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


# -- training through the pipeline ----------------------------------------------------------------


def test_gpt_configs_parse_and_checkpoint_on_val_loss(capsys):
    assert {p.name for p in GPT_CONFIGS} >= {"cpu.yaml", "best.yaml"}
    for config in GPT_CONFIGS:
        with pytest.raises(SystemExit):
            main(["fit", "--config", str(config), "--print_config"])
        printed = capsys.readouterr().out
        assert "class_path: vit.language_model.LanguageModel" in printed, config
        assert "monitor: val/loss" in printed and "mode: min" in printed, config


def test_nanogpt_cpu_config_holds_its_settings(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs/gpt/cpu.yaml"), "--print_config"])
    printed = capsys.readouterr().out
    for line in (
        "model_name: gpt_char_cpu", "block_size: 64", "batch_size: 12", "max_steps: 2000", "lr: 0.001",
        "min_lr: 0.0001", "warmup_steps: 100", "decay_steps: 2000", "weight_decay: 0.1", "- 0.99",
        "gradient_clip_val: 1.0", "val_check_interval: 250",
    ):  # fmt: skip
        assert line in printed, line
    config = vit.model_config("gpt_char_cpu")
    assert (config.depth, config.num_heads, config.embed_dim, config.dropout) == (4, 4, 128, 0.0)


def test_the_fast_config_trains_the_blocks_matrices_with_muon_and_lowers_the_loss(text_file, tmp_path):
    cli = main([
        "fit", "--config", str(ROOT / "configs/gpt/fast.yaml"), "--trainer.default_root_dir", str(tmp_path), *QUIET,
        "--data.path", str(text_file), "--data.val_windows", "64", "--trainer.logger", "false",
        "--trainer.max_steps", "40", "--model.schedule.decay_steps", "40", "--model.schedule.warmup_steps", "4",
        "--trainer.val_check_interval", "20", "--trainer.num_sanity_val_steps", "0",
        "--model.model_kwargs", '{"depth": 2, "embed_dim": 32, "num_heads": 2, "norm": "rmsnorm", "mlp": "swiglu", '
        '"posemb": "rope"}',
    ])  # fmt: skip
    model, optimizer = cli.model.model, cli.trainer.optimizers[0]
    assert (model.config.norm, model.config.mlp, model.config.posemb) == ("rmsnorm", "swiglu", "rope")
    muon = {id(p) for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    blocks = {id(p) for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2}
    assert muon == blocks  # AdamW for the embedding and the norms
    # 25 characters: chance is ln 25 = 3.22 nats/char; measured here 2.46 after 40 steps
    assert float(cli.trainer.callback_metrics["val/loss"]) < math.log(25) - 0.6


def test_without_a_config_the_checkpoint_still_follows_the_models_metric(text_file, tmp_path):
    args = ["--model", "vit.language_model.LanguageModel", "--data", "vit.data.TextDataModule",
            "--data.path", str(text_file), "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    checkpoint = TrainCLI(args=args, run=False).trainer.checkpoint_callback
    assert (checkpoint.monitor, checkpoint.mode) == ("val/loss", "min")


def test_a_few_training_steps_lower_the_loss(trained):
    _, losses = trained
    steps, values = zip(*losses, strict=True)
    assert steps == (20, 40, 60)
    # 25 characters: chance is ln 25 = 3.22 nats/char; measured here 2.47, 2.08, 2.00.
    assert values[0] < math.log(25) - 0.5
    assert values[0] > values[1] > values[2] and values[2] < 2.2


def test_the_checkpoint_alone_rebuilds_the_model_and_its_tokenizer(trained, text_file):
    ckpt, _ = trained
    meta = read_lightning_checkpoint(ckpt)["vit"]
    assert meta["vocab"] == "".join(sorted(set(text_file.read_text())))
    assert meta["model_kwargs"] == {"depth": 2, "embed_dim": 32, "num_heads": 2, "vocab_size": 25, "block_size": 32}
    model = load_model(ckpt)
    module = LanguageModel.load_from_checkpoint(ckpt)  # vocab and sizes from the hyperparameters
    idx = torch.randint(0, 25, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(module.model.eval()(idx), model(idx))
    assert module.tokenizer.vocab == meta["vocab"]


def test_sampling_is_reproducible_with_a_seed(trained):
    ckpt, _ = trained
    first = sample(ckpt, "the king", max_new_tokens=80, temperature=0.8, top_k=10, seed=7, num_samples=2)
    again = sample(ckpt, "the king", max_new_tokens=80, temperature=0.8, top_k=10, seed=7, num_samples=2)
    other = sample(ckpt, "the king", max_new_tokens=80, temperature=0.8, top_k=10, seed=8, num_samples=2)
    assert first == again and first != other
    assert all(len(text) == 88 and text.startswith("the king") for text in first)
    assert first[0] != first[1]  # the samples of one call differ
    uncached = sample(ckpt, "the king", max_new_tokens=80, temperature=0.8, top_k=10, seed=7, num_samples=2,
                      use_cache=False)  # fmt: skip
    assert uncached == first
    with pytest.raises(ValueError, match="not in the vocabulary: 'Z'"):
        sample(ckpt, "Zounds")


def test_resume_matches_an_uninterrupted_run(text_file, tmp_path):
    """Stopped at step 15 (mid-epoch: 6 batches make an epoch here), resumed to 30: same weights."""
    common = ["--trainer.val_check_interval", "5", "--model.schedule.decay_steps", "30", "--data.val_windows", "16",
              "--model.model_kwargs", '{"depth": 2, "embed_dim": 32, "num_heads": 2, "dropout": 0.1}']  # fmt: skip
    text = text_file.parent / "short_verse.txt"
    text.write_text(_verse(lines=60, seed=1))
    fit(tmp_path / "straight", text, "--trainer.max_steps", "30", *common)
    fit(tmp_path / "resumed", text, "--trainer.max_steps", "15", *common)
    cli = fit(tmp_path / "resumed", text, "--trainer.max_steps", "30", "--ckpt_path", "last", *common)
    assert cli.trainer.global_step == 30
    assert len(cli.datamodule.train_dataloader()) == 6
    straight, resumed = (
        torch.load(tmp_path / run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        for run in ("straight", "resumed")
    )
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_resumed_run_keeps_its_seed_whatever_the_new_process_was_seeded_with(text_file, tmp_path):
    """Seeded 5, stopped at step 3, resumed in a process seeded 9 (as `seed_everything: true` would
    pick a new seed): model and data go on with 5, and the process's global seed stays 9. The
    datamodule holds the seed in the checkpoint itself; a checkpoint without it gives the task's."""
    fit(tmp_path, text_file, "--seed_everything", "5", "--trainer.max_steps", "3")
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["TextDataModule"] == {"seed": 5}
    for without_datamodule_seed in (False, True):
        if without_datamodule_seed:
            checkpoint = torch.load(last, weights_only=True)
            del checkpoint["TextDataModule"]
            torch.save(checkpoint, last)
        cli = fit(tmp_path, text_file, "--seed_everything", "9", "--trainer.max_steps", "6", "--ckpt_path", "last")
        assert cli.trainer.global_step == 6
        assert cli.model.seed == cli.datamodule.seed == cli.trainer.train_dataloader.sampler.seed == 5
        assert torch.load(last, weights_only=True)["vit_seed"] == 5
        assert os.environ["PL_GLOBAL_SEED"] == "9"


def test_a_run_resumed_with_another_lr_trains_at_it(text_file, tmp_path, caplog):
    """As after a NaN loss: 3 steps at lr 3e-3, resumed with 1.5e-3: the schedule keeps its shape at half the height."""
    common = ["--model.schedule.warmup_steps", "2", "--model.schedule.decay_steps", "6", "--model.schedule.min_lr", "0"]
    fit(tmp_path, text_file, "--trainer.max_steps", "3", *common)
    with caplog.at_level("INFO", logger="vit"):
        cli = fit(tmp_path, text_file, "--trainer.max_steps", "6", "--ckpt_path", "last",
                  "--model.optimizer.lr", "1.5e-3", "--trainer.callbacks+=tests.faults.RecordLR", *common)  # fmt: skip
    assert "resuming with peak lr 0.0015 instead of the checkpoint's 0.003" in caplog.text
    lrs = next(cb for cb in cli.trainer.callbacks if hasattr(cb, "lrs")).lrs
    assert lrs == pytest.approx({step: 1.5e-3 * warmup_decay_steps(step, 2, 6, 0.0) for step in (3, 4, 5)}, rel=1e-9)


def test_a_mixture_of_experts_gpt_trains_with_its_load_balancing_loss(text_file, tmp_path):
    kwargs = '{"depth": 2, "embed_dim": 32, "num_heads": 2, "num_experts": 4}'
    cli = fit(tmp_path, text_file, "--model.model_kwargs", kwargs, "--trainer.max_steps", "3")
    metrics = cli.trainer.callback_metrics
    # Switch's balancing loss is 1 per MoE layer when the experts share the tokens evenly: 2 layers,
    # measured 2.03; train/loss stays the language-modelling loss (3.12 after 3 steps, ln 25 = 3.22).
    assert 1.8 < float(metrics["train/aux_loss"]) < 3.0
    assert float(metrics["train/loss"]) < math.log(25)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--temperature", "nan"], "argument --temperature: must be a finite number of at least 0, got nan"),
        (["--max_new_tokens", "-5"], "argument --max_new_tokens: must be a whole number of at least 0, got -5"),
        (["--num_samples", "0"], "argument --num_samples: must be a whole number of at least 1, got 0"),
    ],
)
def test_sampling_options_out_of_range_are_usage_errors(tmp_path, capsys, option, message):
    """`--temperature nan` ended in a traceback and a negative `--max_new_tokens` was accepted."""
    from vit.tools.sample import main as sample_main

    with pytest.raises(SystemExit) as exit_info:
        sample_main([str(tmp_path / "gpt.ckpt"), *option])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")
