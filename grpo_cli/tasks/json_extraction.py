"""JSON extraction: read a short passage about a person and reply with strict JSON holding the asked-for fields.

Reward 1 iff `json.loads` accepts the whole response (surrounding whitespace aside: no code fences, no text
around it), the result is an object with exactly the requested keys (none missing, none extra), AND every
value matches the passage: strings compare ignoring letter case and repeated spaces, integers must be JSON
numbers of equal value (`"34"` is not 34). Values must match because keys alone are trivially gamed
(`{"name": ""}`). format_reward is the first part (strict JSON object, exact keys); answer_reward is the
fraction of requested keys whose value matches (partial credit to watch, or to weight in); "unparseable" is 1
when the response is not a JSON object at all.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from grpo_cli.config.fields import positive
from grpo_cli.tasks.base import Example, SanityCase, TaskSpec, format_prompt
from grpo_cli.tasks.schema import TaskConfig

FIRST_NAMES = "Ana Ben Chloe Dev Elif Farid Grace Hugo Ines Jamal Kira Liam Mina Noah Olga Pedro Rosa Sami Tara Yuki"
LAST_NAMES = "Silva Novak Okafor Tanaka Larsen Moreau Haddad Kowalski Nguyen Rossi Schmidt Costa Ivanova Park Reyes"
CITIES = "Lima Oslo Cairo Lisbon Denver Osaka Nairobi Krakow Dublin Hanoi Austin Porto Quito Seoul Tunis"
OCCUPATIONS = (
    "nurse", "pilot", "baker", "teacher", "architect", "plumber", "chemist", "librarian", "carpenter", "journalist",
    "dentist", "farmer", "translator", "electrician", "florist",
)  # fmt: skip

PASSAGE_YEAR = 2024

# Key -> (description shown in the prompt, value type).
FIELDS: dict[str, tuple[str, type]] = {
    "name": ("string: full name", str),
    "age": ("integer: age in years", int),
    "city": ("string: the city", str),
    "occupation": ("string: the job", str),
    "start_year": ("integer: the year the job started", int),
}

PASSAGES = (
    "{name} is a {age}-year-old {occupation} who lives in {city}. {first} started the job in {start_year}.",
    "Born {age} years ago, {name} now works as a {occupation} in {city}, a job {first} has held since {start_year}.",
    "In {start_year}, {name} moved to {city} to work as a {occupation}. Today {first} is {age} years old.",
)

INSTRUCTION = (
    "Read the passage and reply with only a JSON object (no code fences, no other text) with exactly these "
    "keys: {keys}.\n\nPassage: {passage}"
)


def _same_text(got: object, want: str) -> bool:
    return isinstance(got, str) and " ".join(got.split()).casefold() == " ".join(want.split()).casefold()


def value_matches(got: object, want: object) -> bool:
    """Strings: equal ignoring case and repeated spaces. Numbers: a JSON number of equal value (not a bool)."""
    if isinstance(want, str):
        return _same_text(got, want)
    if isinstance(want, int | float) and not isinstance(want, bool):
        return isinstance(got, int | float) and not isinstance(got, bool) and got == want
    return got == want


def json_reward_fn(response: str, ground_truth: dict[str, Any]) -> dict[str, float]:
    """{"reward": strict JSON, exact keys, all values right; "format_reward": strict JSON with exact keys;
    "answer_reward": fraction of values right; "unparseable": not a JSON object}."""
    if not ground_truth:
        raise ValueError("json reward needs at least one required key in the ground truth")
    try:
        parsed = json.loads(response)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; deep nesting raises RecursionError
        parsed = None
    if not isinstance(parsed, dict):
        return {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0, "unparseable": 1.0}
    exact_keys = set(parsed) == set(ground_truth)
    correct = sum(value_matches(parsed.get(key), want) for key, want in ground_truth.items())
    return {
        "reward": float(exact_keys and correct == len(ground_truth)),
        "format_reward": float(exact_keys),
        "answer_reward": correct / len(ground_truth),
        "unparseable": 0.0,
    }


def build_json_examples(
    split: str, n: int | None, seed: int, prompt_style: str = "chat", fields_per_prompt: int = 3
) -> list[Example]:
    """Deterministic synthetic passages; each asks for `fields_per_prompt` of the five fields."""
    if n is None:
        n = 2000 if split == "train" else 256
    if not 1 <= fields_per_prompt <= len(FIELDS):
        raise ValueError(f"task.fields_per_prompt={fields_per_prompt} must be between 1 and {len(FIELDS)}")
    rng = random.Random(f"json/{split}/{seed}")
    examples = []
    for _ in range(n):
        first, last = rng.choice(FIRST_NAMES.split()), rng.choice(LAST_NAMES.split())
        age = rng.randint(19, 79)
        record = {
            "name": f"{first} {last}",
            "age": age,
            "city": rng.choice(CITIES.split()),
            "occupation": rng.choice(OCCUPATIONS),
            # Passages are set in PASSAGE_YEAR; nobody starts a job before turning 18.
            "start_year": rng.randint(max(1990, PASSAGE_YEAR - age + 18), PASSAGE_YEAR),
        }
        passage = rng.choice(PASSAGES).format(first=first, **record)
        chosen = set(rng.sample(list(FIELDS), fields_per_prompt))
        keys = [key for key in FIELDS if key in chosen]  # a stable key order in every prompt
        question = INSTRUCTION.format(keys=", ".join(f'"{key}" ({FIELDS[key][0]})' for key in keys), passage=passage)
        truth = {key: record[key] for key in keys}
        examples.append(Example(format_prompt(question, prompt_style), truth, {"question": question}))
    return examples


def _case(response: str, expected: float, why: str) -> SanityCase:
    return SanityCase({"name": "Ana Silva", "age": 34}, response, expected, why)


SANITY_CASES = (
    _case('{"name": "Ana Silva", "age": 34}', 1.0, "strict JSON, both keys right"),
    _case('\n{"age": 34,\n "name": "ana  silva"}\n', 1.0, "key order, case, spaces and newlines do not matter"),
    _case('```json\n{"name": "Ana Silva", "age": 34}\n```', 0.0, "code fences are not strict JSON"),
    _case('Here it is: {"name": "Ana Silva", "age": 34}', 0.0, "text around the JSON"),
    _case("{'name': 'Ana Silva', 'age': 34}", 0.0, "single quotes are not JSON"),
    _case('{"name": "Ana Silva"}', 0.0, "a required key is missing"),
    _case('{"name": "Ana Silva", "age": 34, "city": "Lima"}', 0.0, "an extra key"),
    _case('{"name": "Ana Silva", "age": "34"}', 0.0, "age must be a JSON number"),
    _case('{"name": "Ana Silva", "age": 35}', 0.0, "wrong value"),
)


@dataclass
class JsonTaskConfig(TaskConfig):
    """task=json's keys."""

    fields_per_prompt: int = positive(
        3, help="How many of the five fields (name, age, city, occupation, start_year) each prompt asks for."
    )


JSON_TASK = TaskSpec(
    schema=JsonTaskConfig,
    name="json",
    reward_fn=json_reward_fn,
    build=build_json_examples,
    sanity_cases=SANITY_CASES,
    options=("fields_per_prompt",),
)
