"""Engine pools: replicas of local capacity on other servers (vLLM, SGLang, llama-server, Sluice),
routed by their own load signals, with Sluice's tier order kept in front of them."""
