"""Speculative decoding: draft proposers and the verification of their tokens."""
