"""Remote OpenAI-compatible providers: the backend and its streams (backend.py), each request's tries
over its provider chain (tries.py), one provider and failure classification (provider.py), breakers."""
