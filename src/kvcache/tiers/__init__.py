"""The tiers of prefix blocks below the engine's pool: a folder on disk (`disk_store`), Redis shared
by replicas (`redis_store`), both as one chain (`tiered_store`), over what every tier shares
(`block_store`) and the checked bytes of a block (`block_codec`). The engine talks to them through
one connector (`connector.KVConnector`, after vLLM's KV connector: lookup at submit, load before
the step, save after it), `store_tier.TierConnector` the one that reads and writes a store;
`open.open_store` and `open.open_tiers` build a store from what a user gave.

Nothing is imported here: the engine and the command line import the module they need."""
