"""Small reference models and data for examples, tests and benchmarks (random init, no downloads)."""

from zerotrain.models.gpt import GPT, GPTConfig, GPTOutput
from zerotrain.models.text import PythonSourceText, TokenBlocks

__all__ = ["GPT", "GPTConfig", "GPTOutput", "PythonSourceText", "TokenBlocks"]
