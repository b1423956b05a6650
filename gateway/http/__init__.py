"""1. HTTP in, JSON or SSE out: the aiohttp app, the OpenAI routes and schema, request preparation,
errors, middleware and the guarded server."""
