"""The API's own description: ``GET /openapi.json`` and ``GET /docs``.

``spec`` (the OpenAPI 3.1 document, built from the app's routes and the request models of
openai/, and the two routes), ``models`` (pydantic models of the response bodies and of the
request fields read outside the request models, for the document only).
"""
