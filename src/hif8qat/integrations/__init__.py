"""Ready-made glue between the library and other trainers: ``hf`` (``transformers.Trainer``). Each module imports
its trainer's library; the library core never imports them."""
