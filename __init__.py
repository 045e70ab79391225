"""gqakit: turn multi-head-attention language models into grouped-query-attention ones."""

__version__ = "0.1.0"
