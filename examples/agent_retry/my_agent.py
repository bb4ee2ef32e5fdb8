"""An agent of your own: plain OpenAI-client code that runs the episode. grpo-cli serves the policy behind an
OpenAI-compatible endpoint (base_url, api_key), records the tokens each call sampled, and trains on them; the
number returned is the episode's reward (its `env` component)."""

from openai import OpenAI


def solve(row, prompt, base_url, api_key):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(prompt)
    for _attempt in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=32)
        text = reply.choices[0].message.content or ""
        if row["answer"] in text:
            return 1.0
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "No. Try again."}]
    return 0.0
