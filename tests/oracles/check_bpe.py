#!/usr/bin/env python3
"""Oracle for data/bpe_tokenizer: what the Hugging Face `tokenizers` package makes of
our test texts, for tests/test_bpe_oracle.cpp to compare against token for token.

    pip install tokenizers
    python3 tests/oracles/check_bpe.py OUT_DIR [--unicode VERSION]

Writes into OUT_DIR:
  qwen2-style.json     a small BPE trained here with `tokenizers` on the corpus and the
                       hostile text (so its odd characters have merges), shaped like
                       Qwen2.5's tokenizer.json: NFC, Split(Qwen2's regex, Isolated) +
                       ByteLevel(use_regex false), ByteLevel decoder, special tokens
                       after the vocabulary, "" subword prefix/suffix
  neox-variant.json    the shipped GPT-NeoX file with the options it does not use
                       itself: Sequence[NFC] normalizer, Split(String) pre-tokenizer,
                       ByteLevel add_prefix_space
  hostile.txt          emoji, CJK, combining marks, RTL, controls, odd spaces,
                       special tokens in the text...
  random.txt           random assigned code points from planes 0, 1, 2, 14 (fixed
                       seed); written only when Python's Unicode data has the version
                       given by --unicode (our regex library's: characters assigned
                       later are not letters to it, see data/bpe_tokenizer.hpp)
  TOK.TEXT.ids         uint32 little-endian ids of `tokenizers`' encode
  TOK.TEXT.decoded     its decode(ids, skip_special_tokens=False), UTF-8
  versions.txt         the tokenizers version
for TOK in gpt-neox, qwen2-style, neox-variant and TEXT in tinyshakespeare, hostile,
random. Exits 77 with the reason when `tokenizers` is missing (the test then reports
itself skipped).
"""
import json
import os
import random
import struct
import sys
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEOX = os.path.join(ROOT, "data/tokenizers/gpt-neox-olmo-dolma-v1_5.json")
CORPUS = os.path.join(ROOT, "data/corpus/tinyshakespeare.txt")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")

try:
    import tokenizers
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
except ImportError as e:
    print(f"SKIPPED (oracle): python3 cannot import the `tokenizers` package ({e}); pip install tokenizers")
    sys.exit(77)


def hostile_text():
    parts = [
        "Hello, World! It's IT'S it'S they'LL we'VE I'M you'D don't 'tis o'er ſ 'ſ\n",
        # emoji: ZWJ sequences, skin tones, flags, keycaps, variation selectors
        "👩‍👩‍👧‍👦 👍🏽 🇯🇵🇺🇦 #️⃣ ❤️ ☺︎ 🧑🏿‍🚀 😀😃😄 🫠\n",
        # CJK, kana, Hangul (precomposed and as conjoining jamo, which NFC composes)
        "日本語のテキスト、中文文本。한국어 텍스트 \u1112\u1161\u11ab\u1100\u1173\u11af ｶﾀｶﾅ\n",
        # combining marks: decomposed Latin (NFC composes), stacked marks, Zalgo
        "cafe\u0301 e\u0301\u0302 A\u030a \u212b \u2126 n\u0303o\u0308 Z\u0351\u0300\u0315a\u0364\u0358l\u0310g\u0352o\u0350\n",
        "q\u0307\u0323 s\u0323\u0307 \u1e69 \u0958 \u0915\u093c \ufb01 \u2460 x\u0327\u0301\n",
        # right to left, bidi controls
        "مرحبا بالعالم \u200fשלום עולם\u202e reversed \u202c العربية١٢٣ ۴۵۶\n",
        # control characters, C1 controls, NUL, DEL, BOM, zero width
        "tab\there\x01\x02\x1b[31mred\x1b[0m\x7f \x00nul \u0085nel\u0085 \ufeffbom \u200bzw\u200csp\u200d\n",
        # odd spaces and line ends
        "a\u00a0b\u2000c\u2003d\u3000e\u180ef\u2028g\u2029h\u202fi\u205fj \r\nk\rl\n\n\n m\t\t n \x0b\x0c o\n",
        # U+180E is white space to PCRE2 but not to Oniguruma; U+0085 is to both
        "!\u180e? x \u180e\u180e y\u180e \u0085\u0085z .\u0085, word \u180eword \u180e\n",
        # runs of spaces (NeoX has added tokens for 2..24 spaces)
        "x" + " " * 1 + "y" + " " * 2 + "z" + " " * 24 + "w" + " " * 25 + "v" + " " * 60 + "u\n",
        "   leading and trailing   \n" + " " * 7 + "\n" + "\t \t \n",
        # numbers in many scripts
        "0123456789 ０１２ ²³¹ ½ ¾ Ⅻ ⅷ 〇 一二三 ١٢٣ १२३ 1,000.50 3.14e-10 12:30\n",
        # special tokens and near misses, inside words and next to combining marks
        "<|endoftext|>doc two<|endoftext|><|padding|><|im_start|>user<|im_end|> <tool_call>x</tool_call>\n",
        "<|endoftext|\u0301 <|endoftext|>\u0301 |||IP_ADDRESS||| |||EMAIL_ADDRESS|||x<|endo<|endoftext|>\n",
        # punctuation runs, quotes, math, private use, noncharacters, the last code point
        "!!!??? ... —– «»„“” ‘’ ∑∫√∞≠ ∀x∈ℝ \ue000\uf8ff \ufffd \uffff \U0010ffff \U0001d400\U0001d7d8\n",
        # scripts: Thai, Devanagari, Tamil, Georgian, Armenian, Greek, Cyrillic, Ethiopic
        "ภาษาไทย हिन्दी தமிழ் ქართული Հայերեն Ελληνικά Русский ግዕዝ\n",
        "Wörter mit Umlauten: ÄÖÜäöüß; İstanbul ıi; ǅ ǈ ǋ; ﬀ ﬃ\n",
    ]
    text = "".join(parts)
    # A long line without spaces in a script with no ASCII letters.
    text += "漢字" * 300 + "\n"
    return text


def random_text(seed=1234, n=20000):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.15:
            out.append(rng.choice([" ", " ", "  ", "\n", "\t", "\r\n", "'s", "<|endoftext|>"]))
            continue
        plane = rng.choice([0, 0, 0, 0, 1, 2, 14])
        while True:
            cp = plane * 0x10000 + rng.randrange(0x10000)
            # Assigned code points (private use included), no surrogates.
            if unicodedata.category(chr(cp)) not in ("Cn", "Cs"):
                break
        out.append(chr(cp))
    return "".join(out)


def qwen2_style(path, hostile_path):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    from tokenizers import processors
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # The hostile text too (many times), so that its odd characters have merges and a
    # pre-tokenizer boundary in the wrong place among them changes the ids.
    tok.train([CORPUS] + [hostile_path] * 20, trainer)
    # As in Qwen2.5: special tokens after the vocabulary, one plain added token.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]])
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False),
                    AddedToken("</tool_call>", special=False, normalized=False)])
    j = json.loads(tok.to_str())
    j["model"]["continuing_subword_prefix"] = ""
    j["model"]["end_of_word_suffix"] = ""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False)


def neox_variant(path):
    with open(NEOX, encoding="utf-8") as f:
        j = json.load(f)
    j["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFC"}]}
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": "ab"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    ]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False)


def main():
    args = sys.argv[1:]
    unicode = None
    if len(args) == 3 and args[1] == "--unicode":
        unicode = args[2]
        args = args[:1]
    if len(args) != 1:
        sys.exit(__doc__)
    out = args[0]
    os.makedirs(out, exist_ok=True)
    texts = {
        "tinyshakespeare": open(CORPUS, encoding="utf-8").read(),
        "hostile": hostile_text(),
    }
    if unicode is None or unicode == unicodedata.unidata_version:
        texts["random"] = random_text()
    else:
        print(f"oracle: no random text: Python's Unicode data is {unicodedata.unidata_version}, "
              f"the regex library's {unicode}")
    for name, text in texts.items():
        if name != "tinyshakespeare":
            with open(os.path.join(out, name + ".txt"), "w", encoding="utf-8", newline="") as f:
                f.write(text)
    qwen2_style(os.path.join(out, "qwen2-style.json"), os.path.join(out, "hostile.txt"))
    neox_variant(os.path.join(out, "neox-variant.json"))
    toks = {
        "gpt-neox": NEOX,
        "qwen2-style": os.path.join(out, "qwen2-style.json"),
        "neox-variant": os.path.join(out, "neox-variant.json"),
    }
    for tname, tpath in toks.items():
        tok = Tokenizer.from_file(tpath)
        for xname, text in texts.items():
            ids = tok.encode(text).ids
            with open(os.path.join(out, f"{tname}.{xname}.ids"), "wb") as f:
                f.write(struct.pack(f"<{len(ids)}I", *ids))
            with open(os.path.join(out, f"{tname}.{xname}.decoded"), "wb") as f:
                f.write(tok.decode(ids, skip_special_tokens=False).encode("utf-8"))
    with open(os.path.join(out, "versions.txt"), "w") as f:
        f.write(f"tokenizers {tokenizers.__version__}\nunicodedata {unicodedata.unidata_version}\n")
    print(f"oracle: tokenizers {tokenizers.__version__}, {len(toks)} tokenizers x {len(texts)} texts in {out}")


if __name__ == "__main__":
    main()
