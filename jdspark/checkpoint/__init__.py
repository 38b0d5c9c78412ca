"""Checkpoint formats: safetensors I/O, the official <-> HF <-> parameter-path name table, loading."""
