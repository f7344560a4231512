"""Developer tools, each run as ``python -m vime.devtools.NAME``.

Not the model's tools: those are ``vime.agent.tools``.
"""
