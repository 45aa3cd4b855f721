"""The edits a migration page shows for a third-party file (tests/third_party), read from the page itself, so the
tests apply exactly what the page tells users to change.

A page marks each edit block with ``<!-- NAME edits -->`` on the line before a ```` ```diff ```` fence; in it, each
``@@ ...`` line starts a hunk, ``-`` lines are the file's lines as they are, ``+`` lines what they become, and
lines starting with a space are kept (context that pins where the hunk applies).
"""

from __future__ import annotations

from pathlib import Path


def edits(page: Path, name: str) -> list[tuple[str, str]]:
    """The (was, now) pairs of the page's ``<!-- NAME edits -->`` diff block."""
    text = page.read_text(encoding="utf-8")
    marker = f"<!-- {name} edits -->"
    assert marker in text, f"{page.name} has no {marker}"
    block = text.split(marker, 1)[1].split("```diff", 1)[1].split("```", 1)[0]
    hunks: list[tuple[str, str]] = []
    was: list[str] = []
    now: list[str] = []
    for line in block.splitlines():
        if line.startswith("@@"):
            if was or now:
                hunks.append(("\n".join(was), "\n".join(now)))
            was, now = [], []
        elif line.startswith("-"):
            was.append(line[1:])
        elif line.startswith("+"):
            now.append(line[1:])
        elif line.startswith(" "):
            was.append(line[1:])
            now.append(line[1:])
    if was or now:
        hunks.append(("\n".join(was), "\n".join(now)))
    assert hunks, f"{page.name}'s {marker} block shows no edits"
    return hunks


def apply(path: Path, page: Path, name: str) -> None:
    """Make the page's ``NAME`` edits to the file at ``path`` (each must match the file exactly once)."""
    text = path.read_text(encoding="utf-8")
    for was, now in edits(page, name):
        assert text.count(was) == 1, f"{page.name}'s {name} edit does not match {path.name} exactly once:\n{was}"
        text = text.replace(was, now)
    path.write_text(text, encoding="utf-8")
