"""TGI's API: /generate, /generate_stream, /, /info."""
