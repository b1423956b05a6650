"""`sluice bench`: load any OpenAI-compatible base URL (Sluice or not) and report what it did.

workload.py builds the requests (synthetic lengths, a shared-prefix RAG shape, recorded JSONL, or
embeddings inputs) and the tier mix; client.py sends one streamed chat request, or one embeddings
request, through the `openai` SDK and times it; runner.py paces a level (a concurrency or a Poisson
rate); stats.py turns results into figures (percentiles, goodput under an SLO, inputs/s, cost);
usage.py reads a Sluice gateway's `GET /v1/usage` before and after; report.py prints the tables and
`--compare`; plot.py draws `--plot`; cli.py wires them to the command line.

It imports nothing of the gateway, the engine or the kernels (tests/test_architecture.py checks it):
it is a client like any other, so it measures Sluice and any other server the same way, over HTTP.
"""
