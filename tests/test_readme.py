"""README's and the docs pages' Python examples run as written: each ```python block by itself, as a
reader who copies one would run it, except a block whose first line is `# continues the block above`,
which runs after the blocks it continues, in their namespace. Their links to files in the repository
lead somewhere."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


CONTINUES = "# continues the block above"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def examples(text: str) -> list[list[str]]:
    """The page's blocks as a reader runs them: each block starts an example of its own, unless its
    first line is CONTINUES, when it joins the example above."""
    runs: list[list[str]] = []
    for block in python_blocks(text):
        if block.startswith(CONTINUES + "\n"):
            assert runs, f"the first block says {CONTINUES!r}: there is none above"
            runs[-1].append(block)
        else:
            runs.append([block])
    return runs


def run_example(blocks: list[str], name: str) -> dict:
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, name, "exec"), namespace)
    return namespace


def test_a_block_runs_by_itself_unless_it_says_it_continues_the_block_above():
    page = "```python\nx = 2\n```\n\n```python\n{}y = x + 1\n```\n"
    with pytest.raises(NameError, match="'x' is not defined"):
        for blocks in examples(page.format("")):
            run_example(blocks, "page.md")
    (blocks,) = examples(page.format(CONTINUES + "\n"))
    assert run_example(blocks, "page.md")["y"] == 3


def test_every_python_block_of_the_readme_runs():
    runs = examples((ROOT / "README.md").read_text())
    assert runs, "README has no ```python block"
    namespace = {}
    for blocks in runs:
        namespace = run_example(blocks, "README.md")
    attns, logits = namespace["attns"], namespace["logits"]
    assert logits.shape == (2, 10) and len(attns) == 12 and attns[0].shape == (2, 6, 197, 197)


@pytest.mark.parametrize("page", [p for p in PAGES[1:] if python_blocks(p.read_text())], ids=lambda p: p.name)
def test_every_python_block_of_a_docs_page_runs_by_itself_or_after_the_blocks_it_continues(page):
    for blocks in examples(page.read_text()):
        run_example(blocks, str(page))


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
    # "today's configs at 10 min": the 10-minute cells of the newest machine in the every-machine table
    every = (ROOT / "benchmarks" / "budget.md").read_text().split("## Every machine")[1].split("## ")[0]
    cells = [line.strip("| ").split(" | ") for line in every.splitlines() if line.startswith("| ") and "%" in line]
    newest = max(int(c[0]) for c in cells)
    ten = {c[1]: f"{float(c[2].rstrip('%')):.1f}%" for c in cells if int(c[0]) == newest}
    today = row.split("today's configs at 10 min")[1]
    for model, words in (("ViT", "ViT"), ("ViT + conv stem (hybrid)", "hybrid (CCT's tokenizer)"),
                         ("ResNet-20", "ResNet-20")):  # fmt: skip
        assert f"{words} {ten[model]}" in today, (model, ten[model], today)


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
