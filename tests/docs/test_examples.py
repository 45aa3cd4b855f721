"""Every example of the docs site runs as a user would run it (the convention: tests/docs/markdown.py, told to
writers in docs/contributing/docs.md): one test per chain of blocks, so the pages' examples spread over the
pytest workers."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT
from tests.docs.markdown import chains, run_chain

DOCS = ROOT / "docs"
LINKS = {"examples": ROOT / "examples"}
"""What a clone holds beside the user's own files: the pages' commands run examples/ as written."""

CHAINS = [
    pytest.param(chain, id=f"{chain[0].page.relative_to(DOCS)}:{chain[0].line}",
                 marks=pytest.mark.timeout(60 + sum(block.timeout for block in chain)))
    for page in sorted(DOCS.rglob("*.md")) for chain in chains(page)
]


@pytest.mark.e2e
@pytest.mark.parametrize("chain", CHAINS)
def test_the_example_runs_as_written(chain, tmp_path):
    run_chain(chain, tmp_path, LINKS)
