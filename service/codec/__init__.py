"""Runs in the HTTP workers: request and response bodies <-> float32 arrays (JSON, safetensors)."""
