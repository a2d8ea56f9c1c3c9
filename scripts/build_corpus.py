"""Build the embedded training corpus from public-domain texts shipped as Debian packages.

Run once by a maintainer (needs `apt-get download`, i.e. a Debian mirror); the result,
``data/corpus/corpus.jsonl.xz``, is committed so that nothing else ever needs the network.

    python scripts/build_corpus.py --debs /tmp/debs --out data/corpus

Sources (all public domain; see data/corpus/SOURCES.md):
  * sword-text-web       World English Bible (SWORD zText, OSIS markup), one document per book
  * dict-jargon          The Jargon File 4.4.7 (dictd format), one document per entry
  * dict-devil           The Devil's Dictionary, Ambrose Bierce 1911 (dictd), one document per entry
  * sword-comm-mhcc      Matthew Henry's Concise Commentary (SWORD zCom4), one document per book
  * sword-comm-scofield  Scofield Reference Notes, 1917 (SWORD zCom), one document per book
  * sword-comm-tdavid    C. H. Spurgeon, The Treasury of David, 1869-1885 (zCom4), one per psalm
No single source may dominate: only every fourth Bible book, every second book of Henry's
commentary and every eighth psalm of Spurgeon's are kept (by canonical order).
"""
from __future__ import annotations

import argparse
import hashlib
import html
import json
import lzma
import re
import struct
import subprocess
import zlib
from pathlib import Path

PACKAGES = ("sword-text-web", "dict-jargon", "dict-devil", "sword-comm-mhcc", "sword-comm-scofield",
            "sword-comm-tdavid")
BIBLE_KEEP_EVERY = 4  # keep one book in four
MHCC_KEEP_EVERY = 2  # Henry's commentary: one book in two
TDAVID_KEEP_EVERY = 8  # Spurgeon's Treasury of David: one psalm in eight (it alone is 11.8M characters)
HELDOUT_PERCENT = 5  # whole documents, chosen by a hash of (source, title)


def _extract(debs: Path) -> Path:
    root = debs / "root"
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def _clean_osis(text: str) -> str:
    text = re.sub(r"<note\b.*?</note>", "", text, flags=re.S)  # footnotes
    text = re.sub(r"<title\b.*?</title>", "\n", text, flags=re.S)  # headings
    text = re.sub(r"<chapter\b[^>]*sID[^>]*/>", "\n\n", text)
    text = re.sub(r"<div[^>]*type=\"x-p\"[^>]*/>", "\n", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = html.unescape(text)
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r" *\n *", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def sword_documents(mod: Path, ext: str = "b", block: str = "book") -> list[tuple[str, str]]:
    """One (osisID, text) per compressed block of a SWORD zText/zCom module (a book or a chapter),
    in canonical order; ``ext`` is the index files' block letter (``b``ook or ``c``hapter)."""
    docs = []
    for testament in ("ot", "nt"):
        idx = (mod / f"{testament}.{ext}zs").read_bytes()
        blob = (mod / f"{testament}.{ext}zz").read_bytes()
        for i in range(len(idx) // 12):
            off, size, _ = struct.unpack("<III", idx[12 * i : 12 * i + 12])
            if size == 0:
                continue
            raw = zlib.decompress(blob[off : off + size]).decode("utf-8")
            pattern = r'osisID="([^"]+)"[^>]*type="book"' if block == "book" else r'<chapter\b[^>]*osisID="([^"]+)"'
            m = re.search(pattern, raw)
            title = m.group(1) if m else f"{testament}-{i}"
            text = _clean_osis(raw)
            if len(text) > 200:
                docs.append((title, text))
    return docs


def bible_documents(root: Path) -> list[tuple[str, str]]:
    """One (title, text) per book of the World English Bible, in canonical order."""
    return sword_documents(root / "usr/share/sword/modules/texts/ztext/engWEB2015eb")


def _b64(s: str) -> int:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    n = 0
    for ch in s:
        n = n * 64 + alphabet.index(ch)
    return n


def dictd_documents(root: Path, name: str) -> list[tuple[str, str]]:
    """One (headword, text) per entry of a dictd database, database headers skipped."""
    import gzip

    data = gzip.decompress((root / f"usr/share/dictd/{name}.dict.dz").read_bytes())
    docs = []
    for line in (root / f"usr/share/dictd/{name}.index").read_text("utf-8").splitlines():
        head, off, length = line.split("\t")[:3]
        if head.startswith("00-database") or head.startswith("00database"):
            continue
        body = data[_b64(off) : _b64(off) + _b64(length)].decode("utf-8", "replace")
        body = re.sub(r"[{}]", "", body)  # jargon cross-reference braces
        body = "\n".join(l.strip() for l in body.splitlines())
        body = re.sub(r"\n{3,}", "\n\n", body).strip()
        if len(body) > 40:
            docs.append((head, body))
    return docs


def heldout(source: str, title: str) -> bool:
    """Deterministic whole-document split."""
    h = int(hashlib.sha1(f"{source}/{title}".encode()).hexdigest(), 16)
    return h % 100 < HELDOUT_PERCENT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debs", type=Path, required=True, help="folder to download the .deb files into")
    ap.add_argument("--out", type=Path, default=Path("data/corpus"),
                    help="folder to write corpus.jsonl.xz into (default %(default)s)")
    args = ap.parse_args()
    args.debs.mkdir(parents=True, exist_ok=True)
    if not list(args.debs.glob("*.deb")):
        subprocess.run(["apt-get", "download", *PACKAGES], cwd=args.debs, check=True)
    root = _extract(args.debs)
    bible = bible_documents(root)[::BIBLE_KEEP_EVERY]
    comm = root / "usr/share/sword/modules/comments/zcom"
    sources = {
        "web_bible": bible,
        "jargon_file": dictd_documents(root, "jargon"),
        "devils_dictionary": dictd_documents(root, "devil"),
        "henry_commentary": sword_documents(comm / "mhcc")[::MHCC_KEEP_EVERY],
        "scofield_notes": sword_documents(comm / "scofield"),
        "treasury_of_david": sword_documents(comm / "tdavid", ext="c", block="chapter")[::TDAVID_KEEP_EVERY],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stats = {}
    with lzma.open(args.out / "corpus.jsonl.xz", "wt", encoding="utf-8", preset=9) as f:
        for source, docs in sources.items():
            n_chars = 0
            for title, text in docs:
                split = "val" if heldout(source, title) else "train"
                f.write(json.dumps({"source": source, "title": title, "split": split, "text": text}) + "\n")
                n_chars += len(text)
            stats[source] = {"documents": len(docs), "characters": n_chars}
    total = sum(s["characters"] for s in stats.values())
    for source, s in stats.items():
        print(f"{source:20s} {s['documents']:6d} docs {s['characters']:9d} chars {100 * s['characters'] / total:5.1f}%")


if __name__ == "__main__":
    main()
