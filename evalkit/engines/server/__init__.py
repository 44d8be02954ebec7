"""The server engine (`--model server`, lm-eval type `evalkit-server`): an OpenAI-compatible server's logprobs.

`model` (the lm-eval model type and its HTTP client), `resolve` (its model args and what it refuses).
It has no first-step engine of its own: the server computes the first step.
"""
