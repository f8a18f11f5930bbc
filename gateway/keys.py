"""Named API keys: a TOML file of key hashes, reloaded while the server runs.

The file (setting ``keys_file``) holds one table per key (its SHA-256, models, permissions,
limits and weight), never the key itself. A presented key is hashed and compared with every
entry in constant time. The file is read again on SIGHUP and when its modification time
changes; one that no longer parses keeps the keys already loaded. ``auth_token`` stays as the
one-key shortcut: the key named ``default`` with the admin scope. The file's format, and why a
plain SHA-256: docs/keys.md.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prismgate.auth import bearer_token
from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.principal import ANYONE, Principal
from prismgate.settings.groups import Security

log = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
CHECK_INTERVAL_S = 1.0
TOKEN_KEY = "default"  # the name the auth_token shortcut's key goes by
_FLAGS = ("steer", "readouts", "logprobs", "playground", "admin")
_LIMITS = ("max_concurrent", "tokens_per_minute")
_FIELDS = frozenset({"sha256", "models", "weight", *_FLAGS, *_LIMITS})


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def new_key() -> str:
    """A fresh key: 256 random bits."""
    return "pg-" + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class Entry:
    digest: bytes
    principal: Principal


def parse_entry(name: str, table: object, where: str) -> Entry:
    """One ``[keys.NAME]`` table; INVALID_ARGUMENT naming the key and field when it is wrong."""
    at = f"{where}: key {name!r}"
    if not NAME.fullmatch(name):
        raise invalid(f"{at}: a name is 1-64 letters, digits, '_', '.' or '-'")
    if not isinstance(table, dict):
        raise invalid(f"{at} must be a table")
    unknown = sorted(set(table) - _FIELDS)
    if unknown:
        raise invalid(f"{at}: unknown field(s) {', '.join(unknown)}; a key takes {', '.join(sorted(_FIELDS))}")
    hexed = table.get("sha256")
    if not isinstance(hexed, str) or not re.fullmatch(r"[0-9a-f]{64}", hexed):
        raise invalid(f"{at}: 'sha256' must be the key's SHA-256 in 64 lowercase hex digits")
    models = table.get("models")
    if models is not None and not (isinstance(models, list) and all(isinstance(m, str) for m in models)):
        raise invalid(f"{at}: 'models' must be a list of model names")
    values: dict[str, Any] = {}
    for flag in _FLAGS:
        if not isinstance(table.get(flag, flag != "admin"), bool):
            raise invalid(f"{at}: {flag!r} must be true or false")
        values[flag] = table.get(flag, flag != "admin")
    for limit in _LIMITS:
        value = table.get(limit, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise invalid(f"{at}: {limit!r} must be a whole number >= 0 (0: no limit)")
        values[limit] = value
    weight = table.get("weight", 1.0)
    if not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 < weight <= 1e6:
        raise invalid(f"{at}: 'weight' must be a number > 0")
    principal = Principal(
        name=name, models=None if models is None else frozenset(models), weight=float(weight), **values
    )
    return Entry(bytes.fromhex(hexed), principal)


def parse_file(text: str, where: str) -> list[Entry]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise invalid(f"{where} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"keys"})
    if unknown:
        raise invalid(f"{where}: unknown table(s) {', '.join(unknown)}; the file holds [keys.NAME] tables")
    tables = data.get("keys", {})
    if not isinstance(tables, dict):
        raise invalid(f"{where}: 'keys' must hold [keys.NAME] tables")
    entries = [parse_entry(name, table, where) for name, table in tables.items()]
    seen: set[bytes] = set()
    for entry in entries:
        if entry.digest in seen:
            raise invalid(f"{where}: key {entry.principal.name!r} has the same sha256 as another key")
        seen.add(entry.digest)
    return entries


class KeyRing:
    """The keys the server accepts now; :meth:`authenticate` turns a presented key into its principal."""

    def __init__(self, path: str | None, auth_token: str | None) -> None:
        self.path = Path(path) if path else None
        self._token = None if auth_token is None else Entry(digest(auth_token), Principal(TOKEN_KEY, admin=True))
        self._entries: list[Entry] = []
        self._mtime: float | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        self.names: frozenset[str] = frozenset()  # every name configured since start: the bounded metric labels
        if self.path is not None:
            self._entries = parse_file(self.path.read_text(), str(self.path))  # a bad file stops the start
            self._mtime = self.path.stat().st_mtime
        self._named()

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (else every caller is the one user, ``ANYONE``)."""
        return self.path is not None or self._token is not None

    def _all(self) -> list[Entry]:
        return self._entries + ([self._token] if self._token is not None else [])

    def _named(self) -> None:
        self.names = self.names | {entry.principal.name for entry in self._all()}

    def principals(self) -> list[Principal]:
        return [entry.principal for entry in self._all()]

    def reload(self) -> bool:
        """Read the file again; False (and the old keys kept) when it cannot be read or parsed."""
        if self.path is None:
            return True
        with self._lock:
            try:
                mtime = self.path.stat().st_mtime
                entries = parse_file(self.path.read_text(), str(self.path))
            except (OSError, GatewayError) as exc:
                log.error("keys file not reloaded, the keys loaded before stay: %s", exc)
                return False
            before = {e.principal.name for e in self._entries}
            self._entries, self._mtime = entries, mtime
            self._named()
            after = {e.principal.name for e in entries}
            log.info(
                "keys file reloaded",
                extra={"keys": len(entries), "added": sorted(after - before), "removed": sorted(before - after)},
            )
            return True

    def _maybe_reload(self) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if now - self._checked < CHECK_INTERVAL_S:
            return
        self._checked = now
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            mtime = None
        if mtime != self._mtime:
            self.reload()

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of the presented ``Authorization`` value; UNAUTHENTICATED when it names no key."""
        if not self.enabled:
            return ANYONE
        self._maybe_reload()
        presented = digest(bearer_token(authorization))
        found: Principal | None = None
        for entry in self._all():  # every entry compared, in constant time: no early exit
            if hmac.compare_digest(entry.digest, presented):
                found = entry.principal
        if found is None:
            raise GatewayError(Code.UNAUTHENTICATED, "invalid bearer token")
        return found


_RINGS: dict[tuple[str | None, str | None], KeyRing] = {}
_RINGS_LOCK = threading.Lock()


def ring_for(security: Security) -> KeyRing:
    """The process's key ring for these settings: one instance shared by the HTTP edge and every gRPC guard."""
    key = (os.path.abspath(security.keys_file) if security.keys_file else None, security.auth_token)
    with _RINGS_LOCK:
        ring = _RINGS.get(key)
        if ring is None:
            ring = _RINGS[key] = KeyRing(security.keys_file, security.auth_token)
        return ring


def reload_all() -> None:
    """SIGHUP: read every keys file again."""
    with _RINGS_LOCK:
        rings = list(_RINGS.values())
    for ring in rings:
        ring.reload()


def entry_toml(name: str, key: str, options: dict[str, Any]) -> str:
    """The ``[keys.NAME]`` table for a new key (its hash and the options that differ from the defaults)."""
    lines = [f"[keys.{name}]", f'sha256 = "{digest(key).hex()}"']
    for field, value in options.items():
        if isinstance(value, bool):
            lines.append(f"{field} = {'true' if value else 'false'}")
        elif isinstance(value, list):
            lines.append(f"{field} = [{', '.join(_quoted(v) for v in value)}]")
        else:
            lines.append(f"{field} = {value}")
    return "\n".join(lines) + "\n"


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def add_key(path: Path, name: str, options: dict[str, Any]) -> str:
    """Append a new key named ``name`` to the keys file (created, mode 0600, if absent); return the key."""
    text = path.read_text() if path.exists() else ""
    existing = parse_file(text, str(path)) if text.strip() else []
    if name in {e.principal.name for e in existing}:
        raise invalid(f"{path} already has a key named {name!r} (remove its table first to replace it)")
    key = new_key()
    table = entry_toml(name, key, options)
    parse_entry(name, tomllib.loads(table)["keys"][name], "the new key")  # the options are checked before writing
    if not path.exists():
        path.touch(mode=0o600)
    with path.open("a") as out:
        out.write(("" if not text else "\n" if text.endswith("\n") else "\n\n") + table)
    return key
