"""Long real text already on the machine, written by no one here, as evaluation context.

Two kinds, because attention behaves differently on them: source code (a large module of
Python's own standard library) and English prose (a license text; for long contexts, the
Python language reference's topics that every CPython ships for `help()`). Prompts are the
first N tokens of the text; teacher-forced evaluations continue with the tokens that follow.
"""
from __future__ import annotations

import os
import sysconfig
import typing

_PROSE_CANDIDATES = [
    "/usr/share/common-licenses/GPL-3",  # Debian/Ubuntu: ~7.7K tokens
    os.path.join(sysconfig.get_path("stdlib"), "LICENSE.txt"),  # Python's own: ~3.8K tokens
]


def text_path(name: str) -> str:
    """`code`: the source of the `typing` module (~30K tokens); `prose`: a long license text."""
    if name == "code":
        return typing.__file__
    if name == "prose":
        for path in _PROSE_CANDIDATES:
            if os.path.exists(path):
                return path
        raise ValueError(f"no prose text found (looked for {', '.join(_PROSE_CANDIDATES)})")
    if os.path.exists(name):
        return name  # any file the user names
    raise ValueError(f"unknown text {name!r}: use code, prose, manual or a file path")


def text_content(name: str) -> str:
    """`manual`: the language reference's topics (`pydoc_data.topics`, ~100K tokens of English,
    in a fixed order); otherwise the file `text_path(name)`."""
    if name == "manual":
        from pydoc_data.topics import topics
        return "\n\n".join(topics[k] for k in sorted(topics))
    with open(text_path(name), encoding="utf-8", errors="replace") as f:
        return f.read()


def text_tokens(tokenizer, name: str, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the text; an error if it is shorter."""
    ids = tokenizer.encode(text_content(name), add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"text {name!r} has {len(ids)} tokens, fewer than the {num_tokens} asked for")
    return ids[:num_tokens]


def module_source(name: str) -> str:
    """The source of a standard library module (the same on every machine of a Python version)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not (spec.origin or "").endswith(".py"):
        raise ValueError(f"{name!r} is not a standard library module with Python source")
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()
