"""Slow, obviously-correct twins of the fast path. They share no code with it."""
