"""Command-line tools: ``python -m vime.tools.NAME``."""
