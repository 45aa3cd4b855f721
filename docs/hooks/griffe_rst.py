"""A griffe extension (mkdocstrings' ``extensions`` option): the package's docstrings are written with
reStructuredText inline markup (``:func:`multigpu.init```, ````x````, a paragraph ending in ``::``), which
mkdocstrings would show as it is; each docstring is turned into Markdown as griffe reads it, by the same rule as
the generated reference pages (``md`` in reference.py beside this file)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import griffe

_spec = importlib.util.spec_from_file_location("docs_hooks_reference", Path(__file__).with_name("reference.py"))
_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_reference)


class RstToMarkdown(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _reference.md(obj.docstring.value)
