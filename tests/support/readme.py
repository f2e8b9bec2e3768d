"""The README as the tests read it: its text, and the number words in which its quickstart
counts the kinds of rewrite."""

from __future__ import annotations

from pathlib import Path

#: The README's text.
README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
#: The number words from zero to twenty, in order (``WORDS.index("three") == 3``).
WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
]  # fmt: skip
