"""One module per actor role: ``buffer``, ``router``, ``rollout``, ``reward``, ``trainer``.

Actors know messages (``vime.messages``, ``vime.weights``) and engines (``vime.backends``),
not sockets; the runtime (``vime.runtime``) carries their messages.
"""
