"""The syncer service: global fragments, merges, outer optimizer, durable state and the HTTP API."""
