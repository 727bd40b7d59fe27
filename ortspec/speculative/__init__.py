"""The speculative layer: requests, draft sources, the decoder with the speculative step, commit strategies, stats."""
