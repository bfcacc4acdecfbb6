"""One module per Hugging Face `model_type`, each exporting `ModelArgs` and `Model` (parameter
names equal the checkpoint's), found by importlib from loading/; families import only layers/
(and `models/_gguf.py`'s protocol for their GGUF hooks)."""
