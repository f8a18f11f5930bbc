"""The keys file and ``prismgate keys``: hashes only, strict parsing, a key that works once printed."""

from __future__ import annotations

import hashlib
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from prismgate.core.errors import Code, GatewayError
from prismgate.keys import KeyRing, parse_file

PRISMGATE = str(Path(sys.executable).parent / "prismgate")


def keys(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PRISMGATE, "keys", *args], capture_output=True, text=True, timeout=60)


def test_keys_add_prints_the_key_once_and_stores_only_its_hash(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    made = keys("add", "alice", "--file", str(path), "--no-steer", "--max-concurrent", "2", "--models", "m1,m2")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert len(key) > 40 and key not in path.read_text()
    assert hashlib.sha256(key.encode()).hexdigest() in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    second = keys("add", "bob", "--file", str(path), "--admin", "--weight", "2")
    assert second.returncode == 0 and second.stdout.strip() != key
    ring = KeyRing(str(path), None)
    alice = ring.authenticate(f"Bearer {key}")
    assert (alice.name, alice.steer, alice.max_concurrent, alice.models) == ("alice", False, 2, frozenset({"m1", "m2"}))
    bob = ring.authenticate(f"Bearer {second.stdout.strip()}")
    assert bob.admin and bob.weight == 2.0
    again = keys("add", "alice", "--file", str(path))
    assert again.returncode == 2 and "already has a key named 'alice'" in again.stderr
    bad = keys("add", "carol", "--file", str(path), "--weight", "0")
    assert bad.returncode == 2 and "'weight' must be a number > 0" in bad.stderr
    assert "carol" not in path.read_text()  # refused before anything was written


def test_a_wrong_key_is_unauthenticated(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    key = keys("add", "alice", "--file", str(path)).stdout.strip()
    ring = KeyRing(str(path), "shortcut-token-0123456789")
    for presented in (None, "", "Basic abc", f"Bearer {key}x", "Bearer "):
        with pytest.raises(GatewayError) as refused:
            ring.authenticate(presented)
        assert refused.value.code is Code.UNAUTHENTICATED
    assert ring.authenticate("Bearer shortcut-token-0123456789").name == "default"  # --auth-token beside the file
    assert ring.authenticate("Bearer shortcut-token-0123456789").admin


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[keys.a]\nsha256 = "abc"\n', "64 lowercase hex digits"),
        (f'[keys.a]\nsha256 = "{"0" * 64}"\nsteer = "no"\n', "'steer' must be true or false"),
        (f'[keys.a]\nsha256 = "{"0" * 64}"\nmax_concurrent = -1\n', "'max_concurrent' must be a whole number"),
        (f'[keys.a]\nsha256 = "{"0" * 64}"\ncolour = 1\n', "unknown field(s) colour"),
        (f'[keys."a b"]\nsha256 = "{"0" * 64}"\n', "a name is 1-64 letters"),
        (f'[keys.a]\nsha256 = "{"0" * 64}"\n[keys.b]\nsha256 = "{"0" * 64}"\n', "the same sha256"),
        ("[other]\n", "unknown table(s) other"),
        ("[keys.a\n", "not valid TOML"),
    ],
)
def test_a_bad_file_is_refused_with_the_key_and_field(text: str, words: str) -> None:
    with pytest.raises(GatewayError) as refused:
        parse_file(text, "keys.toml")
    assert words in refused.value.message


def test_a_server_does_not_start_on_a_bad_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text("[keys.a]\nsha256 = 'short'\n")
    result = subprocess.run(
        [PRISMGATE, "serve", "--keys-file", str(path), "--http-port", "0", "--grpc-port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "64 lowercase hex digits" in result.stderr
