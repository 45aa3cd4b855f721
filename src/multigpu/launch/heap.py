"""The heap policy of the CPU ranks the launcher starts (Linux, glibc): large blocks kept for reuse.

glibc serves every block above its mmap threshold (128 KiB, raised as blocks are freed, but never above 32 MiB)
with a fresh ``mmap`` and unmaps it when freed; free memory at the top of its heap above the trim threshold goes
back to the kernel too. A CPU rank's large tensors (a conv layer's activations over a batch of windows: 8 x 16 x
256 x 256 floats are 32 MiB and a little; oneDNN's scratch beside them) are allocated and freed on every step, so
each step the kernel maps, zeroes and unmaps them again one 4 KiB page fault at a time: measured here, a small
conv net spent 2/3 of its time in those faults (667k minor faults for 16 forward passes; 2.9 s, then 0.94 s with
this policy, the same bits, 14 MiB more peak memory).

So the launcher gives CPU ranks :data:`MMAP_THRESHOLD` and :data:`TRIM_THRESHOLD` through glibc's own variables
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``): blocks up to 128 MiB come from the heap and are reused,
and at most 256 MiB of free heap is kept at its top. The cost is memory: glibc aligns torch's blocks (64 bytes) by
asking for a little more than each block, so a freed block is a few bytes short of the next request for the same
size until its neighbours are freed too, and the heap holds a block or two more than the rank uses: measured
here, a loop of 48 MiB tensors with small tensors kept between them levels off at 96 MiB (two blocks) more than
without the policy, and stays there (400 iterations); sliding-window inference +29 MiB of peak, the nano GPT's
training within 3%. What ``torch.backends.xeon.run_cpu`` does with jemalloc (which keeps every freed page),
bounded and without a preload.
A new interpreter's glibc reads the variables when it starts; a worker forked from the launcher's fork server
(whose glibc started without them) applies them with ``mallopt`` (:func:`apply`).

Left as it is: GPU ranks (their tensors live on the GPU) and so every rank of a hybrid job (``--allow-cpu-ranks``:
the environment is the node's), and a user's own choice: either variable set already,
``GLIBC_TUNABLES`` naming a ``glibc.malloc`` tunable, or another allocator preloaded (jemalloc, tcmalloc,
mimalloc). Not glibc (macOS, musl): nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import difflib
import os
import platform
import re
import subprocess
from collections.abc import Mapping

__all__ = ["MALLOC_ALIASES", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "USER_VARS", "VARS", "apply", "glibc_version",
           "ignored_settings", "malloc_tunables", "rank_env", "users_choice"]

MMAP_THRESHOLD = 128 << 20
"""Blocks up to this size come from the heap (glibc's default: 128 KiB, adapting up to 32 MiB)."""
TRIM_THRESHOLD = 256 << 20
"""Free memory at the top of the heap kept for reuse, at most (glibc's default: 128 KiB, twice the adapted
mmap threshold)."""
VARS = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}
"""glibc's variables for the two thresholds, and ``mallopt``'s parameter for each (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)."""

_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def glibc_version() -> str | None:
    """This machine's glibc version (Linux), None elsewhere (musl, macOS, Windows)."""
    name, version = platform.libc_ver()
    return version if platform.system() == "Linux" and name == "glibc" else None


def _glibc() -> bool:
    return glibc_version() is not None


USER_VARS = (*VARS, "GLIBC_TUNABLES", "LD_PRELOAD")
"""The variables where a user's own heap policy shows (:func:`users_choice` reads them)."""


def users_choice(inherited: Mapping[str, str]) -> str | None:
    """The heap policy the user chose in ``inherited`` (``NAME=value``), None when they chose none."""
    for name in VARS:
        if name in inherited:
            return f"{name}={inherited[name]}"
    if "glibc.malloc" in inherited.get("GLIBC_TUNABLES", ""):
        return f"GLIBC_TUNABLES={inherited['GLIBC_TUNABLES']}"
    preload = inherited.get("LD_PRELOAD", "")
    if any(name in preload.lower() for name in _OTHER_ALLOCATORS):
        return f"LD_PRELOAD={preload}"
    return None


def rank_env(inherited: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to a CPU rank's environment: both thresholds, unless the user chose a heap policy of
    their own (or this is not glibc): then none."""
    if not _glibc() or users_choice(inherited) is not None:
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def apply(env: Mapping[str, str]) -> dict[str, int]:
    """In a worker whose glibc started before ``env`` was its environment (forked): ``mallopt`` each threshold
    that ``env`` sets, as glibc would have read it at start. Returns what was applied (parameter name -> bytes)."""
    wanted = {name: env[name] for name in VARS if env.get(name, "").isdigit()}
    if not wanted or not _glibc():
        return {}
    applied = {}
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        for name, value in wanted.items():
            if libc.mallopt(ctypes.c_int(VARS[name]), ctypes.c_int(min(int(value), 2**31 - 1))) == 1:
                applied[name] = int(value)
    return applied


# ---------------------------------------------------------------------- heap settings glibc ignores (doctor)
MALLOC_ALIASES = {
    "MALLOC_ARENA_MAX": "glibc.malloc.arena_max", "MALLOC_ARENA_TEST": "glibc.malloc.arena_test",
    "MALLOC_CHECK_": "glibc.malloc.check", "MALLOC_MMAP_MAX_": "glibc.malloc.mmap_max",
    "MALLOC_MMAP_THRESHOLD_": "glibc.malloc.mmap_threshold", "MALLOC_PERTURB_": "glibc.malloc.perturb",
    "MALLOC_TOP_PAD_": "glibc.malloc.top_pad", "MALLOC_TRIM_THRESHOLD_": "glibc.malloc.trim_threshold",
}
"""glibc's environment variables for its malloc tunables (``elf/dl-tunables.list``: each tunable's ``env_alias``)."""

_MAX = 2**64 - 1
_KNOWN = {  # glibc 2.36's malloc tunables (``ld.so --list-tunables``) and their ranges, where the loader cannot say
    "glibc.malloc.arena_max": (1, _MAX), "glibc.malloc.arena_test": (1, _MAX), "glibc.malloc.check": (0, 3),
    "glibc.malloc.hugetlb": (0, _MAX), "glibc.malloc.mmap_max": (0, 2**31 - 1),
    "glibc.malloc.mmap_threshold": (0, _MAX), "glibc.malloc.mxfast": (0, _MAX), "glibc.malloc.perturb": (0, 255),
    "glibc.malloc.tcache_count": (0, _MAX), "glibc.malloc.tcache_max": (0, _MAX),
    "glibc.malloc.tcache_unsorted_limit": (0, _MAX), "glibc.malloc.top_pad": (0, _MAX),
    "glibc.malloc.trim_threshold": (0, _MAX),
}
_EXAMPLES = {"arena_max": 4, "arena_test": 8, "check": 3, "mmap_max": 65536, "mmap_threshold": MMAP_THRESHOLD,
             "perturb": 165, "top_pad": 131072, "trim_threshold": TRIM_THRESHOLD}
_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_LISTED = re.compile(r"^(glibc\.malloc\.\w+): (\S+) \(min: (\S+), max: (\S+)\)$")


def _loader() -> str | None:
    """This process's dynamic loader (glibc's ``ld-linux*.so``), as mapped into it."""
    with contextlib.suppress(OSError), open("/proc/self/maps") as fh:
        for line in fh:
            path = line.split(maxsplit=5)[-1].strip()
            if os.path.basename(path).startswith("ld-") and ".so" in path:
                return path
    return None


def malloc_tunables(env: Mapping[str, str]) -> dict[str, list[int]] | None:
    """glibc's malloc tunables as its loader takes them from ``env``'s heap variables, ``{name: [value, min,
    max]}`` (``ld.so --list-tunables``: what glibc will use, not what was asked); None where the loader cannot list
    them (not glibc, or a glibc older than 2.33)."""
    loader = _loader() if glibc_version() is not None else None
    if loader is None:
        return None
    heap_env = {k: v for k, v in env.items() if k == "GLIBC_TUNABLES" or k.startswith("MALLOC_")}
    try:
        listed = subprocess.run([loader, "--list-tunables"], env=heap_env, capture_output=True, text=True,
                                timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    found = {}
    for line in listed.stdout.splitlines() if listed.returncode == 0 else ():
        if (m := _LISTED.match(line.strip())) is not None:
            with contextlib.suppress(ValueError):
                found[m.group(1)] = [int(m.group(i), 0) for i in (2, 3, 4)]
    return found or None


def _number(text: str) -> int | None:
    """``text`` as glibc reads a whole tunable value (decimal, ``0x`` hex, ``0`` octal, blanks around), else None."""
    value = text.strip()
    if re.fullmatch(r"0[xX][0-9a-fA-F]+", value):
        return int(value, 16)
    if re.fullmatch(r"0[0-7]*", value):
        return int(value, 8)
    return int(value) if re.fullmatch(r"[1-9][0-9]*", value) else None


def _leading(text: str) -> int | None:
    """What glibc's ``strtoul`` reads at the start of ``text`` (it stops at the first other character)."""
    m = re.match(r"\s*(0[xX][0-9a-fA-F]+|[0-9]+)", text)
    return None if m is None else _number(m.group(1))


def _range(lo: int, hi: int) -> str:
    return f"{lo} or more" if hi == _MAX else f"{lo} to {hi}"


def _value_problem(label: str, tunable: str, text: str, taken: Mapping[str, list[int]] | None,
                   example: str) -> str | None:
    """One line when glibc does not take ``text`` for ``tunable`` as written, else None."""
    short = tunable.rsplit(".", 1)[-1]
    number = _number(text)
    listed = (taken or {}).get(tunable)
    lo, hi = (listed[1], listed[2]) if listed else _KNOWN.get(tunable, (0, _MAX))
    if number is None:
        read = listed[0] if listed else _leading(text)
        does = f"reads it as {read}" if read else "ignores it"
        m = re.fullmatch(r"\s*([0-9]+)\s*([kKmMgG])(i?[bB])?\s*", text)
        value = int(m.group(1)) * _UNITS[m.group(2).lower()] if m else _EXAMPLES.get(short, max(lo, 1))
        return f"{label} is not a whole number, so glibc {does}; valid: a whole number, e.g. {example}{value}"
    if not lo <= number <= hi:
        return (f"{label} is outside glibc's range {_range(lo, hi)}, so glibc ignores it; valid: a whole number "
                f"from {_range(lo, hi)}")
    return None


def ignored_settings(env: Mapping[str, str], taken: Mapping[str, list[int]] | None = None) -> list[str]:
    """One line for each heap setting in ``env`` that glibc ignores or misreads without a word: a ``MALLOC_*``
    variable glibc does not have (a near miss of one it has), a value that is not a whole number or is outside
    the tunable's range, a ``GLIBC_TUNABLES`` entry without a value or naming no malloc tunable of this glibc.
    ``taken``: :func:`malloc_tunables` (this glibc's names, ranges and what it read), or None (glibc 2.36's)."""
    lines = []
    for name in sorted(k for k in env if k.startswith("MALLOC_")):
        value = env[name]
        if name in MALLOC_ALIASES:
            line = _value_problem(f"{name}={value!r}", MALLOC_ALIASES[name], value, taken, f"{name}=")
            lines += [line] if line else []
            continue
        close = difflib.get_close_matches(name, MALLOC_ALIASES, n=1, cutoff=0.85)
        if close:  # else another allocator's variable (jemalloc's MALLOC_CONF), not a near miss of glibc's
            note = (" (glibc's names of the heap variables end in an underscore, but MALLOC_ARENA_MAX and "
                    "MALLOC_ARENA_TEST)") if close[0].rstrip("_") == name.rstrip("_") else ""
            lines.append(f"{name} is no variable of glibc's, so glibc ignores it; valid: {close[0]}{note}")
    known = sorted(taken) if taken else sorted(_KNOWN)
    for entry in env.get("GLIBC_TUNABLES", "").split(":"):
        if not entry.strip():
            continue
        if "=" not in entry:
            lines.append(f"GLIBC_TUNABLES entry {entry!r} has no value, so glibc ignores it; valid: NAME=VALUE "
                         "entries separated by ':', e.g. GLIBC_TUNABLES=glibc.malloc.arena_max=4")
            continue
        tunable, value = entry.split("=", 1)
        if tunable in known:
            line = _value_problem(f"{tunable}={value!r} in GLIBC_TUNABLES", tunable, value, taken,
                                  f"GLIBC_TUNABLES={tunable}=")
            lines += [line] if line else []
            continue
        close = difflib.get_close_matches(tunable, known, n=1, cutoff=0.85)
        if close or tunable.startswith("glibc.malloc."):
            valid = close[0] if close else "one of " + ", ".join(known)
            lines.append(f"GLIBC_TUNABLES names {tunable}, which is no tunable of this glibc, so glibc ignores it; "
                         f"valid: {valid}")
    return lines
