"""Typed contracts and formats between learners, syncers, the runtime, the operator and chaos: messages, the wire
format and the down-link, fragments and the shard map, tokens, TLS, spare-pod assignments and run files."""
