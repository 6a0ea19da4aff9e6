"""Several engine replicas behind one OpenAI-compatible server, on Ray Serve (`kvcache serve
--replicas N`): `prefix_index` (which replica holds which prompt blocks: standard library only),
`router` (Ray Serve's request router that sends a prompt to the replica holding its longest
prefix, load as the tie-breaker), `deployment` (one engine replica, a Ray Serve deployment) and
`replica_set` (the server's engine on the driver side: it submits to the replicas and streams
their replies back). Ray is an optional extra (`kvcache[ray]`): nothing here is imported by the
single-process server.
"""
