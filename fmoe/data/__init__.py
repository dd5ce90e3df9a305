"""Training data: the embedded corpus, tokenized corpus directories, and batches.

- ``embedded``: Python's bundled documentation as bytes (the zero-setup default) and
  the tensor helpers the examples use (``corpus_bytes``, ``train_heldout_split``,
  ``random_windows``, ``tiled_windows``).
- ``tokens``: the on-disk format (``tokens.bin`` + ``meta.json`` [+ ``tokenizer.json``]),
  ``open_corpus`` / ``embedded_corpus`` -> ``TokenCorpus``, ``check_vocab``,
  ``check_corpus`` (every id read once), the tokenizer a run records
  (``tokenizer_record``, ``recorded_tokenizer``), the unigram baseline.
- ``batches``: batches that depend on ``(seed, step)`` only (``sample_batch``,
  ``heldout_batches``; ``train_batch`` and ``heldout_set`` also take a packed corpus's
  rows, with ``loss_mask`` and ``segments``).
- ``tokenizer_match``: what "the same tokenizer" means (``tokenizer_digest``: a digest of
  its canonical JSON; ``same_tokenizer``), the tokenizer a corpus records in its
  ``meta.json`` (``"tokenized_with"``) and ``check_model_tokenizer``, which refuses to
  fine-tune a Hugging Face model on a corpus of another tokenizer.
- ``prepare``: text files -> a corpus directory, the module behind
  ``python -m fmoe.data prepare FILE_OR_DIR... --out DIR [--tokenizer tokenizer.json]``.
"""

from . import prepare
from .embedded import corpus_bytes, random_windows, tiled_windows, train_heldout_split
from .batches import check_packed_seq, heldout_batches, heldout_rows, heldout_set, sample_batch, train_batch
from .tokens import (
    PackedRows,
    TokenCorpus,
    corpus_unigram,
    check_corpus,
    check_vocab,
    corpus_fingerprint,
    embedded_corpus,
    open_corpus,
    recorded_tokenizer,
    tokenizer_record,
    unigram_cross_entropy,
)
from .tokenizer_match import check_model_tokenizer, same_tokenizer, tokenizer_digest

__all__ = ["PackedRows", "TokenCorpus", "check_model_tokenizer", "check_packed_seq", "corpus_unigram", "heldout_rows",
           "heldout_set", "train_batch", "check_corpus", "check_vocab", "corpus_bytes", "corpus_fingerprint",
           "embedded_corpus",
           "heldout_batches", "open_corpus", "prepare", "random_windows", "recorded_tokenizer", "same_tokenizer",
           "sample_batch", "tiled_windows", "tokenizer_digest", "tokenizer_record", "train_heldout_split",
           "unigram_cross_entropy"]
