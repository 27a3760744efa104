"""Every mutation in ``tests/mutation_waits.py`` still names a statement of today's tree.

The mutation check itself is long (minutes per mutation) and runs by hand; a wait that was moved or
rewritten would otherwise leave its mutation stale until someone ran it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import mutation_waits as mw


@pytest.mark.parametrize("m", mw.MUTATIONS, ids=lambda m: m.name)
def test_mutation_applies_to_the_tree(tmp_path: Path, m: mw.Mutation) -> None:
    src = mw.ROOT / m.path
    dst = tmp_path / m.path
    dst.parent.mkdir(parents=True)
    shutil.copy2(src, dst)
    before, original = mw.apply(tmp_path, m)  # raises SystemExit if the statement is gone or ambiguous
    after = dst.read_text()
    assert before != after and f"# mutated: {m.statement}" in after
    assert src.read_text() == before, "the working tree was touched"
