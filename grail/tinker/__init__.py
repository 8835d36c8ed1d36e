"""grail-tinker: the Tinker REST protocol over a LoRA trainer and the built-in engine
(docs/tinker.md)."""
