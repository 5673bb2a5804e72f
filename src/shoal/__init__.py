"""Shoal: composable sandboxes for agentic RL."""
