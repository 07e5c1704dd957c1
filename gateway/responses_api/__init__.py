"""OpenAI's Responses API (`POST /v1/responses` and the stored responses' routes).

A request is translated into a chat completion request (translate.py) and runs the chat
route's path: admission, limits, routing and fallbacks, metering, tool plans. Its output
becomes typed items (output.py), answered whole or as typed server-sent events (stream.py),
and is kept, with the conversation that led to it, for `previous_response_id` and retrieval
(store.py: Redis when the gateway has one, else SQLite under the cache directory).
"""
