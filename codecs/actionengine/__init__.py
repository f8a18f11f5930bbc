"""ActionEngine's wire (google-deepmind/actionengine) on the Evergreen WebSocket, ``/evergreen``.

ActionEngine is the maintained implementation of Evergreen's model of nodes, chunks and
actions; its client library speaks msgpack frames in cppack's layout (:mod:`.wire`). The
endpoint tells its frames from Evergreen's by their first byte; each frame is translated
into the Evergreen session's messages and back (:mod:`.translate`), and :mod:`.link` adds
ActionEngine's conventions (settings on a ``config`` input, status nodes, half-close).
See docs/actionengine.md.
"""
