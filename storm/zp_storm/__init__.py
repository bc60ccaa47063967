"""The storm benchmark: the same burst against the same simulated server, with and without zp-client."""
