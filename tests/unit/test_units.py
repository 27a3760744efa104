import pytest

from fuyou.errors import ConfigError
from fuyou.units import align_up, format_size, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("512MiB", 512 * 2**20),
        ("64GiB", 64 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("2 tib", 2 * 2**40),
        ("10kb", 10_000),
        (7, 7),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "12XB", "-5GiB", "1.2.3GB", -1])
def test_parse_size_rejects_with_flag_name(bad):
    with pytest.raises(ConfigError, match="--cpu-memory"):
        parse_size(bad, "--cpu-memory")


def test_format_and_align():
    assert format_size(1536 * 2**20) == "1.5 GiB"
    assert format_size(100) == "100 B"
    assert format_size(24 * 2**20 + 5, up=True) == "24.1 MiB" and format_size(24 * 2**20, up=True) == "24.0 MiB"
    assert align_up(4097, 4096) == 8192 and align_up(0, 4096) == 0 and align_up(4096, 4096) == 4096
