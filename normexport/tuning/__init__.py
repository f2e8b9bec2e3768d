"""The exact forms of a fused norm timed against each other: autotune and the forms it chooses
from."""
