"""The docs site cannot rot: it builds in strict mode, its generated reference covers the code, the messages its
root-cause table names are ones the code prints, and the code's citations of its pages point at what exists.

The examples on the pages run in test_examples.py.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.docs.markdown import blocks, chains

DOCS = ROOT / "docs"
SRC = ROOT / "src" / "multigpu"
PAGES = sorted(p for p in DOCS.rglob("*.md"))


def _generator():
    """docs/hooks/reference.py, the MkDocs hook that writes the reference pages (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e
def test_the_site_builds_in_strict_mode_with_no_warning(tmp_path):
    """`make docs`'s build: a broken link or anchor, a page missing from the nav, a nav entry without its page,
    a docstring mkdocstrings cannot read, all fail it."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-5000:]
    assert "WARNING" not in said, said[-5000:]
    for page in ("reference/cli", "reference/config", "reference/envvars", "reference/errors",
                 "reference/api/multigpu", "architecture"):
        assert (site / page / "index.html").is_file(), page
    gen = _generator()
    for module in gen.api_modules():  # every name of each public module's __all__ has its entry
        page = (site / "reference" / "api" / module / "index.html").read_text(encoding="utf-8")
        ids = set(re.findall(r'id="([^"]+)"', page))
        mod = importlib.import_module(module)
        names = [n for n in mod.__all__ if not inspect.ismodule(getattr(mod, n))]
        own = {path.rsplit(".", 1)[1]: path for path in gen._shadowed(module)}
        missing = [n for n in names if f"{module}.{n}" not in ids and own.get(n) not in ids]
        assert not missing, f"the API page of {module} lacks {missing}"


def _options(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _options(child)
        elif action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
            yield action


def test_the_generated_reference_covers_every_command_flag_key_and_variable():
    """Every command and every (dashed) flag of the parser, every key of every built-in workload's config with
    its docstring, every MULTIGPU_* variable and every error class have their place on the generated pages."""
    from multigpu import envvars, errors
    from multigpu.cli import build_parser, commands
    from multigpu.jobs.registry import BUILTIN, builtin

    gen = _generator()
    cli = gen.cli_page()
    for name in commands():
        assert f"## multigpu {name}\n" in cli, name
    for action in _options(build_parser()):
        shown = [n for n in action.option_strings if not (n.startswith("--") and "_" in n[2:])]
        for flag in shown or [action.metavar or action.dest]:
            assert f"`{flag}`" in cli, f"{flag} ({action.dest}) is missing from the command-line reference"

    config = gen.config_page()
    for name in BUILTIN:
        cls = builtin(name).config
        section = config.split(f"\n## {name}\n")[1].split("\n## ")[0]
        assert f"`{cls.__module__}.{cls.__qualname__}`" in section
        docs = gen.field_docs(cls)
        for field in dataclasses.fields(cls):
            if field.init and not field.name.startswith("_"):
                row = next((ln for ln in section.splitlines() if ln.startswith(f"| `{field.name}` |")), None)
                assert row is not None, f"{name}: {field.name} has no row"
                if docs.get(field.name):
                    assert " ".join(gen.md(docs[field.name]).split())[:40] in row, (field.name, row)

    variables = gen.envvars_page()
    for name in envvars.__all__:
        assert f"| `{getattr(envvars, name)}` |" in variables, name
    errors_page = gen.errors_page()
    for name in errors.__all__:
        assert f"| `{name}` |" in errors_page, name


def test_the_errors_page_draws_the_whole_hierarchy():
    """The errors page shows the tree ``multigpu.errors`` draws, and it holds every error class, those that are
    not ``MultigpuError`` too (#47: the tree left out the classes defined outside errors.py)."""
    from multigpu import errors

    page = _generator().errors_page()
    tree = page.split("```text\n", 1)[1].split("```", 1)[0]
    assert set(re.findall(r"^\s*[*x+] (\w+)", tree, flags=re.M)) == set(errors.__all__)
    for name in ("CorruptCheckpointError", "NodeLostError", "StallError", "RankFailedError"):
        assert f"| `{name}` |" in page, name


def test_field_docs_reads_a_dataclass_fields_docstrings_through_its_bases():
    gen = _generator()

    @dataclasses.dataclass(frozen=True)
    class Base:
        a: int = 1
        """The a."""
        b: int = 2

    @dataclasses.dataclass(frozen=True)
    class Child(Base):
        c: str = "x"
        """The c,
        on two lines."""

    assert gen.field_docs(Child) == {"a": "The a.", "c": "The c,\non two lines."}


def _code_strings() -> list[str]:
    """Every string the package can print: its literals and the literal parts of its f-strings, docstrings
    left out (a message only a docstring holds is not one the code prints)."""
    found = []
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        found += [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                  and isinstance(node.value, str) and id(node) not in docstrings]
    return found


def _fragments(message: str) -> list[str]:
    """A documented message's fixed parts: split where it says ``<...>`` (the parts that vary), trimmed of
    punctuation and quotes, short ones dropped."""
    message = message.removeprefix("error: ")
    parts = [p.strip(" '\".,:;?!()") for p in re.split(r"<[^<>]*>", message)]
    return [p for p in parts if len(p) >= 4]


def test_every_message_in_the_root_cause_table_is_one_the_code_prints():
    """The troubleshooting page's root-cause table (its first table): its first column quotes the message as the user sees it; each of its fixed parts is
    in a string of the code, so a message changed in the code fails here until its row is."""
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    header = "| message | cause | what to do |"
    assert header in text
    table = text[text.index(header):].splitlines()[2:]
    rows = table[:next((i for i, ln in enumerate(table) if not ln.startswith("|")), len(table))]
    assert rows, "the table has no row"
    strings = _code_strings()
    for row in rows:
        first = re.match(r"\|\s*`([^`]+)`\s*\|", row)
        assert first, f"a row's message is one code span: {row}"
        for part in _fragments(first.group(1)):
            assert any(part in s for s in strings), f"{part!r} of {first.group(1)!r} is printed by no code"


def test_fragments_split_a_message_at_what_varies():
    assert _fragments("error: unknown config key '<key>'. Did you mean '<key>'? Valid keys here: <keys>") == [
        "unknown config key", "Did you mean", "Valid keys here"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_a_block_that_does_not_run_says_why_on_the_page(page):
    """``<!-- no-run: REASON -->`` is invisible: REASON must also be in the page's text near the block (the ten
    lines before its fence or the five after it), where a reader sees it; every marker is one the runner knows
    (else ValueError), and `continue` follows a runnable block."""
    lines = page.read_text(encoding="utf-8").splitlines()
    chains(page)  # raises on an unknown marker or a misplaced `continue`
    for block in blocks(page):
        for reason in block.markers.get("no-run", []):
            assert reason.strip(), f"{block.where}: no-run without a reason"
            start = block.line - 1
            end = start + block.code.count("\n") + 1
            near = [ln for ln in lines[max(0, start - 10):start] + lines[end + 1:end + 6] if "<!--" not in ln]
            assert reason.lower() in " ".join(" ".join(near).replace("`", "").split()).lower(), (
                f"{block.where}: the page does not say {reason!r} near the block (the no-run marker is invisible)")


def test_blocks_follow_commonmark_fences_and_markers_before_them(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "text", "<!-- file: mypkg/a.py -->", "```python", "x = 1", "```", "",
        "<!-- continue -->", "<!-- expect: 1 -->", "<!-- expect: 2 -->", "```bash", "echo 1 2", "```",
        "````markdown", "<!-- no-run: inside -->", "```bash", "not a block", "```", "````",
        "- a list", "", "    ```python", "    print(3)", "    ```", "",
    ]))
    found = blocks(page)
    assert [(b.lang, b.line) for b in found] == [("python", 3), ("bash", 10), ("markdown", 13), ("python", 21)]
    assert found[0].markers == {"file": ["mypkg/a.py"]} and found[1].markers == {"continue": [""], "expect": ["1", "2"]}
    assert found[2].code.count("```") == 2 and found[3].code == "print(3)\n"
    assert [[b.line for b in chain] for chain in chains(page)] == [[3, 10], [21]]
    page.write_text("<!-- no_run: typo -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="unknown marker 'no_run'"):
        blocks(page)


def test_the_code_cites_pages_of_the_site_not_files_outside_the_repository():
    """A module that explains itself by a page cites ``docs/<page>.md, "<heading>"``: the page and the heading
    exist. The project's design notes, kept outside the repository, are cited nowhere."""
    cited = 0
    for path in [*SRC.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\b(DESIGN|STYLE)\.md\b", text), f"{path.relative_to(ROOT)} cites a file outside"
        for page, heading in re.findall(r"docs/([\w/.-]+\.md)(?:, \"([^\"]+)\")?", text):
            target = DOCS / page
            assert target.is_file(), f"{path.relative_to(ROOT)} cites docs/{page}, which does not exist"
            if heading:
                assert re.search(rf"^#+ {re.escape(heading)}$", target.read_text(encoding="utf-8"), re.M), (
                    f"{path.relative_to(ROOT)} cites the section {heading!r} of docs/{page}, which has none")
            cited += 1
    assert cited >= 2


def test_the_message_list_finds_what_the_package_raises_at_users():
    """``python docs/hooks/reference.py --messages``, the starting point of the root-cause table: the messages
    of our error classes (an f-string's parts that vary as ``<expr>``), not of Python's own."""
    found = _generator().messages()
    assert ("ConfigError", "--world-size and --device-memory are the dry run's; add --dry-run, or use "
            "--nproc-per-node/--nnodes for a real job") in [(name, text) for name, text, _ in found]
    assert any(name == "ConfigError" and "<args.resume>" in text and where.startswith("multigpu/jobs/command.py:")
               for name, text, where in found)
    assert {name for name, _, _ in found} >= {"ConfigError", "DeviceError", "UsageError"}
    assert "AttributeError" not in {name for name, _, _ in found}
