"""A tiny BERT for sentence-transformers, built here and offline: no download anywhere.

A random-init ``BertModel`` (with its pooler, which sentence-transformers' mean pooling leaves
unused) and a word-level tokenizer over a small vocabulary, saved to a folder and loaded through
sentence-transformers' ``Transformer`` and ``Pooling`` modules.
"""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = "[PAD] [UNK] [CLS] [SEP] [MASK] a b c d e f g h i j k l m n o p".split()
TEXTS = ["a b c d e f", "g", "h i", "j k l m n o p a", "b c", "d", "e f g h", "i j k"]


def save_tiny_bert(path: Path, *, hidden: int = 16, layers: int = 1, dropout: float = 0.0, pieces: bool = False,
                   seed: int = 0) -> Path:
    """Write the tokenizer and a random ``BertModel`` to ``path``; return ``path``.

    ``pieces``: a WordPiece tokenizer over single characters (any ASCII text gets its own tokens), instead
    of whole words from :data:`WORDS`.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    if pieces:
        characters = [chr(code) for code in range(33, 127)]
        vocabulary = [*WORDS[:5], *characters, *(f"##{character}" for character in characters)]
        model = models.WordPiece({piece: i for i, piece in enumerate(vocabulary)}, unk_token="[UNK]")
        tokenizer = Tokenizer(model)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    else:
        vocabulary = WORDS
        tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(path)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocabulary), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=2 * hidden, max_position_embeddings=512, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout)
    BertModel(config).save_pretrained(path)
    return path


def sentence_model(path: Path, *, hidden: int = 16) -> object:
    """The ``SentenceTransformer`` of the saved BERT with mean pooling, on the CPU."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    return SentenceTransformer(modules=[Transformer(str(path)), Pooling(hidden, "mean")], device="cpu")
