"""README's Python examples run as written (each ```python block, in order, in one namespace)."""

from __future__ import annotations

import re

from tests.conftest import ROOT


def test_every_python_block_of_the_readme_runs():
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    assert blocks, "README has no ```python block"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    attns, logits = namespace["attns"], namespace["logits"]
    assert logits.shape == (2, 10) and len(attns) == 12 and attns[0].shape == (2, 6, 197, 197)
