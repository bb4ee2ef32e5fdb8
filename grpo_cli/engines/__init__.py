"""Sampling: the engine interface (base.py), the transformers engine and its decode loop, vLLM's
offline engine and its server, the one sampling function; build.py picks the engine rollout.engine names."""
