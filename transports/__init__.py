"""Message transport for vime actors: codec, typed records, nng sockets, shared memory, message logs.

Nothing here knows about RL."""
