"""Adapters that route other libraries' attention through attnlab."""
