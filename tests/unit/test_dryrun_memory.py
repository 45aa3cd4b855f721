"""--device-memory values: sizes in decimal and binary units, and known GPU names."""

import pytest

from multigpu.errors import ConfigError
from multigpu.jobs.dryrun import GPUS, parse_device_memory


@pytest.mark.parametrize("text, expected", [
    ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("24000MiB", 24000 * 2**20), ("1.5TB", 15 * 10**11),
    ("123456B", 123456), ("h100", GPUS["H100"]), ("A100-40GB", 40960 * 2**20), ("l4", GPUS["L4"]),
])
def test_sizes_and_gpu_names(text, expected):
    assert parse_device_memory(text)[0] == expected


@pytest.mark.parametrize("text", ["lots", "0GB", "-4GB", "80 gigs", "H1000", "80"])
def test_bad_values_name_what_is_valid(text):
    with pytest.raises(ConfigError, match=r"--device-memory .* valid: a size such as 80GB.*H100"):
        parse_device_memory(text)
