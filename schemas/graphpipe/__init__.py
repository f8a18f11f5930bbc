"""GraphPipe's flatbuffer schema (``schemas/graphpipe.fbs``) and the code generated from it.

``prismgate.schemas.graphpipe.fb.graphpipe_generated`` is flatc's output (regenerate with
``python scripts/generate_flatbuffers.py``); hand-written code never goes under ``fb/``.
"""
