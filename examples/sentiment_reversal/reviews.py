"""The training and held-out prompts, generated (the assignment "Tiny GRPO-based RL Fine-Tuning":
"programmatically generate your training set").

grpo-run calls make_reviews(n, seed): (task.n_train, task.data_seed) for training and (task.n_eval,
task.data_seed + 1) for the held-out set, so the two sets differ and each is the same on every run.
"""

import random

PRODUCTS = [
    "coffee maker",
    "backpack",
    "phone case",
    "desk lamp",
    "blender",
    "novel",
    "hotel",
    "restaurant",
    "headphones",
    "running shoes",
    "tent",
    "keyboard",
    "water bottle",
    "museum tour",
    "bike helmet",
]
PRAISE = [
    "works perfectly",
    "is beautifully made",
    "exceeded my expectations",
    "is worth every penny",
    "made my week",
    "is a joy to use",
    "arrived quickly and in great shape",
    "is sturdy and reliable",
]
FEELINGS = ["I love it", "highly recommended", "I would buy it again", "five stars", "absolutely wonderful"]


def make_reviews(n, seed):
    """n positive reviews, each a row {"product", "review"}."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        product = rng.choice(PRODUCTS)
        review = f"This {product} {rng.choice(PRAISE)}. {rng.choice(FEELINGS).capitalize()}!"
        rows.append({"product": product, "review": review})
    return rows
