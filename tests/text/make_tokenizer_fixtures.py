#!/usr/bin/env python3
"""Tokenizer parity fixtures for kiln::text::Tokenizer (tests/text/tokenizer_test.cpp).

Needs the `tokenizers` package (pip install tokenizers). Trains two small BPE tokenizers on the
bundled corpus (data/tinyshakespeare.txt) and writes four tokenizer.json files in the styles of
real models, each with the ids the tokenizers library gives for a set of texts:

    python3 tests/text/make_tokenizer_fixtures.py [--out tests/text/data]

    llama3.json      byte-level BPE: Split with the Llama 3 regex (Isolated) + ByteLevel without
                     its regex, ignore_merges, <|begin_of_text|> by TemplateProcessing inside a
                     Sequence post-processor, merges as ["a", "b"] arrays
    gpt2.json        the same model with GPT-2's ByteLevel pre-tokenizer (its built-in regex),
                     the ByteLevel post-processor, added tokens with lstrip, rstrip,
                     single_word and normalized set
    llama2.json      SentencePiece-style BPE as Llama 2 / Mistral ship it: normalizer
                     Prepend("▁") + Replace(" ", "▁"), byte_fallback, fuse_unk, no
                     pre-tokenizer, decoder Replace/ByteFallback/Fuse/Strip, "<s> $A",
                     merges as "a b" strings; added "hello" (normalized) and "<mask>"
                     (special, single_word, rstrip)
    metaspace.json   the same model behind the Metaspace pre-tokenizer (prepend_scheme "first",
                     split false) and decoder Sequence[ByteFallback, Metaspace]
    expected.json    {"<name>": [{"text", "ids" (add_special_tokens), "ids_plain" (without),
                     "decoded" (decode(ids)), "decoded_skip" (skip_special_tokens)}...], ...,
                     "corpus": {"<name>": {"count", "checksum"}}}: the whole corpus encoded
                     (no special tokens), its length and sum((i % 997 + 1) * id_i)

Every file stays well under 200 KB.
"""
import argparse
import json
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "..", "data", "tinyshakespeare.txt")

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

EXTRA_TEXTS = [
    "",
    " ",
    "Hello world",
    " leading space",
    "trailing space ",
    "  two  spaces   three    four\t\ttabs\n\nnewlines\r\ncrlf",
    "   \n  \n\n   ",
    "Café naïve façade — “quoted” ‘single’ …",
    "東京 北京 서울 Москва ελληνικά עברית العربية",
    "emoji 😀 👍🏽 👩‍👩‍👧 🎉🎉🎉",
    "numbers 1 12 123 1234 12345 3.14159 1,000,000",
    "It's we'll they're I'VE don'T 'S",
    "<|begin_of_text|>inline<|end_of_text|> specials",
    "no space<|end_of_text|>after",
    "<s>Hello</s> and <unk> inline",
    "a <s> b",
    "mask <mask> here and  <mask>twice",
    "ROMEO: O, she doth teach the torches to burn bright!",
    "\u00a0non-breaking\u3000ideographic\u2003em space",
    "tab\tinside\x0bvertical\x0cform",
    "zero\u200bwidth and combining e\u0301",
    # White space as Unicode defines it (what the library's regex \s matches): U+0085 is,
    # U+180E, U+200B and U+FEFF are not.
    "nel\u0085'll mongolian\u180e'll \u2028line \ufeffbom \u1680ogham\u205f'd",
    "____▁▁ metaspace ▁ chars",
    "<0x41> looks like a byte token",
    "x" * 300,
    "hello Hello hellothere say hello",
    "thee, thee' é thee e\u0301 thee_thee",
    "[B]  x  [B]y[B]",
    "a<mask>b <mask>  c é<mask> e\u0301<mask>",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
]


def corpus_texts(corpus):
    lines = corpus.split("\n")
    picks = [lines[i] for i in range(0, len(lines), len(lines) // 40)][:40]
    picks.append("\n".join(lines[100:112]))  # a paragraph with its newlines
    return picks


def train_byte_level(corpus_path):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, show_progress=False,
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([corpus_path], trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))]),
    ])
    return tok


def gpt2_from(llama3):
    spec = json.loads(llama3.to_str())  # the same vocab and merges
    spec["model"]["ignore_merges"] = False
    spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False,
                             "trim_offsets": True, "use_regex": True}
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True,
                              "trim_offsets": False, "use_regex": True}
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True, normalized=False)])
    tok.add_tokens([AddedToken(" ROMEO", normalized=False),
                    AddedToken(" thee", normalized=True, single_word=True),
                    AddedToken("[B]", lstrip=True, rstrip=True, normalized=False)])
    return tok


def train_sentencepiece(corpus_path):
    """BPE over ▁-marked words, then the vocabulary laid out as Llama 2's: <unk>, <s>, </s>,
    the 256 byte tokens <0x00>..<0xFF>, then the learned tokens."""
    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always",
                                                 split=True)
    trainer = trainers.BpeTrainer(vocab_size=1200, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"])
    tok.train([corpus_path], trainer)
    spec = json.loads(tok.to_str())
    learned = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token, _ in learned:
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for t in ["<unk>", "<s>", "</s>"]]
    # Beyond Llama 2's own: a normalized added token (matched as "▁hello" after the normalizer)
    # and a special one that must stand alone as a word and takes the spaces after it.
    added.append({"id": len(vocab), "content": "hello", "single_word": False, "lstrip": False,
                  "rstrip": False, "normalized": True, "special": False})
    added.append({"id": len(vocab) + 1, "content": "<mask>", "single_word": True,
                  "lstrip": False, "rstrip": True, "normalized": False, "special": True})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def metaspace_from(llama2_spec):
    spec = json.loads(json.dumps(llama2_spec))
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                             "split": False}
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"},
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}]}
    spec["model"]["merges"] = [m.split(" ") for m in spec["model"]["merges"]]
    return spec


def expectations(tok, texts):
    out = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=True).ids
        out.append({
            "text": text,
            "ids": ids,
            "ids_plain": tok.encode(text, add_special_tokens=False).ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip": tok.decode(ids, skip_special_tokens=True),
        })
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "data"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(CORPUS, encoding="utf-8") as f:
        corpus = f.read()
    texts = corpus_texts(corpus) + EXTRA_TEXTS

    llama3 = train_byte_level(CORPUS)
    llama2_spec = train_sentencepiece(CORPUS)
    tokenizers = {
        "llama3": llama3,
        "gpt2": gpt2_from(llama3),
        "llama2": Tokenizer.from_str(json.dumps(llama2_spec, ensure_ascii=False)),
        "metaspace": Tokenizer.from_str(json.dumps(metaspace_from(llama2_spec),
                                                   ensure_ascii=False)),
    }
    expected = {"corpus": {}}
    for name, tok in tokenizers.items():
        if name in ("llama2", "metaspace"):
            spec = llama2_spec if name == "llama2" else metaspace_from(llama2_spec)
            text = json.dumps(spec, ensure_ascii=False, indent=None)
        else:
            text = tok.to_str()
        path = os.path.join(args.out, f"{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        expected[name] = expectations(tok, texts)
        ids = tok.encode(corpus, add_special_tokens=False).ids
        roundtrip = tok.decode(ids) == corpus
        expected["corpus"][name] = {
            "count": len(ids), "checksum": sum((i % 997 + 1) * t for i, t in enumerate(ids))}
        print(f"{path}: {os.path.getsize(path)} bytes, vocab {tok.get_vocab_size()}, "
              f"corpus {len(ids)} tokens, round trip {'exact' if roundtrip else 'NOT exact'}")
    path = os.path.join(args.out, "expected.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False, separators=(",", ":"))
    print(f"{path}: {os.path.getsize(path)} bytes, {len(texts)} texts per tokenizer")


if __name__ == "__main__":
    main()
