"""Objects the gateway keeps for their owner: stored Responses (and, next, files and batches)."""
