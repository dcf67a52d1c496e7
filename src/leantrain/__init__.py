"""leantrain: from a compute budget to a validated, self-healing LLM training run."""

__version__ = "0.1.0"
