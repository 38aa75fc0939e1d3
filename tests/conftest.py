"""Shared test settings."""

from hypothesis import settings

# CI runs on two shared cores: a wall-clock deadline per example would make the
# property tests fail on a slow moment rather than on a wrong answer.
settings.register_profile("attnlab", deadline=None)
settings.load_profile("attnlab")
