"""1. HTTP in, JSON or SSE out: the aiohttp app, the routes (parse -> prepare -> submit -> answer),
request preparation, the error middleware, lifecycle, the dashboard's routes and the guarded server.
The OpenAI protocol itself (schema, tools, encoders) is gateway/openai/."""
