"""Remote OpenAI-compatible providers: the backend and its streams, retry classification, breakers."""
