"""HTTP plumbing every route shares: OpenAI-shaped errors (``errors``), request ids
(``request_id``), CORS and ``OPTIONS`` (``cors``), uvicorn's limits (``limits``), the JSON
body (``body``), server-sent events and client disconnects (``sse``).

The bottom of server/: nothing here imports a server module outside http/.
"""
