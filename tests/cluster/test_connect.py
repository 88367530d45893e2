"""``--ray`` values (mesh.cluster.pools.parse_ray_address): pure, no cluster."""

from __future__ import annotations

import pytest

from mesh.cluster.pools import RayAddress, parse_ray_address


@pytest.mark.parametrize(("value", "want"), [
    ("auto", RayAddress("auto")),
    ("10.0.0.5:6379", RayAddress("10.0.0.5:6379", "10.0.0.5", 6379)),
    ("head.example:6379", RayAddress("head.example:6379", "head.example", 6379)),
    ("ray://head:10001", RayAddress("ray://head:10001", "head", 10001, client=True)),
    ("[::1]:6379", RayAddress("[::1]:6379", "::1", 6379)),
])
def test_parse(value: str, want: RayAddress) -> None:
    assert parse_ray_address(value) == want


@pytest.mark.parametrize("value", ["", "head", "head:", ":6379", "head:port", "head:70000",
                                   "local"])
def test_a_bad_value_names_the_flag(value: str) -> None:
    with pytest.raises(ValueError, match=r"^--ray must be 'auto' or the head's HOST:PORT"):
        parse_ray_address(value)
