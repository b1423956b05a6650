"""4. Where a request is served: the local engine through the queue (`local`), or a chain of remote
OpenAI-compatible providers (`remote/`)."""
