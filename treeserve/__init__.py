"""treeserve: an asyncio actor runtime that serves LLMs with tree-based speculative inference."""

__version__ = "0.1.0"
