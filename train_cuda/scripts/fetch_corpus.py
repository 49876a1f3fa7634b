"""Fetch the English corpus of the real run from PyPI: the Lee news corpus shipped inside gensim's wheel.

gensim (LGPL-2.1) ships, as test data, the Lee corpus (Lee, Pincombe & Welsh 2005: Australian
Broadcasting Corporation news articles, one per line): lee_background.cor (300 articles, our
training prompts) and lee.cor (50 other articles, our held-out text). Only the wheel is
downloaded (`pip download --no-deps`), never installed; run this where PyPI is reachable and
copy the output directory to the GPU machine.

    python train_cuda/scripts/fetch_corpus.py OUT_DIR
"""

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "gensim==4.4.0"
FILES = {"gensim/test/test_data/lee_background.cor": "train.txt", "gensim/test/test_data/lee.cor": "heldout.txt"}


def main(out: str) -> int:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("gensim-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            for member, name in FILES.items():
                # The files are Latin-1 (one pound sign in lee.cor); we store UTF-8.
                (out / name).write_text(z.read(member).decode("latin-1"), encoding="utf-8")
    (out / "SOURCE.md").write_text(
        f"From the PyPI wheel {wheel.name} (gensim, LGPL-2.1): {', '.join(f'{m} -> {n}' for m, n in FILES.items())}.\n"
        "The Lee corpus: ABC news articles, one per line (Lee, Pincombe & Welsh 2005), recoded from Latin-1 to UTF-8.\n"
    )
    print(out)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="corpus", help="output directory (default: corpus)")
    sys.exit(main(parser.parse_args().out))
