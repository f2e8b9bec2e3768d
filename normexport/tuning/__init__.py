"""Alternatives timed against each other: other optimizers' variants (bench) and the exact
forms autotune chooses from."""
