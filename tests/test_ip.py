"""Client addresses that cannot be forged (RELIABILITY-PLAN S1–S5 and property (c))."""

from __future__ import annotations

import ipaddress
import random

import pytest
from django.test import RequestFactory, override_settings
from hypothesis import assume, given
from hypothesis import strategies as st

from django_tokenbucket import ip as ip_module
from django_tokenbucket.ip import FALLBACKS, client_ip, normalize_ip, parse_ip

from .settings import TOKENBUCKET as BASE_SETTINGS

rf = RequestFactory()


def ip_of(remote="203.0.113.9", forwarded=None, **headers):
    if forwarded is not None:
        headers["HTTP_X_FORWARDED_FOR"] = forwarded
    return client_ip(rf.get("/", REMOTE_ADDR=remote, **headers))


def settings_with(**options):
    return override_settings(TOKENBUCKET={**BASE_SETTINGS, **options})


def test_s1_forwarded_for_is_ignored_by_default():
    rng = random.Random(1)
    keys = {ip_of(forwarded=str(ipaddress.IPv4Address(rng.getrandbits(32)))) for _ in range(10_000)}
    assert keys == {"203.0.113.9"}


class TestTrustedProxyCount:
    def test_takes_the_address_just_before_the_trusted_hops(self):
        with settings_with(TRUSTED_PROXIES=1):
            assert ip_of(remote="10.0.0.1", forwarded="6.6.6.6, 198.51.100.7") == "198.51.100.7"
        with settings_with(TRUSTED_PROXIES=2):
            assert ip_of(remote="10.0.0.1", forwarded="6.6.6.6, 198.51.100.7, 10.0.0.2") == "198.51.100.7"

    def test_a_rotating_client_prefix_still_gives_one_bucket(self):
        with settings_with(TRUSTED_PROXIES=1):
            keys = {ip_of(remote="10.0.0.1", forwarded=f"6.6.{i}.{i}, 198.51.100.7") for i in range(200)}
        assert keys == {"198.51.100.7"}

    @pytest.mark.parametrize(
        ("entry", "expected"),
        [
            ("unknown", "10.0.0.1"),
            ("", "10.0.0.1"),
            ("_hidden", "10.0.0.1"),
            ("1.2.3.4:5678", "1.2.3.4"),
            ("[2001:db8::1]:443", "2001:db8::/64"),
            ("not an address", "10.0.0.1"),
        ],
    )
    def test_malformed_entries_fall_back_to_remote_addr(self, entry, expected):
        before = sum(FALLBACKS.values())
        with settings_with(TRUSTED_PROXIES=1):
            assert ip_of(remote="10.0.0.1", forwarded=f"6.6.6.6, {entry}") == expected
        fell_back = expected == "10.0.0.1"
        assert sum(FALLBACKS.values()) - before == (1 if fell_back else 0)

    def test_fewer_hops_than_configured_falls_back(self):
        with settings_with(TRUSTED_PROXIES=3):
            assert ip_of(remote="10.0.0.1", forwarded="198.51.100.7") == "10.0.0.1"


def test_trusted_proxy_cidrs_skip_every_trusted_hop():
    with settings_with(TRUSTED_PROXIES=["10.0.0.0/8", "2001:db8:ffff::/48"]):
        assert ip_of(remote="10.0.0.1", forwarded="6.6.6.6, 198.51.100.7, 10.1.2.3") == "198.51.100.7"
        # Not from a trusted proxy: the header is the client's own claim.
        assert ip_of(remote="198.51.100.99", forwarded="1.1.1.1") == "198.51.100.99"


class TestEdgeHeader:
    def test_used_only_from_trusted_proxies(self):
        with settings_with(TRUSTED_PROXIES=["10.0.0.0/8"], IP_HEADER="CF-Connecting-IP"):
            assert ip_of(remote="10.0.0.1", HTTP_CF_CONNECTING_IP="198.51.100.7") == "198.51.100.7"
            assert ip_of(remote="192.0.2.1", HTTP_CF_CONNECTING_IP="198.51.100.7") == "192.0.2.1"

    def test_spoof_attempts_accepted_zero(self):
        with settings_with(TRUSTED_PROXIES=["10.0.0.0/8"], IP_HEADER="CF-Connecting-IP"):
            keys = {ip_of(remote="192.0.2.1", HTTP_CF_CONNECTING_IP=f"6.6.6.{i}") for i in range(100)}
        assert keys == {"192.0.2.1"}


def test_s4_ipv6_rotation_inside_a_64_is_one_bucket():
    rng = random.Random(2)
    base = int(ipaddress.IPv6Address("2001:db8:1:2::"))
    keys = {ip_of(remote=str(ipaddress.IPv6Address(base + rng.getrandbits(64)))) for _ in range(10_000)}
    assert keys == {"2001:db8:1:2::/64"}
    in_one_48 = {ip_of(remote=f"2001:db8:1:{i:x}::1") for i in range(10)}
    assert len(in_one_48) == 10


def test_ipv6_prefix_is_configurable():
    with settings_with(IPV6_PREFIX=48):
        assert ip_of(remote="2001:db8:1:2::1") == ip_of(remote="2001:db8:1:ffff::1") == "2001:db8:1::/48"


def test_s5_ipv4_in_ipv6_forms_are_unwrapped():
    rng = random.Random(3)
    addresses = {ipaddress.IPv4Address(rng.getrandbits(32)) for _ in range(1000)}
    for form in (
        lambda a: f"::ffff:{a}",
        lambda a: f"::ffff:{int(a) >> 16:x}:{int(a) & 0xFFFF:x}",
        lambda a: f"64:ff9b::{a}",
    ):
        keys = {ip_of(remote=form(a)) for a in addresses}
        assert keys == {str(a) for a in addresses}


def test_zone_ids_are_stripped():
    assert ip_of(remote="fe80::1%eth0") == "fe80::/64"


@given(st.ip_addresses(v=4))
def test_ipv4_normalizes_the_same_in_every_notation(address):
    mapped = ipaddress.IPv6Address(int(address) | 0xFFFF00000000)
    assert normalize_ip(str(address)) == normalize_ip(f"::ffff:{address}") == normalize_ip(str(mapped)) == str(address)


@given(st.ip_addresses(v=4), st.ip_addresses(v=4))
def test_distinct_ipv4_addresses_are_distinct_keys(a, b):
    assert (normalize_ip(str(a)) == normalize_ip(str(b))) == (a == b)


@given(st.ip_addresses(v=6), st.integers(0, 2**64 - 1))
def test_addresses_in_one_64_share_a_key(address, suffix):
    assume(address.ipv4_mapped is None and address not in ipaddress.IPv6Network("64:ff9b::/96"))
    neighbour = ipaddress.IPv6Address((int(address) >> 64 << 64) | suffix)
    assert normalize_ip(str(address)) == normalize_ip(str(neighbour))


@given(st.text(max_size=80))
def test_arbitrary_text_never_crashes(text):
    result = normalize_ip(text)
    assert result is None or isinstance(result, str)


@given(st.one_of(st.ip_addresses().map(str), st.text(max_size=100)))
def test_a_remembered_parse_is_the_parse(value):
    # Twice: the second answer comes from the memory of the first.
    first, second = parse_ip(value), parse_ip(value)
    assert first == second == ip_module._parse(value)


def test_rotating_or_oversized_values_keep_the_parse_memory_bounded():
    ip_module._parse_remembered.cache_clear()
    rng = random.Random(7)
    for _ in range(20_000):
        assert parse_ip(str(ipaddress.IPv4Address(rng.getrandbits(32)))) is not None
    huge = " " * 10_000 + "198.51.100.7"
    assert parse_ip(huge) == ipaddress.IPv4Address("198.51.100.7")  # padding is stripped
    info = ip_module._parse_remembered.cache_info()
    assert info.currsize == info.maxsize == 4096
    misses = info.misses
    parse_ip(huge)
    assert ip_module._parse_remembered.cache_info().misses == misses  # never a key of the memory
