"""Build the tiny sentiment classifier task=reviews_classifier rewards with, and save it to ./classifier.

Nothing is downloaded: a 2-layer Llama sequence classifier over SmolLM2's tokenizer (the one grpo-cli ships),
trained for a minute on the CPU on sentences made from lexicon.py's word lists. It is a toy: it knows the
lexicon's words in a few sentence shapes, which is what lets its NEGATIVE probability rise as a rewrite turns
negative. A trained classifier (e.g. a DistilBERT fine-tuned on SST-2) is one `task.reward_model.path=` away.

    python build_classifier.py            # writes ./classifier (config, weights, tokenizer)
"""

import random
import sys

import torch
from lexicon import NEGATIVE, POSITIVE
from reviews import PRODUCTS
from transformers import LlamaConfig, LlamaForSequenceClassification

from grpo_cli.models import TINY_RANDOM, load_tokenizer

SHAPES = [
    "This {p} is {w}.",
    "The {p} was {w}, really {w2}.",
    "{W}! My {p} is {w}.",
    "I find this {p} {w}.",
    "What a {w} {p}.",
    "Honestly the {p} feels {w} and {w2}.",
    "{W} {p}, {w2} experience.",
]


def sentences(words, n, rng):
    words = sorted(words)
    out = []
    for _ in range(n):
        w, w2 = rng.choice(words), rng.choice(words)
        out.append(rng.choice(SHAPES).format(p=rng.choice(PRODUCTS), w=w, w2=w2, W=w.capitalize()))
    return out


def main(out_dir="classifier", steps=100, seed=0):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(TINY_RANDOM)  # SmolLM2's tokenizer, shipped with grpo-cli
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=2,
        id2label={0: "NEGATIVE", 1: "POSITIVE"},
        label2id={"NEGATIVE": 0, "POSITIVE": 1},
    )
    model = LlamaForSequenceClassification(config)
    texts = sentences(NEGATIVE, 2000, rng) + sentences(POSITIVE, 2000, rng)
    labels = [0] * 2000 + [1] * 2000
    order = list(range(len(texts)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        batch = rng.sample(order, 32)
        inputs = tokenizer([texts[i] for i in batch], return_tensors="pt", padding=True)
        loss = model(**inputs, labels=torch.tensor([labels[i] for i in batch])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    model.eval()
    probe = ["This blender broke after a week. Terrible, I want a refund.", "This blender works perfectly. I love it!"]
    with torch.no_grad():
        probs = torch.softmax(model(**tokenizer(probe, return_tensors="pt", padding=True)).logits, -1)[:, 0]
    for text, p in zip(probe, probs.tolist(), strict=True):
        print(f"P(NEGATIVE) = {p:.3f}  {text}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"saved {out_dir}/")


if __name__ == "__main__":
    main(*sys.argv[1:2])
