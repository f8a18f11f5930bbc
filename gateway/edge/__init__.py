"""The HTTP edge: what every HTTP request and WebSocket passes before a route sees it.

Each module is one ASGI middleware with one job (auth, the error path, ...);
:func:`prismgate.app.create_app` stacks them in order.
"""
