"""Evaluation: offline acceptance on held-out shards, online acceptance/throughput in vLLM, plots."""
