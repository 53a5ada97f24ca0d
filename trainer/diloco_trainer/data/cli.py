"""`diloco data`: `prepare` turns local text / JSONL / Parquet files into token shards; `tokenizer` trains a small
byte-level BPE (tokenizer.json) on local text files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prep = sub.add_parser("prepare", help="tokenize local text/JSONL/Parquet files into uint16/uint32 shards "
                                          "plus manifest.json (docs/data.md); a re-run on unchanged inputs is a no-op")
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="files or directories (.jsonl/.json: JSON lines, "
                                                                 ".parquet: Parquet, anything else: text)")
    prep.add_argument("--tokenizer", required=True, help="'bytes' or the path of a tokenizer.json")
    prep.add_argument("--out", required=True, type=Path, help="the shard directory (its own: stale shards go)")
    prep.add_argument("--text-field", default="text", help="the field of JSONL/Parquet records holding the text")
    prep.add_argument("--sample-by", choices=("document", "paragraph", "line"), default="document",
                      help="one document of a text file: the whole file (default), a paragraph, or a line")
    prep.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default 2^26)")
    prep.add_argument("--batch-size", type=int, default=1000, help="records tokenized per batch")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    tok = sub.add_parser("tokenizer", help="train a byte-level BPE on local text files, write tokenizer.json")
    tok.add_argument("inputs", nargs="+", metavar="INPUT", help="text files or directories of them")
    tok.add_argument("--vocab", type=int, required=True, help="vocabulary size (at least 257)")
    tok.add_argument("--out", required=True, type=Path, help="where to write tokenizer.json")


def run(args: argparse.Namespace) -> int:
    try:
        return _prepare(args) if args.action == "prepare" else _tokenizer(args)
    except ValueError as exc:
        print(f"diloco data {args.action}: {exc}", file=sys.stderr)
        return 2


def _prepare(args: argparse.Namespace) -> int:
    from diloco_trainer.data.prepare import DEFAULT_SHARD_TOKENS, PrepareOptions, describe, prepare

    opts = PrepareOptions(inputs=args.inputs, tokenizer=args.tokenizer, out=args.out, text_field=args.text_field,
                          sample_by=args.sample_by, shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
                          batch_size=args.batch_size, progress=not args.no_progress)
    manifest, wrote = prepare(opts)
    if wrote:
        print(f"wrote {describe(manifest, args.out)}")
    else:
        print(f"up to date, nothing to do (same inputs and tokenizer): {describe(manifest, args.out)}")
    return 0


def _tokenizer(args: argparse.Namespace) -> int:
    from diloco_trainer.data.corpus import list_text_files
    from diloco_trainer.data.tokenizer import train_bpe

    files = []
    for name in args.inputs:
        path = Path(name).expanduser()
        files.extend(list_text_files(path) if path.is_dir() else [path])
    tok = train_bpe(files, args.vocab, args.out)
    print(f"wrote {args.out}: byte-level BPE, {tok.vocab_size} tokens, trained on {len(files)} file(s)")
    return 0
