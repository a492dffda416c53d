"""rollwise: RL post-training for LLMs built as infrastructure."""

__version__ = "0.1.0"
