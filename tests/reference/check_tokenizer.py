#!/usr/bin/python3
"""mpipe's tokenizers against their twins, id for id and byte for byte.

SentencePiece: models trained here by Debian's spm_train on the docs' text (a unigram
model with the default NFKC normalisation, one with byte fallback too, and a Llama-like
BPE with byte fallback; all three encoded by mpipe's own encoder, decoded by the library),
compared with python3-sentencepiece on that text and on random Unicode, encode and
decode. Byte-level BPE: merges learnt here from the same text by the published algorithm
(Sennrich et al., GPT-2's byte-to-unicode map), written as Hugging Face tokenizer.json
files (GPT-2's split pattern with "a b" merges, Llama 3's with [a, b] merges and
ignore_merges), compared with a reference encoder written below from GPT-2's encoder.py.
With --mpipe also `mpipe tokenize`: the shard's header and ids.

Run with Debian's /usr/bin/python3 (python3-sentencepiece, python3-regex)."""
import argparse
import json
import os
import random
import struct
import subprocess
import sys

import regex
import sentencepiece as spm

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
EOT = "<|endoftext|>"
failures = []


def check(condition, message):
    if not condition:
        failures.append(message)
        print("FAIL:", message)


def bytes_to_unicode():
    """GPT-2's map: printable bytes stand for themselves, the rest for 256, 257, ..."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_ENCODER = bytes_to_unicode()


def pieces(text, pattern):
    return [''.join(BYTE_ENCODER[b] for b in p.encode("utf-8")) for p in regex.findall(pattern, text)]


def learn_merges(text, pattern, count):
    """BPE training: repeatedly merge the most frequent adjacent pair (ties: the smallest pair)."""
    words = {}
    for p in pieces(text, pattern):
        words[tuple(p)] = words.get(tuple(p), 0) + 1
    merges = []
    for _ in range(count):
        pairs = {}
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] = pairs.get(pair, 0) + n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], [-ord(c) for c in p[0] + " " + p[1]]))
        merges.append(best)
        merged = {}
        for word, n in words.items():
            merged[merge_word(word, best)] = n
        words = merged
    return merges


def merge_word(word, pair):
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def bpe(piece, ranks):
    """GPT-2's encoder.py: merge the lowest-ranked pair everywhere, until none is known."""
    word = tuple(piece)
    while len(word) > 1:
        pairs = set(zip(word, word[1:]))
        best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
        if best not in ranks:
            break
        word = merge_word(word, best)
    return word


class ReferenceBpe:
    def __init__(self, merges, pattern, ignore_merges):
        self.pattern, self.ignore_merges = pattern, ignore_merges
        self.ranks = {m: i for i, m in enumerate(merges)}
        self.vocab = {BYTE_ENCODER[b]: b for b in range(256)}
        for a, b in merges:
            self.vocab.setdefault(a + b, len(self.vocab))
        self.eot = len(self.vocab)

    def encode(self, text):
        ids = []
        for n, part in enumerate(text.split(EOT)):
            if n:
                ids.append(self.eot)
            for p in pieces(part, self.pattern):
                if self.ignore_merges and p in self.vocab:
                    ids.append(self.vocab[p])
                else:
                    ids.extend(self.vocab[t] for t in bpe(p, self.ranks))
        return ids

    def tokenizer_json(self, merges, pairs):
        vocab = dict(self.vocab)
        if self.pattern == GPT2_PATTERN:
            pre = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        else:
            pre = {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": self.pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
        return {"version": "1.0", "truncation": None, "padding": None,
                "added_tokens": [{"id": self.eot, "content": EOT, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True}],
                "normalizer": None, "pre_tokenizer": pre, "post_processor": None,
                "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
                "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                          "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                          "ignore_merges": self.ignore_merges, "vocab": vocab,
                          "merges": [[a, b] for a, b in merges] if pairs else [f"{a} {b}" for a, b in merges]}}


def random_unicode(rng, n):
    """Letters, digits, spaces, punctuation and emoji from several scripts (no surrogates)."""
    ranges = [(0x20, 0x7e), (0xa0, 0x24f), (0x370, 0x3ff), (0x400, 0x4ff), (0x600, 0x6ff), (0x900, 0x97f),
              (0x3040, 0x30ff), (0x4e00, 0x4fff), (0xac00, 0xad00), (0x1f300, 0x1f64f), (0x9, 0xa)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
        if rng.random() < 0.15:
            out.append(" ")
    return "".join(out)


def run_dump(dump, mode, tokenizer, data, workdir):
    src, dst = os.path.join(workdir, "in.bin"), os.path.join(workdir, "out.bin")
    with open(src, "wb") as f:
        f.write(data)
    subprocess.run([dump, mode, tokenizer, src, dst], check=True)
    with open(dst, "rb") as f:
        return f.read()


def mpipe_ids(dump, tokenizer, text, workdir):
    raw = run_dump(dump, "encode", tokenizer, text.encode("utf-8"), workdir)
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def mpipe_decode(dump, tokenizer, ids, workdir):
    return run_dump(dump, "decode", tokenizer, struct.pack(f"<{len(ids)}i", *ids), workdir)


def read_shard(path):
    with open(path, "rb") as f:
        header = struct.unpack("<256i", f.read(1024))
        width = 2 if header[0] == 20240520 else 4
        body = f.read()
    ids = list(struct.unpack(f"<{len(body) // width}{'H' if width == 2 else 'I'}", body))
    return header, ids


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", required=True, help="tokenizer_dump")
    parser.add_argument("--mpipe", help="the mpipe binary (also checks mpipe tokenize)")
    parser.add_argument("--source", required=True, help="the source tree (its docs/*.md are the text)")
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    docs = os.path.join(args.source, "docs")
    text = "".join(open(os.path.join(docs, n), encoding="utf-8").read() for n in sorted(os.listdir(docs)) if n.endswith(".md"))
    corpus = os.path.join(args.workdir, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write(text)
    rng = random.Random(65)
    samples = [text, random_unicode(rng, 3000), "  leading and   runs of spaces\n\n\ttabs  ", "Ünïcödé ✓ 日本語 🙂 x²"]

    # SentencePiece: three models (mpipe's own encoder for each), python3-sentencepiece the twin.
    for name, options in [("unigram", ["--model_type=unigram", "--vocab_size=600"]),
                          ("unigram-bytes", ["--model_type=unigram", "--vocab_size=600", "--byte_fallback=true",
                                             "--character_coverage=0.99"]),
                          ("bpe-bytes", ["--model_type=bpe", "--vocab_size=600", "--byte_fallback=true",
                                         "--normalization_rule_name=identity", "--remove_extra_whitespaces=false",
                                         "--split_digits=true"])]:
        prefix = os.path.join(args.workdir, f"spm-{name}")
        subprocess.run(["spm_train", f"--input={corpus}", f"--model_prefix={prefix}", "--minloglevel=2",
                        "--character_coverage=1.0", *options], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        model = prefix + ".model"
        sp = spm.SentencePieceProcessor(model_file=model)
        for i, sample in enumerate(samples):
            want = sp.encode(sample)
            got = mpipe_ids(args.dump, model, sample, args.workdir)
            check(got == want, f"SentencePiece {name}, sample {i}: ids differ ({len(got)} vs {len(want)} ids)")
            back = mpipe_decode(args.dump, model, want, args.workdir)
            check(back == sp.decode(want).encode("utf-8"), f"SentencePiece {name}, sample {i}: decode differs")
            if name == "bpe-bytes":
                check(back == sample.encode("utf-8"), f"SentencePiece {name}, sample {i}: decode(encode(x)) != x")
        print(f"SentencePiece {name}: {sp.get_piece_size()} pieces, {len(samples)} samples compared")
        if name == "unigram":
            sp_model, sp_ids = model, sp.encode(text)

    # Byte-level BPE: merges learnt here, two tokenizer.json forms.
    for name, pattern, pairs, ignore in [("gpt2", GPT2_PATTERN, False, False), ("llama3", LLAMA3_PATTERN, True, True)]:
        merges = learn_merges(text, pattern, 300)
        ref = ReferenceBpe(merges, pattern, ignore)
        path = os.path.join(args.workdir, f"bpe-{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(ref.tokenizer_json(merges, pairs), f, ensure_ascii=False)
        for i, sample in enumerate(samples + [f"one{EOT}two {EOT}{EOT}"]):
            want = ref.encode(sample)
            got = mpipe_ids(args.dump, path, sample, args.workdir)
            check(got == want, f"BPE {name}, sample {i}: ids differ ({len(got)} vs {len(want)} ids)")
            check(mpipe_decode(args.dump, path, want, args.workdir) == sample.encode("utf-8"),
                  f"BPE {name}, sample {i}: decode(encode(x)) != x")
        noise = bytes(rng.randrange(256) for _ in range(5000))
        raw = run_dump(args.dump, "encode", path, noise, args.workdir)
        ids = list(struct.unpack(f"<{len(raw) // 4}i", raw))
        check(mpipe_decode(args.dump, path, ids, args.workdir) == noise, f"BPE {name}: random bytes do not round-trip")
        print(f"BPE {name}: {len(merges)} merges, {len(samples) + 1} samples and random bytes compared")

    if args.mpipe:
        out = os.path.join(args.workdir, "shards")
        subprocess.run([args.mpipe, "tokenize", "--tokenizer", sp_model, corpus, "--out", out, "--progress", "off"],
                       check=True)
        header, ids = read_shard(os.path.join(out, "tokens_000000.bin"))
        eos = spm.SentencePieceProcessor(model_file=sp_model).eos_id()
        check(header[:3] == (20240520, 1, len(ids)), f"shard header {header[:3]}, {len(ids)} ids")
        check(ids == [eos] + sp_ids, "mpipe tokenize's shard is not [EOS] + python3-sentencepiece's ids")
        print(f"mpipe tokenize: {len(ids)} ids as python3-sentencepiece's")
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all tokenizer checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
