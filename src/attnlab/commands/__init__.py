"""One module per group of `attnlab` verbs; `attnlab.cli` discovers them."""
