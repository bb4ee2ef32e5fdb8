"""The network surface: the OpenAI-compatible endpoint over the policy (server.py, requests.py), an
agent's calls recorded as its episode (recording.py), vLLM's own server behind the same recording
(vllm_front.py), and verifiers' tasksets as an agent (verifiers_agent.py)."""
