"""The models a learner trains (the built-in GPT, transformers causal LMs, a user's module), the inner optimizer,
and `diloco export` (the global model as a transformers directory)."""
