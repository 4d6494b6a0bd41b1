#!/usr/bin/python3
"""Writes a small Megatron-LM indexed dataset (PREFIX.idx, PREFIX.bin) and, beside it,
PREFIX.json with the documents it holds, for tests/test_indexed_data.cpp.

The files follow the published layout of megatron/core/datasets/indexed_dataset.py
(version 1), written here with the standard library only so that the test does not
depend on moeflex's reader to build its input:

  .idx  b"MMIDIDX\\x00\\x00", <Q version=1>, <B dtype code>, <Q sequence count>,
        <Q document count = documents + 1>, int32 lengths, int64 byte pointers,
        int64 document indices (0, then the sequence index at each document end)
  .bin  the sequences' tokens back to back

Documents are one or more sequences (as preprocess_data.py writes with sentence
splitting); one empty document is included, which a reader must skip.

usage: write_megatron.py PREFIX DTYPE random SEED DOCUMENTS MAX_TOKEN
       write_megatron.py PREFIX DTYPE tokens FILE EOS
  DTYPE is uint16 or int32. `random`: token ids are drawn from [1, MAX_TOKEN] and every
  document ends with token 0 (the end-of-document token of --append-eod). `tokens`:
  FILE holds little-endian int32 tokens, cut into documents after each EOS.
"""
import json
import random
import struct
import sys

CODES = {"uint16": (8, "H"), "int32": (4, "i")}


def documents(seed, count, max_token):
    rng = random.Random(seed)
    docs = []
    for d in range(count):
        if d == count // 2:
            docs.append([])  # an empty document
            continue
        sequences = []
        for _ in range(rng.randint(1, 3)):
            sequences.append([rng.randint(1, max_token) for _ in range(rng.randint(5, 60))])
        sequences[-1].append(0)
        docs.append(sequences)
    return docs


def documents_of_tokens(path, eos):
    with open(path, "rb") as f:
        raw = f.read()
    tokens = struct.unpack("<%di" % (len(raw) // 4), raw)
    docs, cur = [], []
    for t in tokens:
        cur.append(t)
        if t == eos:
            docs.append([cur])
            cur = []
    if cur:
        docs.append([cur])
    return docs


def write(prefix, dtype, docs):
    code, fmt = CODES[dtype]
    width = struct.calcsize(fmt)
    lengths, pointers, doc_index = [], [], [0]
    offset = 0
    with open(prefix + ".bin", "wb") as bin_file:
        for sequences in docs:
            for seq in sequences:
                bin_file.write(struct.pack("<%d%s" % (len(seq), fmt), *seq))
                lengths.append(len(seq))
                pointers.append(offset)
                offset += len(seq) * width
            doc_index.append(len(lengths))
    with open(prefix + ".idx", "wb") as idx:
        idx.write(b"MMIDIDX\x00\x00")
        idx.write(struct.pack("<Q", 1))
        idx.write(struct.pack("<B", code))
        idx.write(struct.pack("<Q", len(lengths)))
        idx.write(struct.pack("<Q", len(doc_index)))
        idx.write(struct.pack("<%di" % len(lengths), *lengths))
        idx.write(struct.pack("<%dq" % len(pointers), *pointers))
        idx.write(struct.pack("<%dq" % len(doc_index), *doc_index))


def main():
    prefix, dtype, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "random":
        docs = documents(int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    else:
        docs = documents_of_tokens(sys.argv[4], int(sys.argv[5]))
    write(prefix, dtype, docs)
    flat = [[t for seq in sequences for t in seq] for sequences in docs]
    with open(prefix + ".json", "w") as out:
        json.dump({"documents": flat}, out)


if __name__ == "__main__":
    main()
