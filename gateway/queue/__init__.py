"""The request queue between the HTTP gateway and the engine workers (in-process now, Redis later)."""

from gateway.queue.base import ErrorOutput, QueueClosed, QueueFull, QueueItem, RequestQueue, Subscription
from gateway.queue.memory import MemoryQueue

__all__ = ["ErrorOutput", "MemoryQueue", "QueueClosed", "QueueFull", "QueueItem", "RequestQueue", "Subscription"]
