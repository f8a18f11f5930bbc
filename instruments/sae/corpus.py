"""Text to train an SAE on, found on every machine that runs prismgate: nothing is downloaded.

Two sources, both fixed for a given prismgate and Python version, so a training run is
repeatable and its cache key (:func:`corpus_digest`) names exactly what it read:

* the concept prompt sets shipped with prismgate (short sentences: French and English,
  questions, code, refusals, formal and casual text, numbers, past tense);
* the documentation Python's standard library ships inside its modules (the docstrings of a
  fixed list of modules, their classes and functions, cut into paragraphs): English prose
  about programs, with code and numbers in it. Docstrings are read with :func:`inspect.getdoc`
  from modules imported by name, so the text is the same wherever the same Python runs.

Texts are de-duplicated and sorted; every tenth is held out for evaluation (:func:`split`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Sequence

from prismgate.instruments.packs.build import PROMPT_SETS_DIR
from prismgate.instruments.packs.prompt_sets import load_prompt_sets

# Standard-library modules whose documentation is read, in this order (pure Python, always present).
STDLIB_MODULES = (
    "argparse", "asyncio.events", "asyncio.tasks", "base64", "bisect", "calendar", "collections", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum",
    "fractions", "ftplib", "functools", "gettext", "glob", "gzip", "heapq", "hmac", "html.parser", "http.client",
    "http.cookies", "imaplib", "inspect", "ipaddress", "json", "logging", "mailbox", "mimetypes", "optparse",
    "pathlib", "pickle", "pprint", "queue", "random", "shlex", "shutil", "smtplib", "socket", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace",
    "turtle", "typing", "unittest.case", "urllib.parse", "urllib.request", "uuid", "wave", "zipfile",
)  # fmt: skip
MIN_CHARS = 40  # shorter paragraphs (signatures, one-word notes) are left out
MAX_CHARS = 600  # longer paragraphs are cut at a word boundary
HOLD_OUT_EVERY = 10


def prompt_set_texts() -> list[str]:
    return [p for s in load_prompt_sets([PROMPT_SETS_DIR]) for p in (*s.positive, *s.negative)]


def stdlib_texts(modules: Sequence[str] = STDLIB_MODULES) -> list[str]:
    """Paragraphs of the docstrings of ``modules`` and their public classes, functions and methods."""
    texts: list[str] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a Python built without one (tkinter-less turtle still imports): skip it
            continue
        docs = [inspect.getdoc(module)]
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                docs.append(inspect.getdoc(obj))
            if inspect.isclass(obj):
                for meth_name, meth in sorted(vars(obj).items()):
                    if not meth_name.startswith("_") and inspect.isfunction(meth):
                        docs.append(inspect.getdoc(meth))
        for doc in docs:
            texts.extend(_paragraphs(doc or ""))
    return texts


def _paragraphs(doc: str) -> list[str]:
    out = []
    for para in doc.split("\n\n"):
        text = " ".join(para.split())
        if len(text) < MIN_CHARS:
            continue
        if len(text) > MAX_CHARS:
            text = text[:MAX_CHARS].rsplit(" ", 1)[0]
        out.append(text)
    return out


def corpus() -> list[str]:
    """Every text, de-duplicated and sorted."""
    return sorted(set(prompt_set_texts()) | set(stdlib_texts()))


def split(texts: Sequence[str]) -> tuple[list[str], list[str]]:
    """(training, held-out): every :data:`HOLD_OUT_EVERY`-th text is held out."""
    train = [t for i, t in enumerate(texts) if i % HOLD_OUT_EVERY]
    held = [t for i, t in enumerate(texts) if not i % HOLD_OUT_EVERY]
    return train, held


def corpus_digest(texts: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode() + b"\0")
    return digest.hexdigest()[:16]
