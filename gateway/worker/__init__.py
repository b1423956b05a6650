"""6. Drives the engine: pulls from the queue, steps the engine on its own thread, publishes outputs."""
