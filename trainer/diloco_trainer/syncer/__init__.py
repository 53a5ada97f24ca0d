"""The syncer service (`diloco syncer`): global fragments and their versions, merges and the outer optimizer, durable
state (checkpoints, spool, merge journal), takeover by a warm standby, limits on what learners send, the HTTP API."""
