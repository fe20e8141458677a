"""Quantization codecs, rotation, scales files and overflow accounting. Imports nothing else of ours."""
