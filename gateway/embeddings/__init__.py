"""POST /v1/embeddings: OpenAI's embeddings API for models whose task is `embed`."""
