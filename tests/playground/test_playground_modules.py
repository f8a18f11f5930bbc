"""The page's script is ES modules, served as JavaScript, shipped in the wheel, with no build step.

A browser runs a ``<script type="module">`` and each module it imports only when the response's
Content-Type is a JavaScript one; a classic script would put the page's functions on ``window``.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from prismgate.playground import FILES

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "gateway" / "playground"
IMPORT = re.compile(r"""^\s*(?:import|export)\b[^'"]*?\bfrom\s*["']([^"']+)["']|^\s*import\s*["']([^"']+)["']""", re.M)
JAVASCRIPT = ("text/javascript", "application/javascript")


class Scripts(HTMLParser):
    """The page's ``<script>`` tags and any inline event handler (``onclick=...``: a classic script too)."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict[str, str | None]] = []
        self.handlers: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "script":
            self.scripts.append(dict(attrs))
        self.handlers += [f"<{tag} {name}>" for name, _ in attrs if name.startswith("on")]


def page_scripts(html: str) -> Scripts:
    parser = Scripts()
    parser.feed(html)
    return parser


def imports(source: str) -> list[str]:
    """The module specifiers a module imports (static imports and re-exports)."""
    return [a or b for a, b in IMPORT.findall(source)]


def module_graph(entry: str, read: dict[str, str]) -> set[str]:
    """Every module file reachable from ``entry``; each import must be relative, to a file of the folder."""
    seen: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for spec in imports(read[name]):
            assert spec.startswith("./") and "/" not in spec[2:], f"{name} imports {spec!r}: not a sibling module"
            assert spec[2:] in read, f"{name} imports {spec!r}, which is not a playground file"
            todo.append(spec[2:])
    return seen


def unimported_names(sources: dict[str, str]) -> list[str]:
    """Names a module uses that a sibling module defines at its top level, but that it does not import.

    In a classic script every top-level name was global; in a module such a use is a ReferenceError
    that shows only when the code runs, so it is looked for here in the text (comments and string
    literals left out).
    """
    top = re.compile(r"^(?:export\s+)?(?:async\s+)?(?:function\*?|const|let|class)\s+([\w$]+)", re.M)
    owner = {name: module for module, source in sources.items() for name in top.findall(source)}
    missing = []
    for module, source in sources.items():
        imported = {
            n.split(" as ")[-1].strip()
            for group in re.findall(r"import\s*\{([^}]*)\}", source)
            for n in group.split(",")
        }
        code = re.sub(r"(?m)(^|\s)//.*$", r"\1", source).replace("...", " ").replace("${", "{")
        code = re.sub(r"\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*'", '""', code)
        for name, defined_in in owner.items():
            if defined_in == module or name in imported:
                continue
            if re.search(r"(?<![\w.$])" + re.escape(name) + r"(?![\w$])", code):
                missing.append(f"{module} uses {name} ({defined_in}) without importing it")
    return missing


def test_page_loads_only_module_scripts(live_server) -> None:  # type: ignore[no-untyped-def]
    page = page_scripts(httpx.get(live_server.http_url + "/playground").text)
    assert page.scripts, "the page loads no script"
    for script in page.scripts:
        assert script.get("type") == "module" and (script.get("src") or "").startswith("/playground/"), script
    assert not page.handlers, f"inline handlers run as classic scripts: {page.handlers}"


def test_every_module_is_served_as_javascript(live_server) -> None:  # type: ignore[no-untyped-def]
    sources = {path.name: path.read_text() for path in STATIC.glob("*.js")}
    reachable = module_graph("app.js", sources)
    assert reachable == set(sources), f"modules nothing imports: {sorted(set(sources) - reachable)}"
    assert len(sources) > 1  # the page is split by job, not one script
    for name in sorted(sources):
        response = httpx.get(f"{live_server.http_url}/playground/{name}")
        assert response.status_code == 200 and response.text == sources[name], name
        assert response.headers["content-type"].split(";")[0] in JAVASCRIPT, (name, response.headers["content-type"])
        assert response.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(live_server.http_url + "/playground/__init__.py").status_code == 404


def test_no_module_uses_a_sibling_name_it_does_not_import() -> None:
    assert not unimported_names({path.name: path.read_text() for path in STATIC.glob("*.js")})


def test_modules_are_served_without_a_token(server_factory) -> None:  # type: ignore[no-untyped-def]
    """The page loads before its user types the token into it."""
    with server_factory(auth_token="s3cret") as server:
        for name in FILES:
            assert httpx.get(f"{server.http_url}/playground/{name}").status_code == 200, name
        assert httpx.get(server.http_url + "/playground/manifest.json").status_code == 401


def test_the_wheel_ships_every_playground_file() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns.get("*", []) + patterns.get("prismgate.playground", [])
    for path in STATIC.iterdir():
        if path.is_file() and path.suffix != ".py":
            assert any(fnmatch.fnmatch(path.name, p) for p in shipped), f"{path.name} is not package data"


def test_the_checks_see_a_classic_script_and_a_dangling_import() -> None:
    page = page_scripts('<script src="/playground/app.js"></script><button onclick="go()">')
    assert page.scripts == [{"src": "/playground/app.js"}] and page.handlers == ["<button onclick>"]
    assert imports('import { a } from "./a.js";\nimport "./b.js";\nexport { c } from "./c.js";') == [
        "./a.js",
        "./b.js",
        "./c.js",
    ]
    split = {"a.js": "export function f() {}\n", "b.js": 'const x = { ...f() }; // f\nconst s = "f";\n'}
    assert unimported_names(split) == ["b.js uses f (a.js) without importing it"]
    assert not unimported_names({**split, "b.js": 'import { f } from "./a.js";\n' + split["b.js"]})
    with pytest.raises(AssertionError, match=r"gone\.js"):
        module_graph("app.js", {"app.js": 'import { x } from "./gone.js";'})
