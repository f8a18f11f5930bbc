"""Where sessions live: one interface, two backends.

* :class:`~prismgate.core.stores.memory.InProcessStore` (the default): sessions in this
  process's memory; a restart loses them and a second replica cannot see them.
* :class:`~prismgate.core.stores.redis_store.RedisStore`: sessions in Redis, shared by
  every gateway replica and kept across restarts (needs the ``redis`` package).
"""

from prismgate.core.stores.base import SessionStore, busy
from prismgate.core.stores.memory import InProcessStore

__all__ = ["InProcessStore", "SessionStore", "busy"]
