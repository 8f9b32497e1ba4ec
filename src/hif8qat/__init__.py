"""hif8qat: HiF8 W8A8 quantization-aware training with delayed tensor scaling."""

__version__ = "0.1.0"
