"""README's and the docs pages' Python examples run as written (each page's ```python blocks, in
order, in one namespace), and their links to files in the repository lead somewhere."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


def test_every_python_block_of_the_readme_runs():
    blocks = python_blocks(ROOT / "README.md")
    assert blocks, "README has no ```python block"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    attns, logits = namespace["attns"], namespace["logits"]
    assert logits.shape == (2, 10) and len(attns) == 12 and attns[0].shape == (2, 6, 197, 197)


@pytest.mark.parametrize("page", [p for p in PAGES[1:] if python_blocks(p)], ids=lambda p: p.name)
def test_every_python_block_of_a_docs_page_runs(page):
    namespace: dict = {}
    for block in python_blocks(page):
        exec(compile(block, str(page), "exec"), namespace)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_to_repository_files_lead_to_files(page):
    targets = re.findall(r"\]\((?!https?:)([^)#]+)(?:#[^)]*)?\)", page.read_text())
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


def test_the_readme_quotes_the_budget_reports_headline_table():
    """README's CIFAR-10 row is budget.md's first table to one decimal, so a regenerated report with
    new numbers fails here until README follows."""
    report = (ROOT / "benchmarks" / "budget.md").read_text().split("## ")[0]
    rows = [line.strip("| ").split(" | ") for line in report.splitlines() if line.startswith("| ")]
    table = {cells[0]: cells[2:] for cells in rows if cells[-1].endswith("%") or cells[-1] == "-"}
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if "budget.md" in line)
    for model, words in (("ViT", "ViT"), ("ResNet-20", "ResNet-20")):
        quoted = " / ".join(f"{float(c.rstrip('%')):.1f}" for c in table[model]) + "%"
        assert f"{words} {quoted}" in row, (model, quoted, row)
    hybrid = table["ViT + conv stem (hybrid)"]
    assert f"conv-stem hybrid {float(hybrid[1].rstrip('%')):.1f}% at 30 min" in row


def test_the_readme_counts_the_timm_names_that_build():
    """README's "N of timm's M ViT-family names" is what `import vit` registers of timm's modules."""
    import timm

    import vit

    modules = ("vision_transformer", "deit", "vision_transformer_hybrid", "eva", "vision_transformer_relpos",
               "vision_transformer_sam", "naflexvit")  # fmt: skip
    names = {name for module in modules for name in timm.list_models(module=module)}
    built = names & set(vit.list_models())
    text = (ROOT / "README.md").read_text()
    claims = re.findall(r"(\d+) of timm's (\d+) ViT-family names", text)
    assert len(claims) == 2 and set(claims) == {(str(len(built)), str(len(names)))}, claims
