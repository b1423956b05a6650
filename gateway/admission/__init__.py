"""2. Who may ask, and how much: API keys, authentication, per-key limits and usage."""
