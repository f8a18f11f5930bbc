"""``GET /`` from a browser: a small page that says what this server is and where to go.

``/`` is also GraphPipe's root endpoint, whose clients ``GET`` it for the model's
metadata as JSON. Browsers ask for ``text/html`` first; GraphPipe clients never do. So
only a request that prefers HTML gets the page, and everything else on ``/`` goes on to
GraphPipe unchanged.
"""

from __future__ import annotations

from html import escape

from starlette.datastructures import Headers
from starlette.responses import HTMLResponse
from starlette.types import ASGIApp, Receive, Scope, Send


def wants_html(accept: str) -> bool:
    """Whether ``text/html`` comes before any JSON type in the Accept header (browsers list it first)."""
    for item in accept.split(","):
        media = item.split(";")[0].strip().lower()
        if media in {"text/html", "application/xhtml+xml"}:
            return True
        if media in {"application/json", "*/*", "application/octet-stream"}:
            return False
    return False


def page(graphpipe_path: str, playground: bool) -> str:
    links = [
        ("/v1/models", "Models", "the OpenAI-compatible API (/v1)"),
        ("/metrics", "Metrics", "Prometheus"),
        ("/readyz", "Readiness", "whether the model is loaded"),
        (graphpipe_path, "GraphPipe metadata", "inputs and outputs as JSON"),
    ]
    if playground:
        links.insert(0, ("/playground", "Playground", "chat with the model and see its concept readouts"))
    items = "\n".join(
        f'<li><a href="{escape(href)}">{escape(name)}</a>: {escape(what)}</li>' for href, name, what in links
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>prismgate</title>
<style>body{{font:16px/1.5 system-ui,sans-serif;max-width:40em;margin:3em auto;padding:0 1em}}</style></head>
<body><h1>prismgate</h1>
<p>A language model over GraphPipe, Evergreen, Salience and an OpenAI-compatible API.</p>
<ul>
{items}
</ul>
<p>gRPC (Salience, Evergreen, health, reflection) listens on its own port (<code>--grpc-port</code>).
The documentation is the README and the <code>docs/</code> folder of the repository.</p>
</body></html>
"""


class LandingPage:
    def __init__(self, app: ASGIApp, graphpipe_path: str, playground: bool) -> None:
        self.app = app
        self.html = page(graphpipe_path, playground)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] == "/"
            and scope["method"] in {"GET", "HEAD"}
            and wants_html(Headers(scope=scope).get("accept", ""))
        ):
            await HTMLResponse(self.html)(scope, receive, send)
            return
        await self.app(scope, receive, send)
