"""Message transport for vime actors: codec, typed records, nng sockets, shared memory, message logs.\n\nNothing here knows about RL."""
