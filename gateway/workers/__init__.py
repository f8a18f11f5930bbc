"""Several front-end processes over one engine (``serve --workers N``, docs/architecture.md).

* :mod:`~prismgate.workers.wire`: the typed link between our own processes (msgpack frames of
  tagged structs over a Unix socket, batched per event-loop tick; no pickle);
* :mod:`~prismgate.workers.host`: the engine host, the one process that holds the engines,
  the engine pool (admission, fair share, memory budget) and, with the in-memory store, the
  sessions and per-key quota counts;
* :mod:`~prismgate.workers.remote`: what a front-end builds its service from: a pool,
  a session store and a quota that forward to the host;
* :mod:`~prismgate.workers.supervisor`: the parent: binds the ports once, starts the host
  and the N front-ends, and stops them in order on SIGTERM.
"""
