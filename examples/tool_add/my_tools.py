"""The tool the model may call: a plain function with type hints and a docstring with an Args: line for each
argument (TRL's convention; transformers' get_json_schema turns it into what the chat template shows the model)."""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b
