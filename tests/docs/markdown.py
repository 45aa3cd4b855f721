"""The fenced code blocks of a Markdown page, with the markers before them, and how to run them as a user would.

Used by the docs site's tests (every page's examples run) and by the README's (its blocks picked by content).
The convention, for whoever writes a page (docs/contributing/docs.md says it to them):

* a ```` ```bash ```` or ```` ```python ```` block runs, in a fresh temporary folder, as a user would type it
  there: bash blocks with ``bash -e``, Python blocks with ``python -c`` (so the folder is on ``sys.path``), the
  ``multigpu`` and ``python`` of this environment first on ``PATH``; the folder holds ``examples/`` (a link to the
  repository's), as a clone does. Other languages (``text``, ``yaml``, ``console``) do not run;
* HTML comments on the lines right before a block's fence are its markers:

  ``<!-- no-run: REASON -->``   the block does not run; REASON (e.g. "needs a GPU", "needs a cluster") must also
  be said in the page's own text near the block, where a reader sees it;
  ``<!-- continue -->``         the block runs after the previous runnable block of the page, in its folder
  (a setup shared by several blocks); blocks run in the page's order;
  ``<!-- file: PATH -->``       the block is not run but written to PATH in the folder (a module a later
  command imports, a YAML config), any language;
  ``<!-- expect: TEXT -->``     TEXT must appear in what the block prints (stdout and stderr), repeatable;
  ``<!-- timeout: SECONDS -->`` the block's deadline (default 240 s).

A block and the ``continue`` blocks after it are one *chain*: one test each, so chains of all pages spread over
the pytest workers.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

RUNNABLE = ("bash", "python")
DEFAULT_TIMEOUT = 240.0
MARKER = re.compile(r"^\s*<!--\s*([\w-]+)\s*(?::\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
KNOWN = ("no-run", "continue", "file", "expect", "timeout")


@dataclasses.dataclass
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    """The line of its opening fence (1-based)."""
    lang: str
    code: str
    markers: dict[str, list[str]]
    """Its markers by name, each with the values given (``continue`` has ``[""]``)."""

    @property
    def where(self) -> str:
        return f"{self.page.name}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUNNABLE and "no-run" not in self.markers and "file" not in self.markers

    @property
    def timeout(self) -> float:
        return float(self.markers.get("timeout", [DEFAULT_TIMEOUT])[-1])


def blocks(path: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of the page, in order, with the markers on the lines right before its fence.

    Fences follow CommonMark: ```` ``` ```` or ``~~~``, three or more; a block ends at a fence of the same
    character at least as long (so a block may show another block inside a longer fence); indented fences
    (inside a list or an admonition) lose that indentation from their lines.
    Raises ValueError for a marker this convention does not know (a typo would silently skip a check).
    """
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = len(match["indent"]), match["fence"], match["info"].strip()
        markers: dict[str, list[str]] = {}
        j = i - 1
        while j >= 0 and (marker := MARKER.match(lines[j])):
            name, value = marker.group(1), marker.group(2) or ""
            if name not in KNOWN:
                raise ValueError(f"{path.name}:{j + 1}: unknown marker {name!r}; valid: {', '.join(KNOWN)}")
            markers.setdefault(name, []).insert(0, value)
            j -= 1
        body = []
        i += 1
        while i < len(lines):
            end = re.match(r"^\s*(`{3,}|~{3,})\s*$", lines[i])
            if end and end.group(1)[0] == fence[0] and len(end.group(1)) >= len(fence):
                break
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i].lstrip())
            i += 1
        lang = info.split()[0].lstrip("{.").rstrip("}") if info else ""
        found.append(Block(path, i - len(body), lang, "\n".join(body) + "\n", markers))
        i += 1
    return found


def chains(path: Path) -> list[list[Block]]:
    """The page's blocks that run or write files, grouped: a block, then the ``continue`` blocks after it."""
    out: list[list[Block]] = []
    for block in blocks(path):
        if not (block.runs or "file" in block.markers):
            continue
        if "continue" in block.markers:
            if not out:
                raise ValueError(f"{block.where}: `continue` on the page's first runnable block")
            out[-1].append(block)
        else:
            out.append([block])
    return out


def _env(folder: Path) -> dict[str, str]:
    """The environment of a user who installed multigpu here: this interpreter's bin first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("PYTHONPATH", None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MPLBACKEND="Agg", PWD=str(folder))
    return env


def run_chain(chain: list[Block], folder: Path, links: dict[str, Path]) -> None:
    """Run a chain's blocks in order in ``folder`` (after linking ``links`` there); AssertionError naming the
    block, its code and its output when one fails or misses an ``expect``."""
    for name, target in links.items():
        if not (folder / name).exists():
            (folder / name).symlink_to(target)
    for block in chain:
        if "file" in block.markers:
            target = folder / block.markers["file"][-1]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code, encoding="utf-8")
            continue
        argv = (["bash", "-e", "-o", "pipefail", "-c", block.code] if block.lang == "bash"
                else [sys.executable, "-c", block.code])
        try:
            proc = subprocess.run(argv, cwd=folder, env=_env(folder), capture_output=True, text=True,
                                  timeout=block.timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{block.where}: still running after {block.timeout:.0f} s (a `timeout:` marker "
                                 f"sets another deadline):\n{block.code}\n{_tail(exc.stdout)}{_tail(exc.stderr)}"
                                 ) from None
        said = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise AssertionError(f"{block.where}: exit code {proc.returncode} from\n{block.code}\n--- output:\n"
                                 f"{_tail(said)}")
        for text in block.markers.get("expect", []):
            if text not in said:
                raise AssertionError(f"{block.where}: {text!r} not in the output of\n{block.code}\n--- output:\n"
                                     f"{_tail(said)}")


def _tail(text: str | bytes | None, size: int = 4000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-size:]


# ----------------------------------------------------------------------------- picking blocks by content
def python_block(path: Path, containing: str) -> str:
    """The one ```` ```python ```` block of the page that contains ``containing``."""
    found = [b.code for b in blocks(path) if b.lang == "python" and containing in b.code]
    assert len(found) == 1, f"{len(found)} python blocks of {path.name} contain {containing!r}"
    return found[0]


def bash_line(path: Path, starting: str) -> list[str]:
    """The first command of the page's ```` ```bash ```` blocks that starts with ``starting`` (joined across its
    backslash continuations, its comment dropped), as argv after the program's name."""
    for block in blocks(path):
        if block.lang != "bash":
            continue
        for line in block.code.replace("\\\n", " ").splitlines():
            if line.strip().startswith(starting):
                return shlex.split(line.split("#")[0].strip())[1:]
    raise AssertionError(f"no bash command of {path.name} starts with {starting!r}")
