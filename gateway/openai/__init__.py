"""OpenAI's API: /v1/chat/completions, /v1/completions, /v1/models."""
