"""Contrastive prompt sets: the inputs of a concept pack, loaded and checked before any model runs.

A prompt set is one concept: ``{"name", "description", "positive": [...], "negative": [...]}``
(``prompt_sets/*.json``). Pairs at the same index share a topic, so held-out folds keep them
together. Bad files get a clear error naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prismgate.core.errors import invalid


@dataclass(frozen=True)
class PromptSet:
    """One concept: prompts that show it (``positive``) and matched ones that do not."""

    name: str
    description: str
    positive: tuple[str, ...]
    negative: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise invalid(f"prompt set name {self.name!r} must be non-empty letters, digits, '_' or '-'")
        for side in ("positive", "negative"):
            prompts = getattr(self, side)
            if not prompts:
                raise invalid(f"prompt set {self.name!r} has no {side} prompts")
            bad = [i for i, p in enumerate(prompts) if not isinstance(p, str) or not p.strip()]
            if bad:
                raise invalid(f"prompt set {self.name!r}: {side} prompts {bad} are empty or not strings")

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "prompt set") -> PromptSet:
        if not isinstance(data, dict):
            raise invalid(f"{source}: expected a JSON object with name, description, positive, negative")
        missing = [k for k in ("name", "positive", "negative") if k not in data]
        if missing:
            raise invalid(f"{source}: missing {', '.join(missing)}")
        for side in ("positive", "negative"):
            if not isinstance(data[side], list):
                raise invalid(f"{source}: {side!r} must be a list of strings")
        return cls(
            name=str(data["name"]),
            description=str(data.get("description", "")),
            positive=tuple(data["positive"]),
            negative=tuple(data["negative"]),
        )

    @classmethod
    def load(cls, path: str | Path) -> PromptSet:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise invalid(f"cannot read prompt set {path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise invalid(f"prompt set {path} is not valid JSON: {e}") from None
        return cls.from_dict(data, source=str(path))


def load_prompt_sets(sources: Sequence[str | Path]) -> list[PromptSet]:
    """Prompt sets from files and folders (every ``*.json`` in a folder), sorted by name."""
    if not sources:
        raise invalid("no prompt sets given")
    files: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            found = sorted(path.glob("*.json"))
            if not found:
                raise invalid(f"prompt set folder {path} holds no *.json files")
            files.extend(found)
        elif path.exists():
            files.append(path)
        else:
            raise invalid(f"prompt set {path} does not exist")
    return checked_sets([PromptSet.load(f) for f in files])


def checked_sets(sets: Sequence[PromptSet | str | Path]) -> list[PromptSet]:
    """Prompt sets (or paths to load them from) sorted by name, so input order never changes a pack."""
    if not sets:
        raise invalid("no prompt sets given")
    if all(isinstance(s, (str, Path)) for s in sets):
        return load_prompt_sets([Path(s) for s in sets])  # type: ignore[arg-type]
    if not all(isinstance(s, PromptSet) for s in sets):
        raise invalid("prompt sets must all be PromptSet objects or all be paths")
    typed = sorted((s for s in sets if isinstance(s, PromptSet)), key=lambda s: s.name)
    names = [s.name for s in typed]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise invalid(f"prompt set names must be unique; repeated: {', '.join(dupes)}")
    return typed


def prompt_sets_digest(sets: Sequence[PromptSet]) -> str:
    """A short hash of the prompt sets' contents, recorded in the pack to tie it to its inputs."""
    canon = json.dumps([[s.name, s.description, list(s.positive), list(s.negative)] for s in sets], ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]
