"""Agentic rollouts: tools the model calls, and the sandbox every call runs in."""
