"""Which source a GPU call ran: the commit, and whether the files differ from it (no torch: a fraction of a second).

    python3 benchmarks/gpu/source.py --write .whl/source.json   # before the call, where git is (fetch_wheels.sh)
    python3 benchmarks/gpu/source.py [--from .whl/source.json]   # in the call: one JSON line (run_all.sh's setup)

In a git checkout: HEAD's commit and the tracked files that differ from it (``git status``). Without one (the device
machine's copy of the working tree may carry no ``.git``): the file ``--write`` left before the call, which names
the commit and the git blob of each of its tracked files; each file is hashed again here as git hashes a blob, so a
copy that is not that commit says which files differ. Neither: ``unknown``, with what to do, never a guess.

The line's fields: ``commit`` (40 hex digits or null), ``changed`` (paths that differ from it, at most 20),
``changed_count``, ``how`` (``git``, ``source.json written <time>``, or why unknown) and ``text`` (``abc1234``,
``abc1234 + 2 changed files``, or ``unknown: ...``), which every step's entry and record carry.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / ".whl" / "source.json"
SHOWN = 20


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def blob_id(path: Path) -> str:
    """The id git gives the file's bytes as a blob (``git hash-object``)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _result(commit: str | None, changed: list[str], how: str) -> dict:
    if commit is None:
        text = f"unknown: {how}"
    else:
        text = commit[:12] + (f" + {len(changed)} changed file{'s' if len(changed) != 1 else ''}" if changed else "")
    return {"commit": commit, "changed": changed[:SHOWN], "changed_count": len(changed), "how": how, "text": text}


def from_git() -> dict | None:
    """HEAD and the tracked files that differ from it; None outside a git checkout."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return None
    status = _git("status", "--porcelain", "--untracked-files=no") or ""
    changed = sorted(line[3:].strip() for line in status.splitlines() if line.strip())
    return _result(head.strip(), changed, "git")


def written() -> dict:
    """What ``--write`` records: HEAD and the blob of every tracked file at HEAD."""
    head = _git("rev-parse", "HEAD")
    tree = _git("ls-tree", "-r", "--full-tree", "HEAD")
    if head is None or tree is None:
        raise SystemExit("error: source.py --write needs a git checkout (git rev-parse HEAD failed)")
    files = {}
    for line in tree.splitlines():
        meta, path = line.split("\t", 1)
        mode, kind, blob = meta.split()
        if kind == "blob" and mode != "120000":  # symlinks: their target, not a file's bytes
            files[path] = blob
    return {"commit": head.strip(), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}


def from_file(path: Path) -> dict:
    """The commit a ``--write`` file names, and the files of this copy that differ from it."""
    try:
        record = json.loads(path.read_text())
        files = record["files"]
    except (OSError, ValueError, KeyError) as exc:
        return _result(None, [], f"no .git here and {path} is unreadable ({type(exc).__name__}); run "
                                 "bash benchmarks/gpu/fetch_wheels.sh before the call and carry .whl")
    changed = []
    for name, blob in files.items():
        file = ROOT / name
        if not file.is_file() or blob_id(file) != blob:
            changed.append(name)
    return _result(record["commit"], sorted(changed), f"{path.name} written {record.get('written', '?')}")


def describe(source_file: Path = DEFAULT) -> dict:
    found = from_git()
    if found is not None:
        return found
    if source_file.exists():
        return from_file(source_file)
    return _result(None, [], f"no .git here and no {source_file.relative_to(ROOT) if source_file.is_relative_to(ROOT) else source_file}: "
                             "run bash benchmarks/gpu/fetch_wheels.sh before the call and carry .whl")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", metavar="PATH", help="record HEAD and its files' blobs here (needs git)")
    p.add_argument("--from", dest="source", default=str(DEFAULT), help="the file --write left (without .git)")
    args = p.parse_args()
    if args.write:
        out = Path(args.write)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(written()) + "\n")
        print(f"wrote {out}: commit {describe(out)['text']}")
        return 0
    print(json.dumps(describe(Path(args.source))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
