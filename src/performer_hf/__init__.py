"""performer-hf: Performers (FAVOR+ linear attention) as a Hugging Face model family."""

__version__ = "0.1.0"
