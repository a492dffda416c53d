"""What the HTTP servers share (engine server, router, pool, agent proxy): request limits and error envelopes."""
