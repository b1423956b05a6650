"""3. Local or remote: the routing decision, the queue-wait estimate, accounting and fallback."""
