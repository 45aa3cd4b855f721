"""SLURM's host-list grammar as ``scontrol show hostnames`` reads it (pure).

Pins what a scheduler's node list used to be misread as: ``gpu[1-2]-ib`` was ``gpu1`` (the text after a group
dropped), ``rack[1-2]-n[01-02]`` was ``rack1`` (a second group dropped), ``localhost[1-2`` was accepted,
``node[5-3]`` blamed the rendezvous endpoint, ``node[a-b]`` was an internal error, and ``n[0-999999999]`` was
expanded whole (90 s, then MemoryError) although only its first host is needed.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from multigpu.errors import ConfigError
from multigpu.runtime.hostlist import count_hosts, first_host, iter_hosts, parse_hostlist


@pytest.mark.parametrize("text,hosts", [
    ("gpu[01-03,7],login1", ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]),
    ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[008-010],n[99-100]", ["n008", "n009", "n010", "n99", "n100"]),
    ("a b\tc,,d", ["a", "b", "c", "d"]),
    ("node1.cluster.org,node2", ["node1.cluster.org", "node2"]),
    ("", []),
])
def test_the_grammar_as_scontrol_show_hostnames_expands_it(text, hosts):
    assert list(iter_hosts(text)) == hosts
    assert first_host(text) == (hosts[0] if hosts else None) and count_hosts(text) == len(hosts)


def test_a_huge_range_gives_its_first_host_and_length_without_expanding():
    text = "n[0-999999999],m[1-2]-x[0-99999]"
    assert first_host(text) == "n0" and count_hosts(text) == 1_000_000_000 + 2 * 100_000
    assert list(itertools.islice(iter_hosts(text), 3)) == ["n0", "n1", "n2"]


@pytest.mark.parametrize("text,why", [
    ("node[5-3]", "the range 5-3 runs backwards"),
    ("node[a-b]", "holds 'a-b', which is not a number"),
    ("node[1-²]", "ASCII digits"),
    ("localhost[1-2", "is never closed"),
    ("node[]", "an empty [] group"),
    ("node[1-]", "holds '1-'"),
    ("node]1", "closes no '['"),
    ("n[[1]]", "brackets inside brackets"),
])
def test_bad_host_lists_are_one_line_naming_the_variable(text, why):
    with pytest.raises(ConfigError) as info:
        parse_hostlist(text, "SLURM_NODELIST")
    message = str(info.value)
    assert message.startswith(f"SLURM_NODELIST={text!r} is not a SLURM host list: ") and why in message
    assert "\n" not in message and "valid: " in message


# an independent model: a host list built from parts, with its expansion computed by itertools.product
_text = st.text(alphabet="abcxyz.-_", min_size=1, max_size=4)


@st.composite
def _ranges(draw):
    out = []
    for _ in range(draw(st.integers(1, 3))):
        lo = draw(st.integers(0, 120))
        hi = draw(st.integers(lo, lo + 4))
        width = draw(st.integers(1, 4))
        single = draw(st.booleans())
        lo_text = f"{lo:0{width}d}"
        if single:
            out.append((lo_text, [lo_text]))
        else:
            out.append((f"{lo_text}-{hi}", [f"{i:0{len(lo_text)}d}" for i in range(lo, hi + 1)]))
    return "[" + ",".join(t for t, _ in out) + "]", [h for _, hs in out for h in hs]


@st.composite
def _expression(draw):
    parts = [(t, [t]) for t in [draw(_text)]]
    for _ in range(draw(st.integers(0, 3))):
        parts.append(draw(_ranges()))
        if draw(st.booleans()):
            parts.append((t := draw(_text), [t]))
    text = "".join(t for t, _ in parts)
    return text, ["".join(combo) for combo in itertools.product(*(hs for _, hs in parts))]


@given(st.lists(_expression(), min_size=1, max_size=4), st.sampled_from([",", " ", "\t"]))
def test_any_list_expands_as_the_model_says(expressions, separator):
    text = separator.join(t for t, _ in expressions)
    want = [h for _, hosts in expressions for h in hosts]
    assert list(iter_hosts(text)) == want
    assert first_host(text) == want[0] and count_hosts(text) == len(want)


def test_a_rank_under_srun_reads_only_the_first_host_too():
    from multigpu.runtime.env import read_placement

    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "gpu[0-999999999]-ib", "SLURM_JOB_ID": "5"}
    assert read_placement(env).master_addr == "gpu0-ib"
    with pytest.raises(ConfigError, match="SLURM_NTASKS_PER_NODE='one' must be a whole number"):
        read_placement({**env, "SLURM_NTASKS_PER_NODE": "one"})


def test_a_range_past_a_machine_integer_is_counted_and_a_list_too_long_to_hold_is_one_line():
    """Issue 48: a 30-digit range gave an internal OverflowError (``len()`` of a range past 2**63), and the public
    ``expand_slurm_nodelist`` built every one of 10**9 names (gigabytes) before anything could look at them."""
    from multigpu.runtime.env import expand_slurm_nodelist

    huge = "n[0-999999999999999999999999999999]"
    assert count_hosts(huge) == 10**30 and first_host(huge) == "n0"
    assert next(iter(iter_hosts(huge))) == "n0"
    with pytest.raises(ConfigError, match=r"SLURM_JOB_NODELIST='n\[0-999999999\]' holds 1,000,000,000 hosts, more than "
                                          r"a list of names holds \(at most 1,000,000\); valid:"):
        expand_slurm_nodelist("n[0-999999999]")
    assert expand_slurm_nodelist("n[1-3]") == ["n1", "n2", "n3"]


def test_the_default_variable_is_named_and_a_parsed_list_is_not_parsed_again():
    """Each entry point names SLURM_JOB_NODELIST when no variable is given, the one given otherwise; a HostList
    already parsed is read as it is (mutation testing: these survived)."""
    for read in (parse_hostlist, iter_hosts, first_host, count_hosts):
        with pytest.raises(ConfigError, match=r"^SLURM_JOB_NODELIST='n\[' is not a SLURM host list: "):
            read("n[")
        with pytest.raises(ConfigError, match=r"^SLURM_STEP_NODELIST='n\[' is not a SLURM host list: "):
            read("n[", "SLURM_STEP_NODELIST")
    parsed = parse_hostlist("gpu[1-3],login1")
    assert list(iter_hosts(parsed)) == ["gpu1", "gpu2", "gpu3", "login1"]
    assert first_host(parsed) == "gpu1" and count_hosts(parsed) == 4 == parsed.size()
    assert first_host(parse_hostlist("")) is None and count_hosts(parse_hostlist(" , ")) == 0


def test_a_number_may_hold_every_digit_and_a_second_open_bracket_is_named_as_nested():
    assert list(iter_hosts("n[1234567890]")) == ["n1234567890"]
    assert count_hosts("n[0123456789-0123456790]") == 2 and first_host("n[0123456789-9876543210]") == "n0123456789"
    with pytest.raises(ConfigError, match="brackets inside brackets"):
        parse_hostlist("n[1[2]x[3]")  # the first '[' after the open one, not the last
