import pytest
import torch

from grpo_cli.core import tokenize_prompt_and_output, tokenize_prompt_and_output_ids

BOS = 2


class CharTokenizer:
    """One token per character, id = ord(char); prepends BOS when asked for special tokens."""

    def __init__(self, pad_token_id: int | None = 0, eos_token_id: int | None = 1) -> None:
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(char) for char in text]
        return [BOS, *ids] if add_special_tokens else ids

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        return {"input_ids": [self.encode(text, add_special_tokens) for text in texts]}


def test_tokenize_prompt_and_output_exact_ids_labels_mask() -> None:
    batch = tokenize_prompt_and_output(["ab", "c"], ["x", "yzw"], CharTokenizer())
    a, b, c, w, x, y, z = (ord(ch) for ch in "abcwxyz")
    # full sequences: [a b x] + pad -> [a b x 0];  [c y z w]; L = 4, so every tensor is (2, 3)
    # response positions in the full sequences: [0 0 1 0] and [0 1 1 1]; shifted by one for the labels
    assert batch["input_ids"].tolist() == [[a, b, x], [c, y, z]]
    assert batch["labels"].tolist() == [[b, x, 0], [y, z, w]]
    assert batch["response_mask"].tolist() == [[False, True, False], [True, True, True]]
    assert batch["input_ids"].dtype == torch.long
    assert batch["labels"].dtype == torch.long
    assert set(batch) == {"input_ids", "labels", "response_mask"}


def test_tokenize_pads_with_eos_when_no_pad_token() -> None:
    batch = tokenize_prompt_and_output(["a", "a"], ["b", "bcd"], CharTokenizer(pad_token_id=None, eos_token_id=1))
    # row 0: [a b 1 1] -> labels [b 1 1]
    assert batch["labels"][0].tolist() == [ord("b"), 1, 1]
    assert batch["response_mask"][0].tolist() == [True, False, False]


def test_tokenize_without_pad_or_eos_raises() -> None:
    with pytest.raises(ValueError, match="pad_token_id"):
        tokenize_prompt_and_output(["a"], ["b"], CharTokenizer(pad_token_id=None, eos_token_id=None))


def test_tokenize_ids_variant() -> None:
    batch = tokenize_prompt_and_output_ids([[5, 6, 7], [8]], [[9], [10, 11]], pad_token_id=-1)
    # full: [5 6 7 9] and [8 10 11 -1]; response at [3] and [1, 2]
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 10, 11]]
    assert batch["labels"].tolist() == [[6, 7, 9], [10, 11, -1]]
    assert batch["response_mask"].tolist() == [[False, False, True], [True, True, False]]


def test_tokenize_ids_empty_output_has_empty_mask() -> None:
    batch = tokenize_prompt_and_output_ids([[1, 2], [3]], [[], [4, 5]], pad_token_id=0)
    assert batch["response_mask"].tolist() == [[False, False], [True, True]]


def test_tokenize_length_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="2 prompts but 1 outputs"):
        tokenize_prompt_and_output_ids([[1], [2]], [[3]], pad_token_id=0)
