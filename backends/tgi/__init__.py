"""A TGI server through its native `/generate_stream` (no torch; see `backends.remote`)."""
