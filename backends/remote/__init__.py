"""Backends that forward to another server over HTTP (no torch): OpenAI-compatible upstreams
here, TGI's native API in `backends.tgi`. Shared pieces: options, HTTP errors, tokenizer."""
