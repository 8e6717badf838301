"""ONNX export: onnxruntime runs the exported file at any batch and image size and gives our
PyTorch logits; inputs the file cannot take are refused with the reason."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # torch's dynamo exporter translates with it

from vit import create_model  # noqa: E402
from vit.checkpoint import Preprocess  # noqa: E402
from vit.data.transforms import eval_transform  # noqa: E402
from vit.export import ImageSpec, OnnxClassifier, export_onnx, max_abs_diff  # noqa: E402
from vit.naflex import pack  # noqa: E402
from vit.tools.export import main as export_main  # noqa: E402


@pytest.fixture(scope="module")
def vit_onnx(tmp_path_factory):
    """vit_nano_patch4_16 (16 px, patch 4, learned position embedding built for 16 px), exported."""
    torch.manual_seed(0)
    model = create_model("vit_nano_patch4_16", num_classes=5).eval()
    path = export_onnx(model, tmp_path_factory.mktemp("onnx") / "vit.onnx")
    return model, OnnxClassifier(path), path


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("size", [16, 24])
def test_exported_vit_gives_our_logits_at_the_export_size_and_another(vit_onnx, batch, size):
    model, onnx_model, _ = vit_onnx
    images = torch.randn(batch, 3, size, size)
    # At another size the position embedding is resampled, as a model built with dynamic_img_size=True does.
    reference = create_model("vit_nano_patch4_16", num_classes=5, dynamic_img_size=True).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = reference(images)
        if size == 16:
            torch.testing.assert_close(expected, model(images))
    torch.testing.assert_close(torch.from_numpy(onnx_model(images)), expected, atol=1e-4, rtol=0)
    assert max_abs_diff(model, onnx_model, images) < 1e-4


def test_graph_has_symbolic_batch_height_width_and_antialiased_resize(vit_onnx):
    graph = onnx.load(str(vit_onnx[2])).graph
    dims = graph.input[0].type.tensor_type.shape.dim
    assert [bool(d.dim_param) for d in dims] == [True, False, True, True]  # B, 3, H, W
    resizes = [n for n in graph.node if n.op_type == "Resize"]
    antialias = [onnx.helper.get_attribute_value(a) for n in resizes for a in n.attribute if a.name == "antialias"]
    assert resizes and antialias == [1] * len(resizes)


def test_images_the_exported_vit_cannot_take_are_refused_with_the_reason(vit_onnx):
    onnx_model = vit_onnx[1]
    with pytest.raises(ValueError, match="not a positive multiple of the patch size 4x4"):
        onnx_model(torch.randn(1, 3, 18, 16))
    with pytest.raises(ValueError, match="expected 3 channels"):
        onnx_model(torch.randn(1, 1, 16, 16))
    with pytest.raises(ValueError, match=r"shape \(batch, 3, height, width\)"):
        onnx_model(torch.randn(3, 16, 16))
    with pytest.raises(ValueError, match="float images"):
        onnx_model(torch.zeros(1, 3, 16, 16, dtype=torch.uint8))
    static = ImageSpec(3, (4, 4), (16, 16), dynamic=False)
    with pytest.raises(ValueError, match="fixed image size 16x16, got 24x24"):
        static.check((1, 3, 24, 24))


def test_what_cannot_be_exported_is_refused_before_tracing(tmp_path):
    with pytest.raises(TypeError, match="exports image classifiers"):
        export_onnx(create_model("gpt_char_cpu", vocab_size=10), tmp_path / "gpt.onnx")
    vit = create_model("vit_nano_patch4_16", num_classes=5)
    with pytest.raises(ValueError, match="not a positive multiple of the patch size"):
        export_onnx(vit, tmp_path / "vit.onnx", img_size=18)
    with pytest.raises(ValueError, match="opset 17 has no antialiased Resize"):
        export_onnx(vit, tmp_path / "vit.onnx", opset=17)
    with pytest.raises(ValueError, match="not a positive multiple of the patch size"):  # its preprocessing's images
        export_onnx(vit, tmp_path / "vit.onnx", preprocess=Preprocess(18, 1.0, (0.5,) * 3, (0.5,) * 3))
    with pytest.raises(ValueError, match="fixed image size 16x16, got 24x24"):
        export_onnx(vit, tmp_path / "vit.onnx", dynamic=False, preprocess=Preprocess(24, 1.0, (0.5,) * 3, (0.5,) * 3))
    with pytest.raises(ValueError, match="mixture-of-experts ViT cannot be exported"):
        export_onnx(create_model("vit_nano_patch4_16", num_experts=2), tmp_path / "moe.onnx")
    with pytest.raises(FileNotFoundError):
        OnnxClassifier(tmp_path / "missing.onnx")


def test_the_preprocessing_and_class_names_go_into_the_metadata_and_come_back(vit_onnx, tmp_path):
    """What a bare onnxruntime session reads (docs/export.md), and OnnxClassifier prepares images with;
    a file exported without them says nothing, and prepare refuses."""
    settings = Preprocess(16, 0.875, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    names = ["goldfish", "tabby, tabby cat", "n03", "Bücherwurm", "5"]
    path = export_onnx(vit_onnx[0], tmp_path / "meta.onnx", preprocess=settings, class_names=names)
    onnx_model = OnnxClassifier(path)
    assert onnx_model.preprocess == settings and onnx_model.class_names == names
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert {k: props[k] for k in ("vit.eval_img_size", "vit.eval_crop_pct", "vit.eval_interpolation")} == {
        "vit.eval_img_size": "16", "vit.eval_crop_pct": "0.875", "vit.eval_interpolation": "bicubic",
    }  # fmt: skip
    assert props["vit.mean"] == "0.485,0.456,0.406" and props["vit.std"] == "0.229,0.224,0.225"
    assert json.loads(props["vit.class_names"]) == names and props["vit.in_chans"] == "3"
    image = np.random.default_rng(0).integers(0, 256, (30, 20, 3), dtype=np.uint8)
    expected = eval_transform(16, 0.875, settings.mean, settings.std)(image=image)["image"][None]
    np.testing.assert_array_equal(onnx_model.prepare([image]), expected.numpy())
    with torch.no_grad():
        np.testing.assert_allclose(onnx_model(onnx_model.prepare([image])), vit_onnx[0](expected), atol=1e-4, rtol=0)

    bare = vit_onnx[1]
    assert bare.preprocess is None and bare.class_names is None
    with pytest.raises(ValueError, match="does not say how to prepare images"):
        bare.prepare([image])


def test_sincos_vit_and_cifar_resnet_export_with_a_dynamic_size(tmp_path):
    for name, kwargs, sizes in [
        ("vit_nano_patch4_16", {"posemb": "sincos2d"}, (16, 32)),
        ("resnet20", {}, (32, 40)),
    ]:
        model = create_model(name, num_classes=5, **kwargs).eval()
        onnx_model = OnnxClassifier(export_onnx(model, tmp_path / f"{name}.onnx"))
        for batch, size in zip((1, 3), sizes, strict=True):
            assert max_abs_diff(model, onnx_model, torch.randn(batch, 3, size, size)) < 1e-4, (name, size)


def test_a_hybrid_vit_exports_with_a_dynamic_size_in_steps_of_its_backbone_stride(tmp_path):
    """AugReg's R-Ti hybrid (timm's ResNetV2 stem, then 8x8 patches of its feature map: one token per
    32x32 pixels), 2 blocks deep, at 64 px: onnxruntime gives our logits at 64 and 96 px; 80 px is refused."""
    torch.manual_seed(0)
    model = create_model("vit_tiny_r_s16_p8_224", img_size=64, num_classes=5, depth=2).eval()
    onnx_model = OnnxClassifier(export_onnx(model, tmp_path / "hybrid.onnx"))
    assert onnx_model.spec.multiple == (32, 32)
    for batch, size in ((1, 64), (3, 96)):
        assert max_abs_diff(model, onnx_model, torch.randn(batch, 3, size, size)) < 1e-4, size
    with pytest.raises(ValueError, match="not a positive multiple of the patch size 32x32"):
        onnx_model(torch.randn(1, 3, 80, 80))


def test_script_exports_a_timm_format_file_and_checks_two_sizes(tmp_path, capsys):
    torch.save(create_model("vit_nano_patch4_16", num_classes=5).state_dict(), tmp_path / "w.pth")
    out = tmp_path / "nano.onnx"
    diffs = export_main([str(tmp_path / "w.pth"), "--model", "vit_nano_patch4_16", "--out", str(out)])
    assert out.is_file() and list(diffs) == [16, 24] and max(diffs.values()) < 1e-4
    printed = capsys.readouterr().out
    assert "2x3x24x24: max |onnxruntime - torch| =" in printed and "OK: within 0.0001 at 16, 24 px" in printed
    with pytest.raises(SystemExit, match="1"):
        export_main([str(tmp_path / "w.pth"), "--model", "vit_nano_patch4_16", "--out", str(out), "--atol", "1e-12"])


def test_a_bare_onnxruntime_session_takes_other_sizes_as_the_last_whole_patch(vit_onnx):
    """What README says of the file itself: only OnnxClassifier refuses an 18x18 image; onnxruntime
    alone runs it as the patchify convolution does, on the 16x16 of whole patches."""
    import onnxruntime as ort

    model, _, path = vit_onnx
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    images = torch.randn(2, 3, 18, 18)
    (logits,) = session.run(None, {"images": images.numpy()})
    with torch.no_grad():
        expected = model(images[..., :16, :16])
    torch.testing.assert_close(torch.from_numpy(logits), expected, atol=1e-4, rtol=0)


def test_the_script_names_a_file_that_is_no_checkpoint_and_never_leaves_a_partial_onnx(tmp_path, capsys):
    import resource

    text = tmp_path / "notes.pth"
    text.write_text("hello")
    with pytest.raises(ValueError, match=f"{text} is not a PyTorch checkpoint"):
        export_main([str(text)])

    torch.save(create_model("vit_nano_patch4_16", num_classes=5).state_dict(), tmp_path / "w.pth")
    out = tmp_path / "nano.onnx"
    out.write_bytes(b"the previous export")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, limit[1]))  # a disk that fills part-way through the file
    try:
        with pytest.raises(OSError, match=f"could not write {out}: File too large"):
            export_main([str(tmp_path / "w.pth"), "--model", "vit_nano_patch4_16", "--out", str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert out.read_bytes() == b"the previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nano.onnx", "notes.pth", "w.pth"]


def test_offline_a_timm_name_fails_in_one_line_that_says_how_to_export_a_downloaded_file(monkeypatch, tmp_path, capsys):
    """The advice used to name --model.finetune.init_from, a training option this script does not
    have; it names the hub repository of the default tag and the script's own form for a file."""
    from huggingface_hub import constants
    from safetensors.torch import save_file

    from vit.tools.export import cli

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the hub reads HF_HUB_OFFLINE at import
    monkeypatch.setattr("sys.argv", ["export.py", "timm:vit_tiny_patch16_224", "--out", str(tmp_path / "t.onnx")])
    with pytest.raises(SystemExit) as stop:
        cli()
    err = capsys.readouterr().err
    assert stop.value.code == 1 and len(err.strip().splitlines()) == 1 and "init_from" not in err
    assert err.startswith("error: could not get timm's pretrained weights for 'vit_tiny_patch16_224' (")
    assert "model.safetensors from https://huggingface.co/timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k" in err
    assert err.rstrip().endswith(
        "export the file: scripts/export.py /path/to/model.safetensors --model vit_tiny_patch16_224"
    )
    assert not (tmp_path / "t.onnx").exists()

    # The advised form, with a timm-format model.safetensors (a small model, to stay quick).
    save_file(create_model("vit_nano_patch4_16", num_classes=5).state_dict(), str(tmp_path / "model.safetensors"))
    diffs = export_main([str(tmp_path / "model.safetensors"), "--model", "vit_nano_patch4_16"])
    assert max(diffs.values()) < 1e-4 and (tmp_path / "model.onnx").is_file()


def test_with_the_network_cut_the_hubs_error_class_brings_the_same_one_line_advice(monkeypatch, tmp_path, capsys):
    """Without the hub's offline switch: name resolution fails as on a machine without a network, the
    hub raises LocalEntryNotFoundError (an OSError) over socket's error, and that class, not its
    wording, makes the failure a download failure. A timm error of another kind keeps its own message."""
    import socket
    import time

    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    from vit.checkpoint import PretrainedDownloadError, read_weights
    from vit.tools.export import cli

    def no_network(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # the hub retries with back-off
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing cached
    with pytest.raises(PretrainedDownloadError) as error:
        read_weights("timm:vit_tiny_patch16_224")
    assert error.value.name == "vit_tiny_patch16_224" and isinstance(error.value.__cause__, LocalEntryNotFoundError)
    assert "https://huggingface.co cannot be reached" in str(error.value)  # the network, not the offline switch

    monkeypatch.setattr("sys.argv", ["export.py", "timm:vit_tiny_patch16_224", "--out", str(tmp_path / "t.onnx")])
    with pytest.raises(SystemExit) as stop:
        cli()
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 1 and len(err.splitlines()) == 1
    assert err.startswith("error: could not get timm's pretrained weights for 'vit_tiny_patch16_224' (")
    assert err.endswith("export the file: scripts/export.py /path/to/model.safetensors --model vit_tiny_patch16_224")

    argv = ["export.py", "timm:vit_tiny_patch16_224.nosuchtag", "--model", "vit_tiny_patch16_224"]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit):
        cli()
    assert capsys.readouterr().err.strip() == "error: Invalid pretrained tag (nosuchtag) for vit_tiny_patch16_224."


TINY = dict(depth=2, embed_dim=64, num_heads=2, num_classes=5)


@pytest.mark.parametrize(
    "name, patch, sizes",
    [
        ("eva02_tiny_patch14_224", 14, (56, 84)),  # rotary positions and a learned table
        ("vit_7b_patch16_dinov3", 16, (64, 96)),  # rotary positions, registers
        ("naflexvit_base_patch16_gap", 16, (64, 96)),  # its own 16x16 table, resampled to each grid
    ],
)
def test_each_dynamic_family_exports_once_and_gives_our_logits_at_two_sizes(tmp_path, name, patch, sizes):
    torch.manual_seed(0)
    model = create_model(name, img_size=sizes[0], **TINY).eval()
    onnx_model = OnnxClassifier(export_onnx(model, tmp_path / f"{name}.onnx"))
    assert onnx_model.spec.dynamic and onnx_model.spec.multiple == (patch, patch)
    for batch, size in zip((1, 3), sizes, strict=True):
        assert max_abs_diff(model, onnx_model, torch.randn(batch, 3, size, size)) < 1e-4, size
    assert max_abs_diff(model, onnx_model, torch.randn(2, 3, sizes[0], sizes[1])) < 1e-4  # not square


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter moved off its init: SAM's positions start at zero and relpos's LayerScale at 1e-6,
    which would leave the resampled tables out of the logits."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("samvit_base_patch16_224", {"window_size": 4}),  # 4x4 windows: the 6x6 grid of 96 px is padded to 8x8
        ("vit_relpos_base_patch16_224", {}),  # an MLP over patch offsets, a bias per pair of patches
        ("vit_srelpos_small_patch16_224", {"rel_pos_type": "mlp_swin"}),  # one shared bias, Swin-V2's offsets
    ],
)
def test_sam_and_relpos_export_once_and_give_the_dynamic_models_logits_at_two_sizes(tmp_path, name, kwargs):
    """Windows and relative positions are laid on the input's grid in the graph: one file, built at 64 px,
    gives at 64, 96 and 64x112 px the logits of the same weights built with dynamic_img_size=True (SAM's
    tables and positions resampled, relpos's offsets through its MLP), 1.1e-6 apart at most here."""
    torch.manual_seed(0)
    model = _perturbed(create_model(name, img_size=64, **TINY, **kwargs))
    onnx_model = OnnxClassifier(export_onnx(model, tmp_path / f"{name}.onnx"))
    assert onnx_model.spec.dynamic and onnx_model.spec.multiple == (16, 16)
    reference = create_model(name, img_size=64, **TINY, **kwargs, dynamic_img_size=True).eval()
    reference.load_state_dict(model.state_dict())
    for batch, size in ((1, (64, 64)), (3, (96, 96)), (2, (64, 112))):
        images = torch.randn(batch, 3, *size)
        with torch.no_grad():
            expected = reference(images)
        torch.testing.assert_close(torch.from_numpy(onnx_model(images)), expected, atol=1e-4, rtol=0)
        assert expected.abs().max() > 0.1, size  # real numbers, not LayerScale's zeros


def test_a_relative_position_bias_table_exports_with_its_own_grid_only(tmp_path):
    """rel_pos_type="bias" (no timm name) learns one bias per offset of the built grid: a dynamic export
    is refused before tracing, a static one gives our logits."""
    model = _perturbed(create_model("vit_relpos_base_patch16_224", img_size=32, rel_pos_type="bias", **TINY))
    with pytest.raises(ValueError, match=r"bias table .* holds its 2x2 patch grid's offsets only: export it with"):
        export_onnx(model, tmp_path / "dynamic.onnx")
    with pytest.raises(ValueError, match="rel_pos_type='bias' is a table of the built grid's offsets"):
        create_model("vit_relpos_base_patch16_224", rel_pos_type="bias", dynamic_img_size=True)
    onnx_model = OnnxClassifier(export_onnx(model, tmp_path / "static.onnx", dynamic=False))
    assert max_abs_diff(model, onnx_model, torch.randn(3, 3, 32, 32)) < 1e-4
    with pytest.raises(ValueError, match="fixed image size 32x32"):
        onnx_model(torch.randn(1, 3, 48, 48))
    assert not (tmp_path / "dynamic.onnx").exists()


NAFLEX = dict(TINY, img_size=64)  # 4x4 patches of 16 at the export size; the positions' own 16x16 table


@pytest.fixture(scope="module")
def naflex_sequences(tmp_path_factory):
    """naflexvit_base_patch16_gap's patch-sequence form, exported by the script from a timm-format file,
    its sequences 24 patches long for OnnxClassifier: (model, path, the script's differences)."""
    torch.manual_seed(0)
    model = _perturbed(create_model("naflexvit_base_patch16_gap", **NAFLEX))
    folder = tmp_path_factory.mktemp("naflex")
    torch.save(model.state_dict(), folder / "w.pth")
    model_args = ["--model", "naflexvit_base_patch16_gap", "--model_kwargs", json.dumps(NAFLEX)]
    diffs = export_main([str(folder / "w.pth"), *model_args, "--out", str(folder / "n.onnx"), "--input", "patches",
                         "--max_patches", "24"])  # fmt: skip
    return model, folder / "n.onnx", diffs


def test_one_patch_sequence_file_takes_any_length_and_aspect_ratio_with_padding(naflex_sequences):
    """Sequences of 20 and 40 patches, images of 5 aspect ratios (3x5, 4x4, 2x6, 6x3, 1x1 patches), the
    padding filled with noise that must not matter: the file gives our logits, 7e-7 apart at most here."""
    import onnxruntime as ort

    model, path, diffs = naflex_sequences
    assert list(diffs) == [64, 96] and max(diffs.values()) < 1e-4  # the script's own check
    graph = onnx.load(str(path)).graph
    names = [i.name for i in graph.input]
    assert names == ["patches", "patch_coord", "patch_valid"]
    assert all(d.dim_param for i in graph.input for d in i.type.tensor_type.shape.dim[:2])  # batch, length free
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for sizes, length in (([(48, 80), (64, 64)], 20), ([(32, 96), (96, 48), (16, 16)], 40)):
        batch = pack([torch.randn(3, h, w) for h, w in sizes], length=length)
        padding = ~batch["patch_valid"]
        assert padding.any(dim=1).all()  # every image has padding after it
        batch["patches"][padding] = torch.randn(int(padding.sum()), 768)
        (logits,) = session.run(None, {n: batch[n].numpy() for n in names})
        with torch.no_grad():
            expected = model(batch)
        torch.testing.assert_close(torch.from_numpy(logits), expected, atol=1e-4, rtol=0)
        assert expected.abs().max() > 0.1


def test_onnx_classifier_packs_images_into_the_files_sequences_and_says_what_does_not_fit(
    naflex_sequences, vit_onnx, tmp_path
):
    """The metadata says the input is patches of 16x16 in sequences of 24: OnnxClassifier packs a 64x64
    batch (16 patches, 8 of padding) and gives the image model's logits; a 96x96 image (36 patches) is
    refused naming vit.max_patches; a file with these inputs but without the metadata, naming vit.input."""
    model, path, _ = naflex_sequences
    onnx_model = OnnxClassifier(path)
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert {k: props[k] for k in ("vit.input", "vit.patch_size", "vit.max_patches")} == {
        "vit.input": "patches", "vit.patch_size": "16,16", "vit.max_patches": "24",
    }  # fmt: skip
    images = torch.randn(3, 3, 64, 64)
    assert max_abs_diff(model, onnx_model, images) < 1e-4
    with pytest.raises(ValueError, match=r"36 patches of 16x16, more than .* \(vit.max_patches = 24\)"):
        onnx_model(torch.randn(1, 3, 96, 96))
    with pytest.raises(ValueError, match="not patch sequences"):
        vit_onnx[1](pack([images[0]]))  # an image file
    bare = onnx.load(str(path))
    del bare.metadata_props[:]
    onnx.save(bare, str(tmp_path / "bare.onnx"))
    with pytest.raises(ValueError, match=r"patches, patch_coord, patch_valid, and its metadata has no vit\.input="):
        OnnxClassifier(tmp_path / "bare.onnx")
    with pytest.raises(ValueError, match="inputs='patches' exports a NaFlexViT's patch-sequence form"):
        export_onnx(create_model("vit_nano_patch4_16"), tmp_path / "x.onnx", inputs="patches")


def _default_opset(path) -> int:
    return next(o.version for o in onnx.load(str(path)).opset_import if o.domain == "")


def test_an_opset_the_graph_does_not_convert_to_is_refused_before_writing_naming_those_it_does(
    tmp_path, monkeypatch, capsys
):
    """torch's exporter builds the graph at opset 18 and, where its conversion fails (a LayerNorm has
    no opset below 17), keeps 18 and only logs why: the command said "opset 9" of an opset-18 file."""
    from vit.tools.export import cli

    weights = tmp_path / "w.pth"
    torch.save(create_model("vit_nano_patch4_16", num_classes=5).state_dict(), weights)
    out = tmp_path / "nano.onnx"
    monkeypatch.setattr("sys.argv", ["vit-export", str(weights), "--model", "vit_nano_patch4_16", "--static",
                                     "--opset", "9", "--out", str(out)])  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        cli()
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1, err
    assert err.startswith(
        "error: opset 9: torch's exporter cannot convert VisionTransformer's graph to it; this model exports at "
        "opsets 17 to "
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.pth"]  # nothing written

    diffs = export_main([str(weights), "--model", "vit_nano_patch4_16", "--static", "--opset", "17", "--out", str(out)])
    assert _default_opset(out) == 17 and max(diffs.values()) < 1e-4
    assert "opset 17" in capsys.readouterr().out


def test_above_the_exporters_own_conversions_the_file_has_the_opset_asked(tmp_path):
    """Above opset 25 torch's exporter keeps its graph at 18 (onnxscript's converter stops at 25); its graph
    at 18 converts with onnx's converter, and onnxruntime gives the same logits."""
    model = create_model("vit_nano_patch4_16", num_classes=5).eval()
    path = export_onnx(model, tmp_path / "nano.onnx", dynamic=False, opset=26)
    assert _default_opset(path) == 26
    assert max_abs_diff(model, OnnxClassifier(path), torch.randn(2, 3, 16, 16)) < 1e-4


@pytest.mark.parametrize(
    ("options", "code", "message"),
    [
        (["--max_patches", "0"], 2, "vit-export: error: argument --max_patches: must be a whole number of at least 1"),
        (["--atol", "-1"], 2, "vit-export: error: argument --atol: must be a finite number of at least 0, got -1"),
        (["--check_sizes", "16", "0"], 2, "vit-export: error: argument --check_sizes: must be a whole number of at"),
        (["--batch_size", "0"], 2, "vit-export: error: argument --batch_size: must be a whole number of at least 1"),
        (["--check_sizes", "18"], 1, "error: --check_sizes 18: image size 18x18 is not a positive multiple of the"),
        (["--static", "--check_sizes", "24"], 1, "error: --check_sizes 24: a --static export takes 16 px only"),
    ],
    ids=["max_patches", "atol", "check_sizes 0", "batch_size", "check_sizes 18", "static check_sizes"],
)
def test_values_an_option_does_not_take_are_refused_before_anything_is_written(
    tmp_path, monkeypatch, capsys, options, code, message
):
    from vit.tools.export import cli

    weights = tmp_path / "w.pth"
    torch.save(create_model("vit_nano_patch4_16", num_classes=5).state_dict(), weights)
    argv = [str(weights), "--model", "vit_nano_patch4_16", "--out", str(tmp_path / "nano.onnx"), *options]
    monkeypatch.setattr("sys.argv", ["vit-export", *argv])
    with pytest.raises(SystemExit) as stop:
        cli()
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == code and lines[-1].startswith(message), lines
    assert code == 2 or len(lines) == 1  # argparse's usage, or our one line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.pth"]


def test_a_timm_format_backbone_exports_its_features_with_its_weights_preprocessing(tmp_path):
    """A timm-format file without a classifier (as DINOv3's releases): the export is the backbone
    (output `features`, the pooled embedding), and its metadata carries timm's pretrained config of
    the architecture's default tag, so a bare onnxruntime user can prepare images from it."""
    import onnx
    import onnxruntime as ort
    import timm
    from safetensors.torch import save_file

    backbone = timm.create_model("vit_tiny_patch16_224", num_classes=0, img_size=32).eval()
    save_file(backbone.state_dict(), tmp_path / "model.safetensors")
    args = [str(tmp_path / "model.safetensors"), "--model", "vit_tiny_patch16_224", "--model_kwargs",
            '{"img_size": 32}', "--check_sizes", "32"]  # fmt: skip
    assert max(export_main(args).values()) < 1e-4
    graph = onnx.load(tmp_path / "model.onnx")
    props = {p.key: p.value for p in graph.metadata_props}
    assert [o.name for o in graph.graph.output] == ["features"]
    assert (props["vit.mean"], props["vit.std"], props["vit.eval_crop_pct"]) == ("0.5,0.5,0.5", "0.5,0.5,0.5", "0.9")
    images = torch.randn(2, 3, 32, 32)
    (features,) = ort.InferenceSession(str(tmp_path / "model.onnx")).run(None, {"images": images.numpy()})
    np.testing.assert_allclose(features, backbone(images).detach().numpy(), atol=1e-4)
