"""Typed contracts and formats between learners, syncers, the runtime and the operator: messages, the wire format, fragments, tokens, TLS."""
