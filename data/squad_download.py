"""Download SQuAD v1.1 and v2.0 (train and dev JSON) and verify their SHA-256 checksums.

    python data/squad_download.py [--output_dir data/squad] [--versions v1.1 v2.0]

Layout as NVIDIA's: <output_dir>/v1.1/{train,dev}-v1.1.json and <output_dir>/v2.0/{train,dev}-v2.0.json.
An interrupted download resumes from <file>.part when run again; a file already there is verified and kept.
Needs access to rajpurkar.github.io (SQUAD_BASE_URL overrides it, e.g. a mirror or a file:// directory).
The SQuAD files are licensed CC BY-SA 4.0 by their authors (Rajpurkar et al.).
"""
import argparse
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from common.errors import InputError
from data.bert_prep import fetch_verified

DEFAULT_BASE_URL = "https://rajpurkar.github.io/SQuAD-explorer/dataset"
SHA256 = {
    "train-v1.1.json": "3527663986b8295af4f7fcdff1ba1ff3f72d07d61a20f487cb238a6ef92fd955",
    "dev-v1.1.json": "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9",
    "train-v2.0.json": "68dcfbb971bd3e96d5b46c7177b16c1a4e7d4bdef19fb204502738552dede002",
    "dev-v2.0.json": "80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8",
}
VERSIONS = ("v1.1", "v2.0")


def download(output_dir: str | os.PathLike[str], versions: Iterable[str] = VERSIONS, base_url: str = DEFAULT_BASE_URL,
             checksums: Mapping[str, str] = SHA256) -> list[Path]:
    """Fetch and verify the train and dev files of each version; returns their paths."""
    paths = []
    for version in versions:
        for split in ("train", "dev"):
            name = f"{split}-{version}.json"
            dest = Path(output_dir) / version / name
            fresh = fetch_verified(f"{base_url.rstrip('/')}/{name}", dest, "sha256", checksums[name])
            print(f"squad_download: {dest} {'downloaded and ' if fresh else ''}verified", file=sys.stderr)
            paths.append(dest)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default=str(Path(__file__).resolve().parent / "squad"))
    parser.add_argument("--versions", nargs="+", choices=VERSIONS, default=list(VERSIONS))
    args = parser.parse_args(argv)
    try:
        download(args.output_dir, args.versions, os.environ.get("SQUAD_BASE_URL", DEFAULT_BASE_URL))
    except (InputError, OSError) as err:
        print(f"squad_download.py: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
