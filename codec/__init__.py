"""wcodec: LLM checkpoints that stay compressed on disk. The `.wcodec` format and its
pure-Python/NumPy reference encoder and decoder. Importable without a GPU or a compiler."""
__version__ = "0.1.0"
