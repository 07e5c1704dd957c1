"""A TGI deployment's options: those of every HTTP backend. `base_url` is the server's root;
`model`, when given, is sent as the `x-model` header (how a multi-model Switchyard picks)."""

from __future__ import annotations

from backends.remote.options import UpstreamOptions


class TGIOptions(UpstreamOptions):
    """TGI's /generate_stream has no model field and no chat: see `tokenizer`."""
